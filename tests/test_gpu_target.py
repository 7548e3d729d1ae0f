"""The GPU target on a CPU machine: the fp16 graph, its Triton config, and its fidelity on ONNX Runtime's CPU provider.

fp16 arithmetic happens only on a GPU; these tests check what can be checked
here: the fp16 weights and graph, the ops kept in fp32, the config a GPU
Triton reads, and the tokenizer's buckets.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto

from nexus_sli.exporter.export import fp16
from nexus_sli.exporter.export.pipeline import ExportOptions, run_export
from nexus_sli.exporter.export.revalidate import revalidate
from nexus_sli.exporter.targets import configurations_for
from nexus_sli.exporter.triton import config as tc
from nexus_sli.exporter.triton.python_models.encoding import padded_length
from helpers.tiny_models import COMMON, TINY_CONFIGS, build_tiny, plain_graph, quiet_session
from helpers.tiny_remote_models import REMOTE_TINY, build_tiny_remote


def _gpu_export(model: str | None, out, name: str, **options):
    result = run_export(ExportOptions(model=model, name=name, out=out, device="gpu", backend="auto",
                                      precision="auto", **options))
    return result.report, tc.read(out / f"{name}_encoder" / "config.pbtxt")


@pytest.fixture(scope="module")
def minilm(tmp_path_factory, exports):
    out = exports.copy("minilm_gpu", tmp_path_factory.mktemp("gpu"), as_name="minilm")
    return out, exports.export("minilm_gpu"), tc.read(out / "minilm_encoder" / "config.pbtxt")


def test_the_packaged_model_exports_fp16_for_tensorrt_at_full_fidelity(minilm):
    _, report, config = minilm
    assert (report.validation.backend, report.validation.precision, report.device, report.validation.passed) == (
        "onnxruntime-tensorrt", "fp16", "gpu", True)
    assert report.validation.cosine_min >= 0.999 and report.validation.cosine_mean >= 0.9999
    assert "not fp16 arithmetic" in report.validated_on
    assert config.platform == "onnxruntime_onnx"
    assert config.instance_group[0].kind == tc.pb.ModelInstanceGroup.KIND_GPU
    assert config.dynamic_batching.max_queue_delay_microseconds == tc.GPU_QUEUE_DELAY_US
    # a GPU execution merges up to a client's batch of 256 and runs on several instances: the whole repository's
    # steps follow the encoder (a CPU repository's keep 64 and one instance: test_serving)
    assert config.max_batch_size == tc.GPU_MAX_BATCH_SIZE > tc.MAX_BATCH_SIZE
    assert config.instance_group[0].count == tc.GPU_INSTANCES > 1
    out, _, _ = minilm
    assert {tc.read(path).max_batch_size for path in out.glob("*/config.pbtxt")} == {tc.GPU_MAX_BATCH_SIZE}


def test_the_tensorrt_accelerator_carries_fp16_and_profiles_from_the_model_limits(minilm):
    _, report, config = minilm
    (accelerator,) = config.optimization.execution_accelerators.gpu_execution_accelerator
    params = dict(accelerator.parameters)
    assert accelerator.name == "tensorrt" and set(params) <= tc.ACCELERATOR_KEYS["tensorrt"]
    assert params["precision_mode"] == "FP16" and params["trt_engine_cache_enable"] == "1"
    names, length = report.inputs, report.max_length
    assert params["trt_profile_min_shapes"] == ",".join(f"{n}:1x1" for n in names)
    assert params["trt_profile_max_shapes"] == ",".join(f"{n}:{tc.GPU_MAX_BATCH_SIZE}x{length}" for n in names)
    assert length == 256


def test_the_gpu_tokenizer_pads_to_buckets_not_to_one_width(minilm):
    out, _, _ = minilm
    tokenizer = tc.read(out / "minilm_tokenizer" / "config.pbtxt")
    assert tokenizer.parameters["pad_widths"].string_value == "16,32,64,128,256"
    assert [padded_length(n, [16, 32, 64, 128, 256], 256) for n in (3, 16, 17, 200, 256)] == [16, 16, 32, 256, 256]
    assert padded_length(300, [512], 512) == 512 and padded_length(10, [512], 512) == 512  # the CPU's one width


def test_a_long_context_models_buckets_double_up_to_its_length():
    """A 600-token text of an 8192-token model pads its batch to 1024, not 8192: on a GPU a graph that cuts no
    padding; on a CPU one width for every text that fits in 512, whose padding the graph cuts, then doublings."""
    from nexus_sli.exporter.targets.onnxruntime_gpu import PAD_BUCKETS

    gpu = tc.EncoderServing(device="KIND_GPU", pad_widths=PAD_BUCKETS)
    widths = gpu.widths(8192)
    assert widths == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
    assert padded_length(600, widths, 8192) == 1024 and padded_length(5000, widths, 8192) == 8192
    assert gpu.widths(600) == [16, 32, 64, 128, 256, 512, 600] and gpu.widths(256) == [16, 32, 64, 128, 256]
    assert tc.EncoderServing().widths(8192) == [512, 1024, 2048, 4096, 8192]
    assert tc.EncoderServing().widths(512) == [512] and tc.EncoderServing().widths(128) == [128]
    assert padded_length(600, tc.EncoderServing().widths(8192), 8192) == 1024


def test_the_fp16_graph_keeps_normalisation_and_softmax_in_fp32(minilm):
    out, _, _ = minilm
    graph = out / "minilm_encoder" / "1" / "model.onnx"
    types = fp16.op_input_types(graph, ("LayerNormalization", "Softmax", "MatMul"))
    assert types["LayerNormalization"] == types["Softmax"] == {TensorProto.FLOAT}
    assert types["MatMul"] == {TensorProto.FLOAT16}
    assert fp16.fp16_share(graph) > 0.99
    assert fp16.lowest_constant(graph) >= -fp16.FP16_MAX  # the mask's additive value is finite in fp16


def test_the_cuda_accelerator_is_the_other_gpu_choice(tiny_checkpoint, tmp_path):
    result = run_export(ExportOptions(model=str(tiny_checkpoint("bert")), name="tiny", out=tmp_path,
                                      device="gpu", backend="onnxruntime-cuda", precision="auto"))
    config = tc.read(tmp_path / "tiny_encoder" / "config.pbtxt")
    assert result.report.validation.passed and result.report.validation.precision == "fp16"
    assert [a.name for a in config.optimization.execution_accelerators.gpu_execution_accelerator] == ["cuda"]
    # nexus-sli validate opens it as the CUDA target, with the CUDA accelerator's providers
    assert revalidate(tmp_path, "tiny")["backend"] == "onnxruntime-cuda"


@pytest.mark.parametrize("model_type", sorted(TINY_CONFIGS))
def test_every_family_validates_in_fp16(model_type, tiny_checkpoint, tmp_path):
    report, _ = _gpu_export(str(tiny_checkpoint(model_type)), tmp_path, "tiny", task="embedding")
    assert report.validation.passed and report.validation.cosine_min >= 0.999, report.validation.failures


@pytest.mark.parametrize("model_type", REMOTE_TINY)
def test_families_of_our_own_validate_in_fp16_labels_too(model_type, tiny_tokenizer, tmp_path):
    checkpoint = build_tiny_remote(model_type, tmp_path / "ckpt", tiny_tokenizer, task="classification")
    report, _ = _gpu_export(str(checkpoint), tmp_path / "repo", "tiny")
    assert report.task == "classification" and report.validation.passed, report.validation.failures
    assert report.validation.agreement >= 0.99 and report.validation.thresholds["agreement"] == 0.99


def test_auto_never_leaves_the_device_asked_for():
    assert {c.target.device
            for c in configurations_for("auto", "auto", {"avx512_bf16", "amx_bf16"}, device="cpu")} == {"cpu"}
    assert [(c.target.name, c.precision) for c in configurations_for("auto", "auto", set(), device="gpu")] == [
        ("onnxruntime-tensorrt", "fp16")]


def test_a_misspelt_accelerator_key_is_refused():
    lay = tc.layout("embedding", ["input_ids"], 8, 0)
    serving = tc.EncoderServing(platform="onnxruntime_onnx", device="KIND_GPU",
                                accelerators=(tc.Accelerator("tensorrt", {"precison_mode": "FP16"}),))
    with pytest.raises(ValueError, match="precison_mode"):
        tc.encoder_config("e", lay, ["input_ids"], serving)


def test_max_batch_size_asked_for_sets_every_step_and_the_tensorrt_profile(tiny_checkpoint, tmp_path):
    report, config = _gpu_export(str(tiny_checkpoint("bert")), tmp_path, "tiny", task="embedding", max_batch_size=96)
    (accelerator,) = config.optimization.execution_accelerators.gpu_execution_accelerator
    max_shapes = dict(accelerator.parameters)["trt_profile_max_shapes"]
    assert max_shapes == ",".join(f"{n}:96x{report.max_length}" for n in report.inputs)
    assert {tc.read(folder / "config.pbtxt").max_batch_size for folder in tmp_path.iterdir()
            if (folder / "config.pbtxt").exists()} == {96}


#: The tiny families whose layers take rotary position tables (cos and sin of position x frequency)
ROTARY = ("eurobert", "modernbert", "nomic_bert")


def _with_output(path, out, node_name: str) -> str:
    """``path`` with the first output of node ``node_name`` a graph output too, saved at ``out``: its name."""
    model = onnx.load(str(path))
    name = next(node.output[0] for node in model.graph.node if node.name == node_name)
    model.graph.output.append(onnx.helper.make_value_info(name, onnx.TypeProto()))
    onnx.save(model, str(out))
    return name


@pytest.mark.parametrize("model_type", ROTARY)
def test_the_fp16_graph_computes_rotary_tables_in_fp32(model_type, tmp_path):
    """The rotary tables as transformers computes them under fp16 weights: angles in fp32, so the cos and sin
    of a position past 2048 (where fp16 no longer holds every integer, let alone its product with a frequency)
    are the fp32 graph's exactly, before the one cast to fp16 the layers read."""
    from transformers import CONFIG_MAPPING

    from nexus_sli.tasks import get_task

    architecture, overrides = TINY_CONFIGS[model_type]
    torch.manual_seed(0)
    task = get_task("embedding")
    model = task.build(CONFIG_MAPPING[model_type](**{**COMMON, **overrides, "max_position_embeddings": 4096}))
    graph = plain_graph(model.eval(), task, tmp_path, (2100,), 2100, seed=1)
    half = fp16.convert_fp16(graph["path"], tmp_path / "half.onnx")
    rotary = set(fp16.rotary_nodes(graph["path"]))
    plain = onnx.load(str(graph["path"])).graph
    kinds = {node.op_type for node in plain.node if node.name in rotary}
    assert {"Cos", "Sin", "Mul"} <= kinds and not kinds & set(fp16.SHAPE_OPS)
    weights = {initializer.name for initializer in plain.initializer}
    assert not {name for node in plain.node if node.name in rotary for name in node.input} & weights
    assert fp16.op_input_types(half, ("Cos", "Sin")) == {"Cos": {TensorProto.FLOAT}, "Sin": {TensorProto.FLOAT}}
    for kind in ("Cos", "Sin"):
        node = next(node.name for node in plain.node if node.op_type == kind)
        tables = [quiet_session(with_table).run([name], graph["feeds"])[0]
                  for source, with_table in ((graph["path"], tmp_path / "a.onnx"), (half, tmp_path / "b.onnx"))
                  for name in (_with_output(source, with_table, node),)]
        assert tables[0].dtype == tables[1].dtype == np.float32 and np.array_equal(*tables), kind


