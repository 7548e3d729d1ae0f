"""ONNX Runtime's static int8 (NNCF, :mod:`export.static_int8`): what the graph holds, and when it is offered."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from helpers.reports import measured_row, version_1
from nexus_sli.exporter.export.pipeline import ExportOptions, run_export
from nexus_sli.exporter.export.static_int8 import SMOOTH_QUANT_ALPHA, STATIC_INT8_GRAPH as STATIC, unsigned_activations
from nexus_sli.exporter.export.validate import SCORE_BAR


def _qdq_matmul(zero_point: int = -7) -> onnx.ModelProto:
    """x -> QuantizeLinear(int8) -> DequantizeLinear -> MatMul with an int8 weight, as NNCF writes it."""
    rng = np.random.default_rng(0)
    weight = rng.integers(-127, 128, (8, 4)).astype(np.int8)
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero"], ["x_q"], name="q"),
        helper.make_node("DequantizeLinear", ["x_q", "x_scale", "x_zero"], ["x_dq"], name="dq"),
        helper.make_node("DequantizeLinear", ["w", "w_scale", "w_zero"], ["w_dq"], name="w_dq", axis=1),
        helper.make_node("MatMul", ["x_dq", "w_dq"], ["y"], name="matmul"),
    ]
    initializers = [
        numpy_helper.from_array(np.array(0.05, np.float32), "x_scale"),
        numpy_helper.from_array(np.array(zero_point, np.int8), "x_zero"),
        numpy_helper.from_array(weight, "w"),
        numpy_helper.from_array(np.full(4, 0.01, np.float32), "w_scale"),
        numpy_helper.from_array(np.zeros(4, np.int8), "w_zero"),
    ]
    graph = helper.make_graph(nodes, "qdq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], initializers,
                              value_info=[helper.make_tensor_value_info("x_q", TensorProto.INT8, [2, 8])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])


def test_unsigned_activations_dequantize_every_value_as_before():
    # values across the whole int8 range, past both ends (saturating), and at the rounding midpoints
    x = np.concatenate([np.linspace(-7.5, 7.5, 8), np.array([-40, 40, 0.025, -0.025, 6.35, -6.05, 0, 1])])
    x = x.astype(np.float32).reshape(2, 8)
    signed = _qdq_matmul()
    before = ReferenceEvaluator(signed).run(None, {"x": x})
    unsigned = unsigned_activations(_qdq_matmul())
    after = ReferenceEvaluator(unsigned).run(None, {"x": x})
    np.testing.assert_array_equal(after[0], before[0])  # the same dequantized values, one evaluator: the same sums
    zero_points = {i.name: numpy_helper.to_array(i) for i in unsigned.graph.initializer}
    assert zero_points["x_zero"].dtype == np.uint8 and int(zero_points["x_zero"]) == -7 + 128
    assert zero_points["w_zero"].dtype == np.int8 and zero_points["w"].dtype == np.int8  # weights stay signed
    assert unsigned.graph.value_info[0].type.tensor_type.elem_type == TensorProto.UINT8
    onnx.checker.check_model(unsigned, full_check=True)


def test_unsigned_activations_refuse_a_quantized_value_read_by_anything_else():
    model = _qdq_matmul()
    model.graph.node.append(helper.make_node("Identity", ["x_q"], ["x_q_copy"], name="reader"))
    with pytest.raises(ValueError, match="read by anything but DequantizeLinear"):
        unsigned_activations(model)


def _int8_export(tiny_checkpoint, out, precision):
    return run_export(ExportOptions(model=str(tiny_checkpoint("bert")), task="embedding", name="q", out=out,
                                    backend="onnxruntime", precision=precision)).report


@pytest.fixture(scope="module")
def auto_int8(tiny_checkpoint, tmp_path_factory):
    from nexus_sli.exporter.targets import registry

    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(registry.AUTO_CONFIGURATIONS, "cpu", (("onnxruntime", "int8"),))
        out = tmp_path_factory.mktemp("static")
        return _int8_export(tiny_checkpoint, out, "auto"), out


def test_auto_offers_onnx_runtime_a_static_int8_that_keeps_its_bar(auto_int8):
    report, _ = auto_int8
    candidates = {c.graph: c for c in report.measured}
    # for an embedding, the static graph alone: no dynamic variant kept the auto bar in a kept run (docs/export.md,
    # "What auto skips")
    assert list(candidates) == [STATIC]
    static = candidates[STATIC]
    assert static.passed and static.cosine_min >= 0.98 and static.cosine_mean >= 0.995
    # auto's cosines and score bar (a dense model has no sparse terms to keep)
    assert report.validation.thresholds == {"cosine_mean": 0.995, "cosine_min": 0.98,
                                            "score_error": SCORE_BAR["score_error"],
                                            "rank_agreement": SCORE_BAR["rank_agreement"]}


def test_explicit_int8_keeps_to_the_dynamic_variants(tiny_checkpoint, tmp_path):
    """Held to int8's own bar, the dynamic variants (faster, and they keep it) are all an int8 export makes."""
    report = _int8_export(tiny_checkpoint, tmp_path / "repo", "int8")
    assert STATIC not in [c.graph for c in report.candidates]
    assert report.validation.thresholds == {"cosine_mean": 0.99, "cosine_min": 0.95}


