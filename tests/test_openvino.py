"""The OpenVINO encoder target and the padding trim every exported graph carries."""

from __future__ import annotations

import numpy as np
import pytest

from nexus_sli.exporter.triton import config as triton_config
from nexus_sli.exporter.targets import configurations_for
from nexus_sli.exporter.targets.cpu import supports_bf16
from nexus_sli.exporter.errors import NexusError
from nexus_sli.exporter.export import export_report
from nexus_sli.exporter.export.pipeline import ExportOptions, run_export
from nexus_sli.exporter.export.static_int8 import calibration_texts
from nexus_sli.exporter.targets.openvino_cpu import OpenVINOSession
from nexus_sli.exporter.export.optimize import session
from nexus_sli.exporter.export.padding_trim import trimmed_length
from nexus_sli.exporter.serving.backends.batching import length_groups, real_lengths
from nexus_sli.exporter.serving.backends.openvino_properties import compile_properties
from nexus_sli.exporter.export.validate import SCORE_BAR, validation_texts
from nexus_sli.exporter.triton.python_models.encoding import pool
from helpers.tiny_models import padded_feeds


def _feeds(lengths, width):
    return padded_feeds(lengths, width, vocab=100)


@pytest.fixture(scope="module")
def exported(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("ov")
    model = str(tiny_checkpoint("bert"))
    # token states out (the earlier layout, pooling in python), so the trim shows in the output's shape
    run_export(ExportOptions(model=model, task="embedding", name="ort", out=out, pool_in_graph=False))
    run_export(ExportOptions(model=model, task="embedding", name="ov", out=out, backend="openvino", precision="bf16"))
    return out


def test_graph_cuts_trailing_padding_and_keeps_real_tokens_exact(exported):
    sess = session(exported / "ort_encoder" / "1" / "model.onnx")
    padded = _feeds([9, 4, 2], 64)
    (hidden,) = sess.run(None, padded)
    assert hidden.shape[1] == trimmed_length(padded["attention_mask"]) == 9
    (unpadded,) = sess.run(None, {k: v[:, :9] for k, v in padded.items()})
    np.testing.assert_allclose(hidden, unpadded, atol=1e-6)
    (empty,) = sess.run(None, {k: np.zeros_like(v) for k, v in padded.items()})  # all padding: one position
    assert empty.shape[1] == 1


def test_openvino_export_writes_the_openvino_backend_config(exported):
    config = triton_config.read(exported / "ov_encoder" / "config.pbtxt")
    assert config.backend == "openvino" and not config.platform
    assert config.default_model_filename == "model.onnx"
    report = export_report.read(exported / "ov_encoder")
    assert report.validation.backend == "openvino" and report.requested_precision == "bf16"
    assert report.validation.passed


@pytest.mark.skipif(not supports_bf16(), reason="the CPU has no avx512_bf16/amx_bf16: bf16 is not exported here")
def test_openvino_bf16_export_is_held_to_the_bf16_thresholds(exported):
    config = triton_config.read(exported / "ov_encoder" / "config.pbtxt")
    report = export_report.read(exported / "ov_encoder")
    assert config.parameters["HINT_BF16"].string_value == "YES" and report.validation.precision == "bf16"
    # and the score bar on its dense scores (a dense model has no sparse terms to keep)
    assert report.validation.thresholds == {"cosine_mean": 0.9999, "cosine_min": 0.999,
                                            "score_error": SCORE_BAR["score_error"],
                                            "rank_agreement": SCORE_BAR["rank_agreement"]}
    assert report.validation.cosine_min >= 0.999 and report.validation.score_error <= SCORE_BAR["score_error"]


@pytest.mark.skipif(supports_bf16(), reason="the CPU has avx512_bf16/amx_bf16: the fp32 fallback is not used here")
def test_openvino_bf16_falls_back_to_fp32_parity_without_cpu_bf16(exported):
    config = triton_config.read(exported / "ov_encoder" / "config.pbtxt")
    report = export_report.read(exported / "ov_encoder")
    assert config.parameters["HINT_BF16"].string_value == "NO" and report.validation.precision == "fp32"
    assert report.validation.thresholds == {"max_abs_diff": 1e-4} and report.validation.max_abs_diff <= 1e-4


def test_openvino_bf16_asked_of_an_avx2_cpu_exports_fp32_at_parity_on_any_machine(monkeypatch, tiny_checkpoint,
                                                                                   tmp_path):
    """The fallback an AVX2-only CPU takes, exported here whatever this CPU has (the test above runs only on such
    a CPU): the configuration follows the flags, and the compiled model is held to fp32 parity, which holds
    because the served properties force f32 where the CPU plugin would pick bf16 by itself."""
    monkeypatch.setattr("nexus_sli.exporter.targets.registry.cpu_flags", lambda: AVX2)
    out = tmp_path / "repo"
    run_export(ExportOptions(model=str(tiny_checkpoint("bert")), task="embedding", name="ov", out=out,
                             backend="openvino", precision="bf16"))
    config = triton_config.read(out / "ov_encoder" / "config.pbtxt")
    report = export_report.read(out / "ov_encoder")
    assert config.parameters["HINT_BF16"].string_value == "NO" and report.validation.precision == "fp32"
    assert report.validation.thresholds == {"max_abs_diff": 1e-4} and report.validation.max_abs_diff <= 1e-4


def test_openvino_session_matches_onnxruntime_at_fp32(exported):
    """The OpenVINO graph pools in the graph (the default); the ONNX Runtime one answers token states,
    pooled here as its post-processing step does (the tiny model has no sentence-transformers files: mean)."""
    feeds = _feeds([12, 3], 20)
    ov_pooled, ov_tokens = OpenVINOSession(exported / "ov_encoder" / "1" / "model.onnx").run(None, feeds)
    (ort_hidden,) = session(exported / "ort_encoder" / "1" / "model.onnx").run(None, feeds)
    assert ort_hidden.shape == (2, 12, ort_hidden.shape[2]) and ov_pooled.shape == (2, ort_hidden.shape[2])
    np.testing.assert_allclose(ov_pooled, pool(ort_hidden, feeds["attention_mask"][:, :12], "mean"), atol=1e-4)
    np.testing.assert_allclose(ov_tokens, ort_hidden, atol=1e-4)  # the token states kept beside the embedding


def test_openvino_int8_is_an_nncf_ir_held_to_the_static_thresholds(tiny_checkpoint, tmp_path):
    out = tmp_path / "repo"
    result = run_export(ExportOptions(model=str(tiny_checkpoint("bert")), task="embedding", name="q", out=out,
                                      backend="openvino", precision="int8"))
    version = out / "q_encoder" / "1"
    assert (version / "model.xml").is_file() and (version / "model.bin").is_file()
    assert not (version / "model.onnx").exists()
    assert triton_config.read(out / "q_encoder" / "config.pbtxt").default_model_filename == "model.xml"
    # static int8 is held to a higher bar than ONNX Runtime's dynamic int8 (0.99 / 0.95)
    assert result.report.validation.thresholds == {"cosine_mean": 0.995, "cosine_min": 0.98}
    assert result.report.validation.passed is True and result.report.allow_degraded is False
    assert result.report.validation.cosine_mean >= 0.995 and result.report.validation.cosine_min >= 0.98
    # SmoothQuant 0.75 with the attention outputs kept, alone and with the feed-forward outputs: each validated,
    # the fastest that passed kept.  Every MatMul int8, and the feed-forward outputs kept alone, are not made for
    # an embedding (they missed this bar in every kept run: docs/export.md, "What auto skips")
    assert [c.graph for c in result.report.candidates] == ["plain+sq0.75+attn-out-fp32",
                                                           "plain+sq0.75+attn-ffn-out-fp32"]


@pytest.mark.parametrize("task, first_only, made", [
    ("embedding", False, ["-sq-attn-out-fp32", "-sq-attn-ffn-out-fp32"]),
    # no kept run measured a classifier (held to its own int8 bar): every variant
    ("classification", False, ["", "-ffn-fp32", "-sq-attn-out-fp32", "-sq-attn-ffn-out-fp32"]),
    # --no-search keeps the first: each other would be an NNCF run for nothing
    ("embedding", True, ["-sq-attn-out-fp32"]),
    ("classification", True, [""])])
def test_openvino_int8_variants_made_by_task(task, first_only, made, tiny_checkpoint, tmp_path, monkeypatch):
    from dataclasses import replace

    from nexus_sli.exporter.export.pipeline import prepare
    from nexus_sli.exporter.export.source import resolve_model
    from nexus_sli.exporter.targets import openvino_cpu
    from nexus_sli.tasks import get_task

    options = ExportOptions(model=str(tiny_checkpoint("bert")), task="embedding", out=tmp_path / "repo", cache=False)
    graph = prepare(options, resolve_model(options.model), tmp_path).graph
    quantized = []
    monkeypatch.setattr(openvino_cpu, "quantize_ir", lambda source, target, *args: quantized.append(target.name))
    openvino_cpu.OpenVINOCPU().candidates(replace(graph, task=get_task(task), first_only=first_only), "int8")
    assert quantized == [f"plain.ov-int8{suffix}.xml" for suffix in made]


#: where each family's attention output projection lives in its exported graph's node names
ATTENTION_OUTPUT = {"bert": "/attention/output/dense/", "distilbert": "/attention/out_lin/",
                    "deberta-v2": "/attention/output/dense/", "albert": "/attention/dense/",
                    "modernbert": "/attn/Wo/", "nomic_bert": "/self_attn/o_proj/"}


@pytest.mark.parametrize("family", sorted(ATTENTION_OUTPUT))
def test_attention_output_projections_are_found_by_shape_and_wiring(family, tiny_checkpoint, tmp_path):
    """One per layer, and nothing else: not query, key or value (they read one input together, or are
    fused into one wider weight), not DeBERTa's relative-position projections (they share theirs)."""
    from transformers import AutoModel

    from nexus_sli.exporter.export.onnx_export import export_onnx, model_input_names
    from nexus_sli.exporter.export.quantize import attention_output_matmuls
    from nexus_sli.tasks import get_task
    from helpers.tiny_models import VOCAB

    model = AutoModel.from_pretrained(str(tiny_checkpoint(family)), attn_implementation="eager").eval()
    path = tmp_path / "plain.onnx"
    export_onnx(model, get_task("embedding"), model_input_names(model, model.config), VOCAB, path)
    config = model.config
    hidden = getattr(config, "dim", None) or config.hidden_size
    found = attention_output_matmuls(path, hidden)
    layers = getattr(config, "n_layers", None) or config.num_hidden_layers
    assert len(found) == layers and all(ATTENTION_OUTPUT[family] in name for name in found), found


def test_precision_and_backend_combinations_are_checked(tmp_path):
    with pytest.raises(NexusError, match="onnxruntime backend serves precision fp32, int8"):
        run_export(ExportOptions(precision="bf16", out=tmp_path))
    with pytest.raises(NexusError, match="unknown backend"):
        run_export(ExportOptions(backend="tensorflow", out=tmp_path))
    assert not any(tmp_path.iterdir())


def test_compile_properties_follow_the_triton_openvino_parameters():
    assert compile_properties({"HINT_BF16": "YES"})["INFERENCE_PRECISION_HINT"] == "bf16"
    assert compile_properties({})["INFERENCE_PRECISION_HINT"] == "f32"  # never bf16 unless validated
    assert compile_properties({"NUM_STREAMS": "2", "PERFORMANCE_HINT": "THROUGHPUT"})["NUM_STREAMS"] == "2"


@pytest.fixture(scope="module")
def openvino_shim(tmp_path_factory, request):
    """The ``openvino`` backend as Triton loads it (``prepare_backends``' files), importable here."""
    import importlib
    import sys

    from nexus_sli.exporter.serving.server import prepare_backends

    folder = prepare_backends(tmp_path_factory.mktemp("backends"))
    sys.path[:0] = [str(folder / "python"), str(folder / "openvino")]
    request.addfinalizer(lambda: [sys.path.remove(str(folder / p)) for p in ("python", "openvino")])
    spec = importlib.util.spec_from_file_location("openvino_shim_model", folder / "openvino" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("params, lengths", [({}, 32), ({"WARMUP_QUERY_TOKENS": "5"}, 5), ({"WARMUP_QUERY_TOKENS": "0"}, 0)])
def test_openvino_backend_warms_one_query_of_each_length_at_load(openvino_shim, exported, monkeypatch, params, lengths):
    """OpenVINO prepares kernels on the first run at each new input shape (docs/repository.md): the
    shim runs one real query of every length up to WARMUP_QUERY_TOKENS at load, with the model's own
    inputs, and serves the same numbers afterwards."""
    ran = []
    real_request = openvino_shim.ov.CompiledModel.create_infer_request

    def recording(compiled):
        request = real_request(compiled)

        class Recorder:
            def infer(self, feeds, **options):
                ran.append({name: array.shape for name, array in feeds.items()})
                return request.infer(feeds, **options)
        return Recorder()

    monkeypatch.setattr(openvino_shim.ov.CompiledModel, "create_infer_request", recording)
    model = openvino_shim.TritonPythonModel()
    model.load(exported / "ov_encoder" / "1" / "model.onnx", params)
    inputs = {port.get_any_name() for port in model.compiled.inputs}
    assert [feeds.keys() == inputs for feeds in ran] == [True] * lengths
    assert [next(iter(feeds.values())) for feeds in ran] == [(1, n) for n in range(1, lengths + 1)]
    # warmed or not, a query gives what a fresh session gives
    feeds = _feeds([7], 7)
    outputs = [output.name for output in triton_config.read(exported / "ov_encoder" / "config.pbtxt").output]
    got = model.infer({name: feeds[name] for name in inputs}, outputs)
    want = OpenVINOSession(exported / "ov_encoder" / "1" / "model.onnx", {}).run(
        outputs, {name: feeds[name] for name in inputs})
    assert len(want) == len(outputs)
    for name, value in zip(outputs, want):
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5)


def test_openvino_backend_finds_an_output_by_its_graph_name_among_the_names_openvino_merged(openvino_shim, tmp_path):
    """An ONNX output behind an Identity node also bears its producer's tensor name in OpenVINO, and
    ``get_any_name()`` answers the first in sorted order: the shim must still answer the config's name."""
    import onnx
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Cast", ["input_ids"], ["/encoder/cast_output_0"], to=TensorProto.FLOAT),
             helper.make_node("Relu", ["/encoder/cast_output_0"], ["/encoder/Relu_output_0"]),
             helper.make_node("Identity", ["/encoder/Relu_output_0"], ["logits"])]
    graph = helper.make_graph(nodes, "identity_output",
                              [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "sequence"])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "model.onnx")
    model = openvino_shim.TritonPythonModel()
    model.load(tmp_path / "model.onnx", {"WARMUP_QUERY_TOKENS": "0"})
    assert model.compiled.outputs[0].get_any_name() != "logits"  # the case this test is about
    ids = np.array([[3, 0, 7]], dtype=np.int64)
    np.testing.assert_array_equal(model.infer({"input_ids": ids}, ["logits"])["logits"], ids.astype(np.float32))