def _engine_cache(repository, name: str) -> str:
    (accelerator,) = tc.read(repository / f"{name}_encoder" / "config.pbtxt").optimization.execution_accelerators \
        .gpu_execution_accelerator
    return dict(accelerator.parameters)["trt_engine_cache_path"]


def test_each_graph_has_its_own_tensorrt_engine_cache(tiny_tokenizer, tmp_path):
    """ONNX Runtime names a cached engine after the graph's structure and names, not its weights: two models of one
    architecture, or a re-export of new weights, must not share a folder, or one would serve the other's engine.
    The same graph exported again keeps its folder, so a restart reuses the engines it built."""
    from nexus_sli.exporter.targets.onnxruntime_gpu import ENGINE_CACHE

    caches = {}
    for name, seed in (("first", 0), ("again", 0), ("other", 1)):
        checkpoint = build_tiny("bert", tmp_path / f"ckpt-{name}", tiny_tokenizer, seed=seed)
        _gpu_export(str(checkpoint), tmp_path / "repo", name, task="embedding")
        caches[name] = _engine_cache(tmp_path / "repo", name)
    assert all(cache.startswith(ENGINE_CACHE + "/") for cache in caches.values()), caches
    assert caches["first"] == caches["again"] != caches["other"]


def _tiny_graph(path, nodes, initializers=(), inputs=("x",)) -> None:
    from onnx import helper, numpy_helper

    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(name, TensorProto.FLOAT, [2, 4]) for name in inputs],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
                              [numpy_helper.from_array(array, name) for name, array in initializers])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def test_a_cos_or_sin_of_the_hidden_states_is_no_rotary_table(tmp_path):
    """An activation's Sin reads the model's weights upstream: keeping it in fp32 would keep the layers before it."""
    from onnx import helper

    weight = np.eye(4, dtype=np.float32)
    _tiny_graph(tmp_path / "act.onnx", [helper.make_node("MatMul", ["x", "w"], ["h"], name="/layer/MatMul"),
                                        helper.make_node("Sin", ["h"], ["s"], name="/act/Sin"),
                                        helper.make_node("Add", ["h", "s"], ["y"], name="/act/Add")], [("w", weight)])
    assert fp16.rotary_nodes(tmp_path / "act.onnx") == []


def test_casts_read_inside_a_subgraph_are_kept(tmp_path):
    """The fp16 graph's clean-up removes only the casts it bypassed, and sees what an If's branches read."""
    from onnx import helper

    branch = helper.make_graph([helper.make_node("Identity", ["x_half"], ["out"], name="/then/Identity")], "then", [],
                               [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 4])])
    _tiny_graph(tmp_path / "if.onnx", [
        helper.make_node("Cast", ["x"], ["x_half"], name="/Cast", to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["x"], ["total"], name="/ReduceSum", keepdims=0),
        helper.make_node("Greater", ["total", "zero"], ["positive"], name="/Greater"),
        helper.make_node("If", ["positive"], ["y"], name="/If", then_branch=branch, else_branch=branch)],
        [("zero", np.zeros((), np.float32))])
    half = fp16.convert_fp16(tmp_path / "if.onnx", tmp_path / "if.fp16.onnx")
    feeds = {"x": np.ones((2, 4), np.float32)}
    np.testing.assert_array_equal(quiet_session(half).run(None, feeds)[0], feeds["x"])
