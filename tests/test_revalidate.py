"""``nexus-sli validate``: the stored reference through the runtime a config names, on this machine."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
from google.protobuf import text_format

from nexus_sli.cli.main import main
from nexus_sli.exporter.errors import NexusError, ValidationError
from nexus_sli.exporter.export import export_report
from nexus_sli.exporter.export.pipeline import ExportOptions, run_export
from nexus_sli.exporter.export.revalidate import RECORD, revalidate
from nexus_sli.exporter.triton import config as tc


@pytest.fixture(scope="module")
def repo(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("revalidate")
    model = str(tiny_checkpoint("bert"))
    run_export(ExportOptions(model=model, name="fp32", out=out, task="embedding"))
    run_export(ExportOptions(model=model, name="int8", out=out, task="embedding", precision="int8"))
    run_export(ExportOptions(model=model, name="ov", out=out, task="embedding", backend="openvino", precision="fp32"))
    run_export(ExportOptions(model=model, name="gpu", out=out, task="embedding", device="gpu", backend="auto",
                             precision="auto"))
    run_export(ExportOptions(model=str(tiny_checkpoint("roberta")), name="other", out=out, task="embedding"))
    # the earlier layout: token states out, pooled by the python post-processing step
    run_export(ExportOptions(model=model, name="legacy", out=out, task="embedding", pool_in_graph=False))
    return out


@pytest.mark.parametrize("name, backend", [("fp32", "onnxruntime"), ("int8", "onnxruntime"), ("ov", "openvino"),
                                           ("gpu", "onnxruntime-tensorrt")])
def test_every_variant_validates_again_here_and_is_recorded(repo, name, backend):
    record = revalidate(repo, name)
    exported = export_report.read(repo / f"{name}_encoder").validation
    assert record["passed"] and record["backend"] == backend and record["precision"] == exported.precision
    assert record["thresholds"] == exported.thresholds and record["texts"] == exported.texts
    assert json.loads((repo / f"{name}_encoder" / RECORD).read_text()) == record


def test_the_fp16_graph_runs_on_the_cpu_provider_here(repo):
    assert revalidate(repo, "gpu")["providers"] == ["CPUExecutionProvider"]


def test_a_gpu_config_is_validated_with_its_own_accelerator_options(repo, tmp_path, caplog):
    # an option edited into config.pbtxt reaches the provider choice: ONNX Runtime does not read this
    # one, and the note naming it proves the config (not the target's defaults) was used
    copy = tmp_path / "repo"
    shutil.copytree(repo / "gpu_encoder", copy / "gpu_encoder")
    path = copy / "gpu_encoder" / "config.pbtxt"
    config = tc.read(path)
    config.optimization.execution_accelerators.gpu_execution_accelerator[0].parameters["edited_by_hand"] = "1"
    path.write_text(text_format.MessageToString(config))
    with caplog.at_level(logging.INFO):
        assert revalidate(copy, "gpu")["passed"]
    assert "tensorrt accelerator parameters ONNX Runtime does not read, ignored: edited_by_hand" in caplog.text


def test_a_model_file_that_is_not_the_exported_one_fails(repo, tmp_path):
    copy = tmp_path / "repo"
    shutil.copytree(repo, copy)
    shutil.copyfile(copy / "other_encoder" / "1" / "model.onnx", copy / "fp32_encoder" / "1" / "model.onnx")
    with pytest.raises(ValidationError, match="does not match PyTorch on this machine") as failed:
        revalidate(copy, "fp32")
    assert not json.loads((copy / "fp32_encoder" / RECORD).read_text())["passed"]
    assert failed.value.failures


def test_the_command_prints_the_figures_and_explains_bad_input(repo, tmp_path, capsys):
    assert main(["validate", "--repository", str(repo), "--model", "fp32"]) == 0
    assert json.loads(capsys.readouterr().out)["passed"] is True
    assert main(["validate", "--repository", str(repo), "--model", "nope"]) == 2
    assert "holds no encoder config" in capsys.readouterr().err
    copy = tmp_path / "old"
    shutil.copytree(repo / "fp32_encoder", copy / "fp32_encoder")
    (copy / "fp32_encoder" / "reference.npz").unlink()
    with pytest.raises(NexusError, match="export the model again"):
        revalidate(copy, "fp32")


def test_a_repository_exported_before_pooling_moved_into_the_graph_validates_again(repo, tmp_path):
    """Its validation.json has no ``pooled_in_graph`` (nor ``outputs``): the graph's token states are pooled
    on both sides as before.  A pooled graph put in its place fails on the output names."""
    copy = tmp_path / "repo"
    shutil.copytree(repo / "legacy_encoder", copy / "legacy_encoder")
    exported = export_report.read(copy / "legacy_encoder")
    assert exported.pooled_in_graph is False and exported.outputs == ["last_hidden_state"]
    older = {k: v for k, v in exported.to_dict().items() if k not in ("version", "pooled_in_graph", "outputs")}
    export_report.path(copy / "legacy_encoder").write_text(json.dumps(older))  # the older layout, on purpose
    record = revalidate(copy, "legacy")
    assert record["passed"] and record["max_abs_diff"] <= 1e-4 and record["cosine_min"] > 0.9999
    shutil.copyfile(repo / "fp32_encoder" / "1" / "model.onnx", copy / "legacy_encoder" / "1" / "model.onnx")
    with pytest.raises(ValidationError, match="graph outputs \\['EMBEDDING', 'TOKEN_EMBEDDINGS'\\]"):
        revalidate(copy, "legacy")


def test_a_model_serve_swapped_in_validates_at_its_version(repo, tmp_path, capsys):
    """serve's search swaps its winner in at the next version folder, and the served one is the newest."""
    copy = tmp_path / "repo"
    shutil.copytree(repo / "fp32_encoder", copy / "fp32_encoder")
    (copy / "fp32_encoder" / "1").rename(copy / "fp32_encoder" / "2")  # as the swap leaves it
    assert main(["validate", "--repository", str(copy), "--model", "fp32"]) == 0
    assert json.loads((copy / "fp32_encoder" / RECORD).read_text())["passed"]
    shutil.rmtree(copy / "fp32_encoder" / "2")
    with pytest.raises(NexusError, match="holds no version folder"):
        revalidate(copy, "fp32")
