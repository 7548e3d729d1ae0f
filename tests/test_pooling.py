"""Pooling inside the encoder graph (exporter/export/pooling.py) against the python pooling.

A tiny seeded BERT is exported once; every pooling mode, with and without
normalisation, is appended to it and run by ONNX Runtime on padded batches
(rows of different lengths, padding past the longest row), with and without
the padding trim in front, and compared with the python pooling
(``encoding.pool`` / ``l2_normalize``) of the same graph's token states and of
PyTorch's.  Then the ensemble a pooled export writes (tokenizer -> encoder, no
post-processing model) and what validation makes of a pooled graph.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from nexus_sli.exporter.errors import ExportError
from nexus_sli.exporter.export import export_report
from nexus_sli.exporter.export.padding_trim import add_padding_trim
from nexus_sli.exporter.export.pipeline import ExportOptions, run_export
from nexus_sli.exporter.export.pooling import PREFIX, Pooling, add_pooling, pooling_nodes
from nexus_sli.exporter.export.report import ValueMismatch
from nexus_sli.exporter.export.validate import Embedder, build_reference, compare, parity_cases, validation_texts
from nexus_sli.exporter.targets import ExportedGraph
from nexus_sli.exporter.targets.onnxruntime_gpu import OnnxRuntimeTensorRT
from nexus_sli.exporter.targets.tensorrt_plan import wants_fp32
from nexus_sli.exporter.triton import config as tc
from nexus_sli.exporter.triton.python_models.encoding import POOLING_MODES, l2_normalize, pool
from nexus_sli.tasks import get_task
from helpers.tiny_models import COMMON, VOCAB, plain_graph, quiet_session

HIDDEN = COMMON["hidden_size"]
TASK = get_task("embedding")
#: real lengths per row, padded to WIDTH (past the longest row, as the served tokenizer pads)
LENGTHS, WIDTH = (7, 3, 12, 1, 12), 20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_checkpoint):
    """The tiny BERT's model, its plain graph, and a padded batch."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(tiny_checkpoint("bert")), attn_implementation="eager").eval()
    return plain_graph(model, TASK, tmp_path_factory.mktemp("pooling"), LENGTHS, WIDTH, seed=7)


def _python_pooling(states: np.ndarray, mask: np.ndarray, mode: str, normalize: bool) -> np.ndarray:
    vectors = pool(states, mask, mode)
    return l2_normalize(vectors) if normalize else vectors


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalized"])
@pytest.mark.parametrize("mode", POOLING_MODES)
def test_graph_pooling_matches_the_python_pooling_on_padded_batches(tiny, mode, normalize):
    folder, feeds = tiny["folder"], tiny["feeds"]
    pooled = add_pooling(tiny["path"], folder / f"{mode}-{normalize}.onnx", "last_hidden_state", "EMBEDDING",
                         mode, normalize, HIDDEN)
    trimmed = add_padding_trim(pooled, folder / f"{mode}-{normalize}.trim.onnx", [])
    (states,) = quiet_session(tiny["path"]).run(None, feeds)
    expected = _python_pooling(states, feeds["attention_mask"], mode, normalize)
    with torch.no_grad():
        torch_states = tiny["model"](**{k: torch.from_numpy(v) for k, v in feeds.items()}).last_hidden_state.numpy()
    from_pytorch = _python_pooling(torch_states, feeds["attention_mask"], mode, normalize)
    for graph in (pooled, trimmed):
        session = quiet_session(graph)
        assert [o.name for o in session.get_outputs()] == ["EMBEDDING"]
        (got,) = session.run(None, feeds)
        assert got.shape == (len(LENGTHS), HIDDEN) and got.dtype == np.float32
        np.testing.assert_allclose(got, expected, atol=2e-6, rtol=1e-5)
        np.testing.assert_allclose(got, from_pytorch, atol=1e-4)
    if normalize:
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    # a row alone, without the batch's padding, gets the same vector: padding changes nothing
    (alone,) = quiet_session(trimmed).run(None, {k: v[1:2, :LENGTHS[1]] for k, v in feeds.items()})
    np.testing.assert_allclose(alone[0], got[1], atol=2e-6)