def test_openvino_backend_refuses_a_token_id_past_the_vocabulary(openvino_shim, exported, tiny_checkpoint,
                                                                 monkeypatch):
    """OpenVINO's Gather answers zeros for an index past its table (ONNX Runtime fails the request): the shim
    finds the vocabulary in the graph, past the position table that a range of the ids' length indexes."""
    import json
    import sys
    from types import SimpleNamespace

    vocab = json.loads((tiny_checkpoint("bert") / "config.json").read_text())["vocab_size"]
    model = openvino_shim.TritonPythonModel()
    model.load(exported / "ov_encoder" / "1" / "model.onnx", {"WARMUP_QUERY_TOKENS": "0"})
    assert model.vocab_size == vocab
    model.inputs = [port.get_any_name() for port in model.compiled.inputs]
    mask = np.ones((1, 3), np.int64)
    monkeypatch.setattr(sys.modules["encoder_backend"].pb_utils, "get_input_tensor_by_name", raising=False,
                        value=lambda ids, name: SimpleNamespace(as_numpy=lambda: ids if name == "input_ids" else mask))
    model._feeds(np.full((1, 3), vocab - 1))  # the last id is one
    with pytest.raises(ValueError, match=f"token id {vocab}, outside the vocabulary's {vocab} ids"):
        model._feeds(np.full((1, 3), vocab))