def test_the_static_graph_runs_integer_matmuls_on_u8_activations(tiny_checkpoint, tmp_path):
    """Every activation is quantized to u8 (ONNX Runtime's x86 kernels' type), the MatMuls named stay fp32,
    the embedding tables are not quantized (ONNX Runtime would dequantize them on every run), and ONNX
    Runtime's optimizer turns every quantized MatMul into an integer one."""
    import onnxruntime as ort
    from transformers import AutoModel

    from nexus_sli.exporter.export.quantize import attention_output_matmuls, ffn_output_matmuls
    from nexus_sli.exporter.export.static_int8 import quantize_qdq
    from nexus_sli.tasks import get_task
    from helpers.tiny_models import padded_feeds, plain_graph

    model = AutoModel.from_pretrained(str(tiny_checkpoint("bert"))).eval()
    plain = plain_graph(model, get_task("embedding"), tmp_path, (5, 9), 9, seed=0)
    keep = attention_output_matmuls(plain["path"], 32) + ffn_output_matmuls(plain["path"], 64, 32)
    assert len(keep) == 4  # two layers, one of each role
    calibration = [{n: f[n] for n in plain["names"]} for f in
                   (padded_feeds([4, 7, 12, 16], 16, seed=s) for s in range(3))]
    path = quantize_qdq(plain["path"], tmp_path / "static.onnx", calibration, keep, SMOOTH_QUANT_ALPHA)

    graph = onnx.load(str(path)).graph
    initializers = {i.name: i for i in graph.initializer}
    activations = [n for n in graph.node if n.op_type == "QuantizeLinear" and n.input[0] not in initializers]
    assert activations and all(initializers[n.input[2]].data_type == TensorProto.UINT8 for n in activations)
    matmuls = {n.name: n for n in graph.node if n.op_type == "MatMul"}
    assert all(matmuls[name].input[1] in initializers for name in keep)  # fp32 weights, read directly
    dequantized = {n.output[0] for n in graph.node if n.op_type == "DequantizeLinear"}
    assert not any(n.op_type == "Gather" and set(n.input) & dequantized for n in graph.node)

    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    optimized = onnx.load(str(tmp_path / "optimized.onnx")).graph.node
    assert [n.op_type for n in optimized].count("MatMulIntegerToFloat") >= len(activations)
    # what is still dequantized feeds no arithmetic (a value's Shape at most): no MatMul runs in fp32 on it
    left = {n.output[0] for n in optimized if n.op_type == "DequantizeLinear"}
    assert all(n.op_type == "Shape" for n in optimized if set(n.input) & left)


def test_unsigned_activations_refuse_a_zero_point_shared_beyond_its_pair():
    model = _qdq_matmul()
    model.graph.node.append(helper.make_node("DequantizeLinear", ["w", "w_scale", "x_zero"], ["w_dq2"], name="other"))
    with pytest.raises(ValueError, match="shared beyond the pair"):
        unsigned_activations(model)


@pytest.mark.parametrize("kept", [STATIC, "plain"])
def test_the_bench_exports_a_static_default_through_auto_and_checks_what_it_kept(tiny_checkpoint, tmp_path,
                                                                                 monkeypatch, kept):
    """The static int8 only an export held to the auto bar makes: the bench exports that label with ONNX
    Runtime and precision auto, and leaves it out, saying why, when that export's timing kept another graph."""
    import json

    from nexus_sli.bench import exports
    from nexus_sli.bench.options import BenchOptions
    from nexus_sli.bench.run_size import FULL
    from nexus_sli.exporter.export import export_report, pipeline
    from nexus_sli.exporter.export.export_report import ExportReport
    from nexus_sli.exporter.export.pipeline import ExportResult

    default = {"label": "int8-static", "backend": "onnxruntime", "precision": "int8", "graph": STATIC}
    monkeypatch.setattr(exports, "default_configuration", lambda options, run_size=None, export=True: default)
    exported = {}

    def fake_export(options):  # what the bench asks for, and a record that says what was kept
        exported[options.name] = (options.backend, options.precision)
        row = measured_row("int8" if kept == STATIC else "fp32", kept, True, chosen=True)
        report = ExportReport.from_dict({**version_1(), "model": "x", "measured": [row]})
        (options.out / f"{options.name}_encoder").mkdir(parents=True)
        export_report.write(report, options.out / f"{options.name}_encoder")
        return ExportResult(options.name, [], report)

    monkeypatch.setattr(pipeline, "run_export", fake_export)
    options = BenchOptions(model=str(tiny_checkpoint("bert")), repository=tmp_path / "repo")
    names = exports.ensure_exported(options, FULL)
    static_name = next(name for name in exported if name.endswith("_int8_static"))
    assert exported[static_name] == ("onnxruntime", "auto")
    # every other configuration is exported by name, as before
    assert sorted(v for n, v in exported.items() if n != static_name) == sorted(
        (backend, precision) for backend, precision, _ in exports.variants().values())
    skipped = json.loads((tmp_path / "repo" / exports.SKIPPED_FILE).read_text())
    if kept == STATIC:
        assert names["int8-static"] == static_name and not skipped
    else:
        assert "int8-static" not in names and "kept fp32, not int8-static" in skipped["int8-static"]