def test_modes_differ_so_the_comparison_above_can_fail(tiny):
    """The three modes give different vectors on this model: a wrong mode in the graph would be caught."""
    (states,) = quiet_session(tiny["path"]).run(None, tiny["feeds"])
    mask = tiny["feeds"]["attention_mask"]
    vectors = {mode: _python_pooling(states, mask, mode, True) for mode in POOLING_MODES}
    for a in POOLING_MODES:
        for b in POOLING_MODES:
            if a != b:
                assert np.abs(vectors[a] - vectors[b]).max() > 1e-2


def test_unknown_mode_and_missing_tensors_are_export_errors(tiny, tmp_path):
    with pytest.raises(ExportError, match="known modes: mean, cls, max"):
        add_pooling(tiny["path"], tmp_path / "x.onnx", "last_hidden_state", "EMBEDDING", "weightedmean", True, HIDDEN)
    with pytest.raises(ExportError, match="needs the output 'logits'"):
        add_pooling(tiny["path"], tmp_path / "x.onnx", "logits", "EMBEDDING", "mean", True, HIDDEN)


def test_fp16_graph_keeps_the_pooling_in_fp32(tiny):
    """The GPU target's candidate: the fp16 encoder, then the pooling on its fp32 token states, every
    pooling value in fp32 (no round trip through fp16), within the fp16 bar of the fp32 graph."""
    folder = tiny["folder"] / "gpu"
    folder.mkdir()
    pooling = Pooling("mean", True, "last_hidden_state", "EMBEDDING", HIDDEN)
    graph = ExportedGraph(tiny["path"], folder, None, None, TASK, tiny["names"], None, 0, 128, pooling)
    (candidate,) = OnnxRuntimeTensorRT().candidates(graph, "fp16")
    model = onnx.shape_inference.infer_shapes(onnx.load(str(candidate.path)))
    graph_proto = model.graph
    types = {v.name: v.type.tensor_type.elem_type
             for v in (*graph_proto.value_info, *graph_proto.input, *graph_proto.output)}
    types.update({t.name: t.data_type for t in graph_proto.initializer})
    nodes = [n for n in graph_proto.node if n.name.startswith(PREFIX)]
    assert nodes and {n.name for n in nodes} == set(pooling_nodes(candidate.path))
    values = {name for n in nodes for name in (*n.input, *n.output)}
    floating = {types[v] for v in values if types.get(v) in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)}
    assert floating == {onnx.TensorProto.FLOAT}
    assert any(types.get(i) == onnx.TensorProto.FLOAT16 for n in graph_proto.node for i in n.input), "nothing is fp16"
    pooled = pooling.append(tiny["path"], folder / "fp32.onnx")
    (fp32,) = quiet_session(pooled).run(None, tiny["feeds"])
    (fp16,) = quiet_session(candidate.path).run(None, tiny["feeds"])
    assert (np.sum(fp32 * fp16, axis=1) > 0.999).all()


def test_tensorrt_pins_the_pooling_layers_to_fp32():
    assert wants_fp32("REDUCE", "SUM", f"{PREFIX}sum") and wants_fp32("ELEMENTWISE", "DIV", f"node_of_{PREFIX}pooled")
    assert not wants_fp32("REDUCE", "SUM", "/encoder/layer.0/ReduceSum")


def test_validation_compares_the_pooled_output_as_it_comes(tiny):
    """A pooled graph passes fp32 parity against PyTorch pooled by the same embedder; the same graph
    judged as another mode's fails on values, and fails on names when the pooled output is not expected."""
    folder, model = tiny["folder"], tiny["model"]
    pooled = add_pooling(tiny["path"], folder / "validate.onnx", "last_hidden_state", "EMBEDDING", "mean", True,
                         HIDDEN)
    trimmed = add_padding_trim(pooled, folder / "validate.trim.onnx", [])
    reference = build_reference(model, TASK, tiny["names"], parity_cases(tiny["names"], VOCAB, 0, 128),
                                [tiny["feeds"]])
    session = quiet_session(trimmed)
    report = compare(session, reference, "fp32", Embedder("mean", True), TASK, pooled="EMBEDDING")
    assert report.passed and report.max_abs_diff < 1e-5 and report.cosine_min > 0.99999
    wrong = compare(session, reference, "fp32", Embedder("cls", True), TASK, pooled="EMBEDDING")
    assert not wrong.passed and any(isinstance(f, ValueMismatch) for f in wrong.failures)
    unexpected = compare(session, reference, "fp32", Embedder("mean", True), TASK)
    assert not unexpected.passed and "graph outputs ['EMBEDDING']" in unexpected.summary()