def test_calibration_texts_are_not_validation_texts():
    calibration, validation = calibration_texts(), set(validation_texts())
    assert len(calibration) >= 300 and not validation.intersection(calibration)


def test_batching_plan_groups_by_length_and_covers_every_row():
    lengths = np.array([5, 250, 6, 240, 7, 5, 8, 255])
    groups = length_groups(lengths)
    assert sorted(np.concatenate(groups).tolist()) == list(range(len(lengths)))
    assert len(groups) == 2 and {int(lengths[g].max()) for g in groups} == {8, 255}
    assert len(length_groups(np.full(40, 30))) == 1  # equal lengths: one run
    mask = np.array([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]])
    assert real_lengths(mask).tolist() == [2, 3, 1]


AVX2 = {"avx2", "fma"}
AMX = {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"}


def tried(backend: str, precision: str, flags: set[str]) -> list[tuple[str, str]]:
    return [(c.target.name, c.precision) for c in configurations_for(backend, precision, flags)]


def test_auto_measures_every_configuration_this_cpu_can_run():
    every_cpu = [("onnxruntime", "fp32"), ("onnxruntime", "int8"), ("openvino", "fp32"), ("openvino", "int8")]
    assert sorted(tried("auto", "auto", AVX2)) == sorted(every_cpu)
    assert sorted(tried("auto", "auto", AMX)) == sorted([*every_cpu, ("openvino", "bf16")])
    # Cooper Lake and Zen 4: bf16 without AMX runs too; whether it pays is measured
    assert ("openvino", "bf16") in tried("auto", "auto", {"avx512_bf16"})


@pytest.mark.parametrize("flags, openvino_bf16", [(AVX2, []), (AMX, [("openvino", "bf16")])], ids=["avx2", "amx"])
def test_one_named_half_of_the_configuration_limits_what_is_measured(flags, openvino_bf16):
    assert sorted(tried("openvino", "auto", flags)) == sorted([("openvino", "fp32"), ("openvino", "int8"), *openvino_bf16])
    assert tried("auto", "int8", flags) == [("onnxruntime", "int8"), ("openvino", "int8")]
    assert tried("onnxruntime", "auto", flags) == [("onnxruntime", "fp32"), ("onnxruntime", "int8")]
    assert tried("onnxruntime", "int8", flags) == [("onnxruntime", "int8")]


def test_bf16_asked_of_a_cpu_without_it_exports_fp32():
    assert tried("auto", "bf16", AVX2) == [("openvino", "fp32")]
    assert tried("openvino", "bf16", AVX2) == [("openvino", "fp32")]
    assert tried("openvino", "bf16", AMX) == [("openvino", "bf16")]


#: a cheap auto list for export tests: one configuration per CPU runtime
TWO_RUNTIMES = (("onnxruntime", "fp32"), ("openvino", "fp32"))


def test_cli_export_defaults_to_auto_and_records_what_it_measured(monkeypatch, tiny_checkpoint, tmp_path):
    from nexus_sli.cli.main import main
    from nexus_sli.exporter.targets import registry

    monkeypatch.setattr("nexus_sli.exporter.targets.registry.cpu_flags", lambda: AVX2)
    monkeypatch.setitem(registry.AUTO_CONFIGURATIONS, "cpu", TWO_RUNTIMES)
    out = tmp_path / "repo"
    assert main(["export", "--model", str(tiny_checkpoint("bert")), "--name", "tiny", "--out", str(out)]) == 0
    report = export_report.read(out / "tiny_encoder")
    assert report.requested_backend == report.requested_precision == "auto"
    assert [(a.backend, a.precision, a.passed) for a in report.attempts] == [
        ("onnxruntime", "fp32", True), ("openvino", "fp32", True)]
    rows = report.measured
    assert {(r.backend, r.precision) for r in rows} == set(TWO_RUNTIMES)
    assert all(r.passed and set(r.timings_ms) == {"batch of 32", "one short text"} for r in rows)
    chosen = [r for r in rows if r.chosen]
    assert len(chosen) == 1 and chosen[0].score == min(r.score for r in rows if r.score is not None)
    assert (report.validation.backend, report.validation.precision, report.graph) == (
        chosen[0].backend, chosen[0].precision, chosen[0].graph)
    assert report.validation.passed and len(report.workloads) == 2 and report.timing.optimize == "balanced"


@pytest.mark.parametrize("faster, platform", [("openvino", ""), ("onnxruntime", "onnxruntime_onnx")])
def test_auto_keeps_the_fastest_configuration_that_passes(monkeypatch, tiny_checkpoint, tmp_path, faster, platform):
    from nexus_sli.exporter.export import timing
    from nexus_sli.exporter.targets import openvino_cpu, registry

    monkeypatch.setitem(registry.AUTO_CONFIGURATIONS, "cpu", (("openvino", "int8"), *TWO_RUNTIMES))
    monkeypatch.setattr(openvino_cpu, "STATIC_INT8_THRESHOLDS", {"cosine_mean": 1.5, "cosine_min": 1.5})  # unreachable
    # the runtimes' speeds, fixed: which one is chosen must follow them
    speed = {True: 1.0, False: 10.0}
    monkeypatch.setattr(timing, "run_ms",
                        lambda runner, feeds: speed[isinstance(runner, OpenVINOSession) == (faster == "openvino")])
    out = tmp_path / "repo"
    result = run_export(ExportOptions(model=str(tiny_checkpoint("bert")), task="embedding", name="tiny", out=out,
                                      backend="auto", precision="auto"))
    assert (result.report.validation.backend, result.report.validation.precision) == (faster, "fp32")
    attempts = result.report.attempts
    assert [(a.backend, a.precision, a.passed) for a in attempts] == [
        ("openvino", "int8", False), ("onnxruntime", "fp32", True), ("openvino", "fp32", True)]
    assert "cosine_mean" in attempts[0].failures[0] and result.report.validation.passed
    failed = [r for r in result.report.measured if not r.passed]
    assert failed and all(r.timings_ms == {} and r.score is None for r in failed)  # failures are not timed
    config = triton_config.read(out / "tiny_encoder" / "config.pbtxt")
    assert (config.platform, config.backend) == (platform, "openvino" if faster == "openvino" else "")


@pytest.mark.parametrize("family", ["deberta", "mobilebert", "eurobert"])
def test_an_output_whose_tensor_openvino_folds_into_another_keeps_its_name(family, tiny_checkpoint, tmp_path):
    """These families' token states come out of a tensor OpenVINO folds into the last layer's: the compiled port
    then bears that layer's inner names too, which sort first, and validation read them as the graph's output
    names (the configuration failed, and auto served another)."""
    result = run_export(ExportOptions(model=str(tiny_checkpoint(family)), task="embedding", out=tmp_path / "repo",
                                      backend="openvino", precision="fp32", search=False, cache=False))
    assert result.report.validation.passed and result.report.validation.backend == "openvino"
