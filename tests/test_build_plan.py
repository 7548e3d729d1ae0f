"""``nexus-sli build-plan`` on a machine without TensorRT: everything but the engine itself.

TensorRT cannot be installed on this project's machines, so the build and the
engine run are not exercised here (docs/gpu.md says so).  What is: the clear
error where TensorRT is missing, the refusal of a model that is not a GPU
export, the profile derived from the config and the model's limit, the fp32
layer table against the ops the fp16 graph keeps in fp32, and the switch to
``tensorrt_plan`` through Triton's protobuf schema, including what a crash in
the middle of it leaves behind.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys

import numpy as np
import onnx
import pytest
from google.protobuf import text_format

from nexus_sli.cli.main import main
from nexus_sli.exporter.errors import GPURuntimeUnavailableError, NexusError, PlanBuildError
from nexus_sli.exporter.export import build_plan as bp
from nexus_sli.exporter.export import export_report, fp16
from nexus_sli.exporter.export.pipeline import ExportOptions, run_export
from nexus_sli.exporter.export.pooling import PREFIX as POOLING_PREFIX
from nexus_sli.exporter.serving import gpu_on_cpu
from nexus_sli.exporter.targets import TARGETS, configurations_for, serving_target
from nexus_sli.exporter.targets import tensorrt_plan as trt_plan
from nexus_sli.exporter.triton import config as tc
from nexus_sli.exporter.triton import staging

no_tensorrt = pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None,
                                 reason="TensorRT is installed here: the missing-TensorRT path does not apply")
PB = tc.pb


@pytest.fixture(scope="module")
def repo(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("build-plan")
    model = str(tiny_checkpoint("bert"))
    run_export(ExportOptions(model=model, name="gpu", out=out, task="embedding", device="gpu", backend="auto",
                             precision="auto"))
    run_export(ExportOptions(model=model, name="cpu", out=out, task="embedding"))
    return out


@pytest.fixture()
def copy(repo, tmp_path):
    shutil.copytree(repo, tmp_path / "repo")
    return tmp_path / "repo"


def _record(capability: str, folder) -> export_report.PlanRecord:
    """What build_plan records for a plan that passed, for the switch tests (no engine is built here)."""
    exported = export_report.read(folder)
    assert exported.validation.passed
    return export_report.PlanRecord(
        validation=exported.validation, file=trt_plan.plan_filename(capability), tensorrt="10.5.0",
        gpu="NVIDIA test GPU", compute_capability=capability, host="gpu-host",
        profile={"min": [1, 1], "opt": [16, 128], "max": [64, 128]}, fp32_layers=0,
        workspace_bytes=trt_plan.WORKSPACE_BYTES, validated_on=trt_plan.TensorRTPlan.validated_on)


@no_tensorrt
def test_without_tensorrt_the_command_says_where_to_run_it_and_changes_nothing(copy, capsys):
    before = (copy / "gpu_encoder" / "config.pbtxt").read_text()
    assert main(["build-plan", "--repository", str(copy), "--model", "gpu"]) == 2
    error = capsys.readouterr().err
    assert "TensorRT's Python package cannot be imported here" in error
    assert "nvcr.io/nvidia/tritonserver" in error and "docs/gpu.md" in error
    assert (copy / "gpu_encoder" / "config.pbtxt").read_text() == before
    assert not list((copy / "gpu_encoder" / "1").glob("*.plan"))


@pytest.mark.parametrize("name, reason", [("cpu", "not a GPU export"), ("nope", "holds no encoder config")])
def test_a_model_that_is_not_a_gpu_export_is_refused(repo, name, reason, capsys):
    assert main(["build-plan", "--repository", str(repo), "--model", name]) == 2
    assert reason in capsys.readouterr().err


def test_the_plan_profile_is_the_one_the_tensorrt_accelerator_got(repo):
    # one home: build-plan's (batch, sequence) profile and the ONNX Runtime accelerator's strings
    config = tc.read(repo / "gpu_encoder" / "config.pbtxt")
    exported = export_report.read(repo / "gpu_encoder")
    dims = tc.profile_dims(exported.max_length, config.max_batch_size)
    assert dims == {"min": (1, 1), "opt": (config.max_batch_size // 4, min(128, exported.max_length)),
                    "max": (config.max_batch_size, exported.max_length)}
    (accelerator,) = config.optimization.execution_accelerators.gpu_execution_accelerator
    for kind, (batch, length) in dims.items():
        assert accelerator.parameters[f"trt_profile_{kind}_shapes"] == ",".join(
            f"{name}:{batch}x{length}" for name in exported.inputs)
    assert tc.profile_dims(512, 8) == {"min": (1, 1), "opt": (2, 128), "max": (8, 512)}


def test_every_op_the_fp16_graph_keeps_in_fp32_is_pinned_in_tensorrt(repo):
    assert set(trt_plan.FP32_LAYERS) | trt_plan.FUSED_ONLY == set(fp16.FP32_OPS)
    ops = {node.op_type for node in onnx.load(str(repo / "gpu_encoder" / "1" / "model.onnx")).graph.node}
    assert not ops & trt_plan.FUSED_ONLY  # the plain graph: nothing the table leaves out
    assert {"LayerNormalization", "Softmax"} <= ops
    assert trt_plan.wants_fp32("NORMALIZATION", None) and trt_plan.wants_fp32("SOFTMAX", None)
    assert trt_plan.wants_fp32("ELEMENTWISE", "POW") and trt_plan.wants_fp32("UNARY", "SQRT")
    assert trt_plan.wants_fp32("REDUCE", "AVG")
    assert not trt_plan.wants_fp32("ELEMENTWISE", "SUM") and not trt_plan.wants_fp32("REDUCE", "MAX")
    assert not trt_plan.wants_fp32("MATRIX_MULTIPLY", None)
    # the pooling at the end of the graph: pinned by its nodes' names, whatever the layer type
    pooling = [n.name for n in onnx.load(str(repo / "gpu_encoder" / "1" / "model.onnx")).graph.node
               if n.name.startswith(POOLING_PREFIX)]
    assert pooling and all(trt_plan.wants_fp32("REDUCE", "SUM", name) for name in pooling)
    # a rotary table's nodes (fp16.rotary_nodes): by the node's name, with or without the parser's prefix
    rotary = frozenset({"/model/rotary_emb/Mul", "/model/rotary_emb/Cos"})
    assert trt_plan.wants_fp32("ELEMENTWISE", "PROD", "/model/rotary_emb/Mul", rotary)
    assert trt_plan.wants_fp32("UNARY", "COS", "node_of_/model/rotary_emb/Cos", rotary)
    assert not trt_plan.wants_fp32("ELEMENTWISE", "PROD", "/model/rotary_emb/Mul_1", rotary)
    assert not trt_plan.wants_fp32("ELEMENTWISE", "PROD", "/model/rotary_emb/Mul")  # none named: none pinned


def test_an_engine_whose_tensors_differ_from_the_config_is_caught(repo):
    expected = bp.io_types(tc.read(repo / "gpu_encoder" / "config.pbtxt"))
    # the graph ends in the pooling: its one output is the embedding, fp32 (keep_io_types, fp32 pooling)
    assert expected["input_ids"] == "TYPE_INT64" and expected["EMBEDDING"] == "TYPE_FP32"
    assert "last_hidden_state" not in expected
    assert trt_plan.io_type_mismatches(expected, dict(expected)) == []
    int32 = {**expected, "input_ids": "TYPE_INT32"}
    assert trt_plan.io_type_mismatches(expected, int32) == [
        "input_ids: the config says TYPE_INT64, the engine TYPE_INT32"]


def test_the_switched_config_is_a_tensorrt_plan_on_the_gpu(repo):
    config = tc.read(repo / "gpu_encoder" / "config.pbtxt")
    switched = text_format.Parse(text_format.MessageToString(
        bp.plan_config(config, {"8.6": "model.sm86.plan"}, "model.sm86.plan")), PB.ModelConfig())
    assert switched.platform == "tensorrt_plan" and not switched.backend
    assert [g.kind for g in switched.instance_group] == [PB.ModelInstanceGroup.KIND_GPU]
    assert switched.default_model_filename == "model.sm86.plan" and not switched.cc_model_filenames
    assert not switched.HasField("optimization")
    assert (switched.input, switched.output, switched.max_batch_size) == (config.input, config.output,
                                                                           config.max_batch_size)
    assert switched.dynamic_batching == config.dynamic_batching
    two = bp.plan_config(config, {"8.0": "model.sm80.plan", "8.6": "model.sm86.plan"}, "model.sm80.plan")
    assert dict(two.cc_model_filenames) == {"8.0": "model.sm80.plan", "8.6": "model.sm86.plan"}


def test_install_switches_by_renames_and_records_each_gpu(copy):
    folder = copy / "gpu_encoder"
    config = tc.read(folder / "config.pbtxt")
    bp.install(folder, config, b"engine for 8.6", _record("8.6", folder))
    on_disk = tc.read(folder / "config.pbtxt")
    assert on_disk.platform == "tensorrt_plan" and on_disk.default_model_filename == "model.sm86.plan"
    assert (folder / "1" / "model.sm86.plan").read_bytes() == b"engine for 8.6"
    assert (folder / "1" / "model.onnx").is_file()  # kept: the source of the next GPU's plan
    assert not list(folder.rglob("*.partial"))
    recorded = export_report.read(folder).tensorrt_plans["8.6"]
    assert (recorded.tensorrt, recorded.gpu, recorded.compute_capability) == ("10.5.0", "NVIDIA test GPU", "8.6")
    bp.gpu_export(folder)  # a switched encoder is still a GPU export: plans for more GPUs can follow
    bp.install(folder, on_disk, b"engine for 9.0", _record("9.0", folder))
    both = tc.read(folder / "config.pbtxt")
    assert dict(both.cc_model_filenames) == {"8.6": "model.sm86.plan", "9.0": "model.sm90.plan"}
    assert both.default_model_filename == "model.sm90.plan"


def _crash_when_replacing(monkeypatch, name: str) -> None:
    """The install's renames fail ("disk full") at the file called ``name``, and only there."""
    real = staging.replace_file

    def crash(path, data):
        if path.name == name:
            raise OSError("disk full")
        real(path, data)

    monkeypatch.setattr(staging, "replace_file", crash)