def test_pooled_layout_is_tokenizer_then_encoder():
    lay = tc.layout("embedding", ["input_ids", "attention_mask"], 384, 0, pooled=True)
    assert lay.encoder_answers and lay.post_inputs == ()
    assert [(t.name, t.dims) for t in lay.outputs] == [("EMBEDDING", (384,))]
    # the encoder also answers the token states it keeps; the embedding ensemble does not map them
    assert [(t.name, t.dims) for t in lay.encoder_outputs] == [("EMBEDDING", (384,)), ("TOKEN_EMBEDDINGS", (-1, 384))]
    ensemble = tc.ensemble_config("m", "embedding", lay, ["input_ids", "attention_mask"], ("t", "e"), {})
    steps = ensemble.ensemble_scheduling.step
    assert [s.model_name for s in steps] == ["t", "e"]
    assert dict(steps[1].output_map) == {"EMBEDDING": "EMBEDDING"}
    serving = tc.EncoderServing(platform="onnxruntime_onnx")
    encoder = tc.encoder_config("e", lay, ["input_ids", "attention_mask"], serving)
    assert [(o.name, list(o.dims)) for o in encoder.output] == [("EMBEDDING", [384]), ("TOKEN_EMBEDDINGS", [-1, 384])]
    with pytest.raises(ValueError, match="takes 2 steps"):
        tc.ensemble_config("m", "embedding", lay, ["input_ids", "attention_mask"], ("t", "e", "p"), {})


def test_export_pools_in_the_graph_and_retires_an_earlier_post_processing_step(tiny_checkpoint, tmp_path):
    """The default export: two steps, the encoder's outputs EMBEDDING and the token states, served by a
    second ensemble; exporting over a repository that has the earlier three-step ensemble of the same
    name removes its post-processing model, and exporting that again removes the token ensemble."""
    out = tmp_path / "repo"
    run_export(ExportOptions(model=str(tiny_checkpoint("bert")), name="tiny", out=out, pool_in_graph=False))
    assert (out / "tiny_postprocess").is_dir()
    texts = validation_texts()[:40]
    before = _in_process(out, texts)  # the bench's in-process run of the served graph, python pooling
    result = run_export(ExportOptions(model=str(tiny_checkpoint("bert")), name="tiny", out=out))
    models = ["tiny", "tiny_encoder", "tiny_tokenizer"]
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == [*models, "tiny_tokens"]
    report = export_report.read(out / "tiny_encoder")
    assert report == result.report and report.pooled_in_graph is True
    assert report.outputs == ["EMBEDDING", "TOKEN_EMBEDDINGS"]
    assert report.validation.passed and report.validation.max_abs_diff <= 1e-4
    graph = onnx.load(str(out / "tiny_encoder" / "1" / "model.onnx")).graph
    assert [o.name for o in graph.output] == ["EMBEDDING", "TOKEN_EMBEDDINGS"]
    assert pooling_nodes(out / "tiny_encoder" / "1" / "model.onnx")
    ensemble = tc.read(out / "tiny" / "config.pbtxt")
    assert [s.model_name for s in ensemble.ensemble_scheduling.step] == ["tiny_tokenizer", "tiny_encoder"]
    assert ensemble.parameters["pooling"].string_value == "mean"  # clients still read how it pools
    assert ensemble.parameters["token_model"].string_value == "tiny_tokens"
    np.testing.assert_allclose(_in_process(out, texts), before, atol=1e-5)  # the graph's own pooling
    run_export(ExportOptions(model=str(tiny_checkpoint("bert")), name="tiny", out=out, pool_in_graph=False))
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == sorted([*models, "tiny_postprocess"])


def _in_process(repo, texts):
    from nexus_sli.bench.runners import GraphEncoder, ServedFacts

    facts = ServedFacts.read(repo, "tiny")
    return GraphEncoder.for_model(repo, facts)(texts)