def test_a_crash_before_the_config_is_renamed_leaves_the_onnx_model_whole(copy, monkeypatch):
    folder = copy / "gpu_encoder"
    config = tc.read(folder / "config.pbtxt")
    _crash_when_replacing(monkeypatch, "config.pbtxt")
    before = export_report.path(folder).read_bytes()
    with pytest.raises(OSError):
        bp.install(folder, config, b"engine", _record("8.6", folder))
    on_disk = tc.read(folder / "config.pbtxt")
    assert on_disk == config and (folder / "1" / on_disk.default_model_filename).is_file()
    # no record of a plan the config does not serve
    assert export_report.path(folder).read_bytes() == before


def test_a_crash_after_the_config_leaves_the_plan_served_and_no_record_of_another(copy, monkeypatch):
    folder = copy / "gpu_encoder"
    config = tc.read(folder / "config.pbtxt")
    _crash_when_replacing(monkeypatch, export_report.FILE)
    with pytest.raises(OSError):
        bp.install(folder, config, b"engine", _record("8.6", folder))
    on_disk = tc.read(folder / "config.pbtxt")
    assert on_disk.platform == "tensorrt_plan" and (folder / "1" / on_disk.default_model_filename).is_file()
    assert "tensorrt_plans" not in export_report.read(folder).to_dict()


class _Refusing:
    """Stands in for TensorRT 10's IExecutionContext, which cannot be installed here: its
    ``set_input_shape`` returns False (it does not raise) for a shape outside the profile."""

    def set_input_shape(self, name, shape):
        return False


class _Engine:
    def get_tensor_profile_shape(self, name, profile):
        return (1, 1), (8, 64), (32, 128)


def test_a_shape_outside_the_profile_is_a_clear_error_not_a_silent_run():
    runner = object.__new__(trt_plan.EngineRunner)
    runner.context, runner.engine, runner.input_names, runner.output_names = _Refusing(), _Engine(), ["input_ids"], []
    runner._dtype = lambda name: np.dtype(np.int64)
    runner.cuda = None  # never reached: the shape is refused first
    with pytest.raises(PlanBuildError, match=r"input_ids of shape \(64, 512\) is outside .*\(1, 1\) \.\. \(32, 128\)"):
        runner.run(None, {"input_ids": np.zeros((64, 512), dtype=np.int64)})


def test_the_plan_target_is_registered_for_validate_but_never_exported(copy, tiny_checkpoint, tmp_path):
    assert serving_target("tensorrt_plan", "", "KIND_GPU") is TARGETS["tensorrt-plan"]
    with pytest.raises(NexusError, match="built on the GPU host .* --backend auto"):
        configurations_for("tensorrt-plan", "fp16", device="gpu")  # as the export's options are checked, first
    with pytest.raises(NexusError, match="built on the GPU host"):
        run_export(ExportOptions(model=str(tiny_checkpoint("bert")), name="x", out=tmp_path / "out",
                                 task="embedding", device="gpu", backend="tensorrt-plan", precision="fp16"))
    assert not (tmp_path / "out" / "x_encoder").exists()


@no_tensorrt
def test_validate_runs_a_plan_through_tensorrt_and_says_where_without_it(copy, capsys):
    folder = copy / "gpu_encoder"
    bp.install(folder, tc.read(folder / "config.pbtxt"), b"engine", _record("8.6", folder))
    assert main(["validate", "--repository", str(copy), "--model", "gpu"]) == 2
    assert "TensorRT's Python package cannot be imported here" in capsys.readouterr().err


@no_tensorrt
def test_the_gpu_host_needs_neither_pytorch_nor_onnxruntime_nor_openvino(copy):
    # what build-plan imports before it reaches TensorRT: the [plan] extra, nothing heavier
    blocked = ("torch", "transformers", "onnxruntime", "openvino", "nncf", "sentence_transformers")
    code = (f"import sys\nfor m in {blocked!r}: sys.modules[m] = None\n"
            "from nexus_sli.cli.main import main\n"
            f"sys.exit(main(['build-plan', '--repository', {str(copy)!r}, '--model', 'gpu']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "TensorRT's Python package cannot be imported here" in done.stderr, done.stderr


@pytest.mark.skipif(gpu_on_cpu.gpu_visible(), reason="a GPU is visible here")
def test_without_a_gpu_the_cuda_runtime_says_where_to_run(copy):
    # real calls into libcudart where this machine has it (no driver, no device), else its absence
    with pytest.raises(GPURuntimeUnavailableError, match="run nexus-sli build-plan on the GPU host"):
        trt_plan.CudaRuntime()
