"""Sparse (SPLADE) embeddings, checked against sentence-transformers' SparseEncoder on seeded models.

The SPLADE pooling as ONNX ops (exporter/export/pooling.py) against the numpy
pooling validation applies, and that against sentence-transformers' own
SpladePooling module, for every strategy and activation; then a tiny seeded
BERT masked-LM saved as a SparseEncoder folder (``--task auto`` reads it as
sparse) and a tiny DistilBERT masked-LM checkpoint exported with
``--task sparse-embedding``, both in fp32, served by one real Triton server and
called with raw tritonclient: every text's ``SPARSE_EMBEDDING`` has cosine >=
0.9999 to ``SparseEncoder.encode`` and the same non-zero terms.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnxruntime as ort
import pytest
import torch
import transformers
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from sentence_transformers import SparseEncoder
from sentence_transformers.base.modules import Transformer
from sentence_transformers.sparse_encoder.modules import SpladePooling as STSpladePooling
from transformers import BertConfig

from nexus_sli.exporter.errors import CheckpointError, NexusError, UnsupportedModelError
from nexus_sli.exporter.export.padding_trim import add_padding_trim
from nexus_sli.exporter.export.pipeline import ExportOptions, run_export
from nexus_sli.exporter.export.pooling import add_splade_pooling, pooling_nodes
from nexus_sli.exporter.export.report import ValueMismatch
from nexus_sli.exporter.export.validate import SparseEmbedder, build_reference, compare, parity_cases
from nexus_sli.exporter.export.validate import validation_texts
from nexus_sli.exporter.triton import config as tc
from nexus_sli.exporter.triton.python_models.encoding import SPLADE_ACTIVATIONS, SPLADE_STRATEGIES, splade
from nexus_sli.tasks import get_task
from helpers.rounding import EPS32
from helpers.servers import serving
from helpers.task_models import masked_lm, save
from helpers.tiny_models import COMMON, VOCAB, padded_feeds, plain_graph, quiet_session

TASK = get_task("sparse-embedding")
#: short, long, empty, one character, and past the models' 128 positions (truncated)
TEXTS = validation_texts()[:10] + ["", "a", "water " * 200]
COSINE = 0.9999
LENGTHS, WIDTH = (7, 3, 12, 1, 12), 20
#: name -> how the test builds it: a SparseEncoder folder (auto) or a bare masked-LM checkpoint (asked by task)
MODELS = ("bert_splade", "distilbert_splade")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_tokenizer):
    """The BERT masked-LM as a SparseEncoder folder (transformer + SpladePooling), the DistilBERT one bare."""
    root = tmp_path_factory.mktemp("sparse")
    bert = save(masked_lm("bert", 11), tiny_tokenizer, root / "bert_mlm")
    folder = root / "bert_splade"
    SparseEncoder(modules=[Transformer(str(bert), transformer_task="fill-mask"), STSpladePooling("max")],
                  device="cpu").save(str(folder))
    distilbert = save(masked_lm("distilbert", 12), tiny_tokenizer, root / "distilbert_mlm")
    return {"bert_splade": folder, "distilbert_splade": distilbert, "root": root}


@pytest.fixture(scope="module")
def served(tmp_path_factory, checkpoints):
    repo = tmp_path_factory.mktemp("sparse-repo")
    reports = {"bert_splade": run_export(ExportOptions(model=str(checkpoints["bert_splade"]), name="bert_splade",
                                                       out=repo)).report,
               "distilbert_splade": run_export(ExportOptions(model=str(checkpoints["distilbert_splade"]),
                                                             name="distilbert_splade", task="sparse-embedding",
                                                             out=repo)).report}
    with serving(repo) as server:
        yield {**server, "reports": reports}


@pytest.fixture(scope="module")
def references(checkpoints):
    """SparseEncoder.encode of every text, dense: the folder as saved, and the bare checkpoint wrapped with
    SparseEncoder's default SpladePooling (max, relu), which is what the export assumes without a folder."""
    bare = Transformer(str(checkpoints["distilbert_splade"]), transformer_task="fill-mask")
    encoders = {"bert_splade": SparseEncoder(str(checkpoints["bert_splade"]), device="cpu"),
                "distilbert_splade": SparseEncoder(modules=[bare, STSpladePooling()], device="cpu")}
    return {name: encoder.encode(TEXTS, convert_to_tensor=True).to_dense().numpy()
            for name, encoder in encoders.items()}


def _sparse(url: str, protocol: str, model: str, texts: list[str]) -> np.ndarray:
    module = httpclient if protocol == "http" else grpcclient
    tensor = module.InferInput("TEXT", [len(texts), 1], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode("utf-8") for t in texts], dtype=object).reshape(-1, 1))
    client = module.InferenceServerClient(url)
    try:
        return client.infer(model, [tensor]).as_numpy("SPARSE_EMBEDDING")
    finally:
        client.close()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("model", MODELS)
def test_served_sparse_embeddings_match_sparse_encoder(served, references, model, protocol):
    got, expected = _sparse(served[protocol], protocol, model, TEXTS), references[model]
    assert got.shape == expected.shape == (len(TEXTS), VOCAB) and got.dtype == np.float32
    assert (got >= 0).all()
    for row, (g, e) in enumerate(zip(got, expected)):
        cosine = float(g @ e / (np.linalg.norm(g) * np.linalg.norm(e)))
        assert cosine >= COSINE, (model, row, cosine)
        assert set(np.flatnonzero(g)) == set(np.flatnonzero(e)), (model, row)
    # a text alone gets what it got in the batch: padding and batch-mates change nothing
    np.testing.assert_allclose(_sparse(served[protocol], protocol, model, [TEXTS[3]])[0], got[3], atol=1e-5)


def test_exports_validate_and_describe_the_sparse_ensemble(served):
    for name, report in served["reports"].items():
        assert report.task == "sparse-embedding" and report.validation.passed and report.validation.max_abs_diff <= 1e-4
        assert report.outputs == ["SPARSE_EMBEDDING"] and report.pooled_in_graph is True
        assert (report.splade.strategy, report.splade.activation) == ("max", "relu")
        assert report.walk.tensors > 0 and not report.walk.absent_optional
        ensemble = tc.read(served["repo"] / name / "config.pbtxt")
        assert [(o.name, list(o.dims)) for o in ensemble.output] == [("SPARSE_EMBEDDING", [VOCAB])]
        # the SparseEncoder folder's prompts (sentence-transformers saves empty query/document ones) go along
        prompts = {"prompts": json.dumps({"document": "", "query": ""})} if name == "bert_splade" else {}
        assert {k: v.string_value for k, v in ensemble.parameters.items()} == {
            "task": "sparse-embedding", "vocab_size": str(VOCAB), "splade_pooling": "max", "splade_activation": "relu",
            "precision": report.validation.precision, "backend": report.to_dict()["backend"], **prompts}
        assert [s.model_name for s in ensemble.ensemble_scheduling.step] == [f"{name}_tokenizer", f"{name}_encoder"]
        encoder = tc.read(served["repo"] / f"{name}_encoder" / "config.pbtxt")
        assert [(o.name, list(o.dims)) for o in encoder.output] == [("SPARSE_EMBEDDING", [VOCAB])]
        assert not (served["repo"] / f"{name}_tokens").exists()  # no token states are kept for [vocab] logits


# --- the graph's SPLADE pooling ------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain(checkpoints, tmp_path_factory):
    """The BERT masked-LM's plain graph (logits out) and a padded batch."""
    model = transformers.AutoModelForMaskedLM.from_pretrained(str(checkpoints["root"] / "bert_mlm"),
                                                              attn_implementation="eager").eval()
    return plain_graph(model, TASK, tmp_path_factory.mktemp("splade-graph"), LENGTHS, WIDTH, seed=3)


@pytest.mark.parametrize("activation", SPLADE_ACTIVATIONS)
@pytest.mark.parametrize("strategy", SPLADE_STRATEGIES)
def test_graph_and_numpy_splade_match_sentence_transformers_module(plain, strategy, activation):
    """numpy's splade (validation's reference) == SpladePooling's forward on PyTorch's logits; the graph's
    pooling, with and without the padding trim, == numpy's on the graph's own logits."""
    feeds, folder = plain["feeds"], plain["folder"]
    with torch.no_grad():
        logits = plain["model"](**{k: torch.from_numpy(v) for k, v in feeds.items()}).logits
        module = STSpladePooling(strategy, activation).eval()
        features = {"token_embeddings": logits.clone(), "attention_mask": torch.from_numpy(feeds["attention_mask"])}
        st = module(features)["sentence_embedding"].numpy()
    # numpy's and PyTorch's kernels: the terms (log1p of relu) are >= 0, so the float32 rounding of their
    # sum over WIDTH tokens is relative to the result, plus each log1p's own (up to an ulp each, twice)
    np.testing.assert_allclose(splade(logits.numpy(), feeds["attention_mask"], strategy, activation), st,
                               rtol=(WIDTH + 4) * EPS32)
    pooled = add_splade_pooling(plain["path"], folder / f"{strategy}-{activation}.onnx", "logits",
                                "SPARSE_EMBEDDING", strategy, activation, VOCAB)
    trimmed = add_padding_trim(pooled, folder / f"{strategy}-{activation}.trim.onnx", [])
    (graph_logits,) = quiet_session(plain["path"]).run(None, feeds)
    expected = splade(graph_logits, feeds["attention_mask"], strategy, activation)
    for path in (pooled, trimmed):
        session = quiet_session(path)
        assert [o.name for o in session.get_outputs()] == ["SPARSE_EMBEDDING"]
        (got,) = session.run(None, feeds)
        assert got.shape == (len(LENGTHS), VOCAB) and got.dtype == np.float32
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got, st, rtol=1e-4, atol=1e-5)
        assert ((got > 0) == (expected > 0)).all()
    assert pooling_nodes(pooled)  # named with the pooling's prefix: targets keep it out of lower precisions


def test_graph_log1p_keeps_the_smallest_weights():
    """ONNX has no Log1p; log(1 + x) would round tiny weights to 0 and drop their terms."""
    import onnx
    from onnx import TensorProto, helper

    from nexus_sli.exporter.export import pooling

    nodes, out = pooling._log1p("x", "t/")
    used = {i for n in nodes for i in n.input}
    graph = helper.make_graph(nodes, "log1p", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None])],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, [None])],
                              [c for c in pooling.pooling_constants() if c.name in used])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    x = np.array([0.0, 1e-12, 3e-8, 1e-4, 0.5, 3.0, 1e6], np.float32)
    (got,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(got, np.log1p(x.astype(np.float64)), rtol=3e-7)
    assert (got[1:] > 0).all() and got[0] == 0


def test_validation_fails_a_graph_that_pools_otherwise(plain):
    """A graph summing where the reference maxes fails fp32 parity on values: a broken graph fails loudly."""
    reference = build_reference(plain["model"], TASK, plain["names"], parity_cases(plain["names"], VOCAB, 0, 128),
                                [plain["feeds"]])
    right = add_splade_pooling(plain["path"], plain["folder"] / "right.onnx", "logits", "SPARSE_EMBEDDING",
                               "max", "relu", VOCAB)
    wrong = add_splade_pooling(plain["path"], plain["folder"] / "wrong.onnx", "logits", "SPARSE_EMBEDDING",
                               "sum", "relu", VOCAB)
    embedder = SparseEmbedder("max", "relu")
    report = compare(quiet_session(right), reference, "fp32", embedder, TASK, pooled="SPARSE_EMBEDDING")
    assert report.passed and report.max_abs_diff < 1e-5 and report.cosine_min > 0.99999
    failed = compare(quiet_session(wrong), reference, "fp32", embedder, TASK, pooled="SPARSE_EMBEDDING")
    assert not failed.passed and any(isinstance(f, ValueMismatch) for f in failed.failures)


# --- what cannot be exported ---------------------------------------------------------------------


def test_unknown_splade_configs_are_refused_before_the_walk(checkpoints, tmp_path):
    folder = tmp_path / "odd"
    shutil.copytree(checkpoints["bert_splade"], folder)
    config = folder / "1_SpladePooling" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "pooling_strategy": "mean"}))
    with pytest.raises(NexusError, match="unsupported SpladePooling pooling_strategy 'mean'.*known: max, sum"):
        run_export(ExportOptions(model=str(folder), out=tmp_path / "repo"))
    assert not (tmp_path / "repo" / "odd").exists()


def test_families_without_the_masked_lm_head_and_checkpoints_without_it_are_refused(tiny_checkpoint, tmp_path):
    # the tiny RoBERTa is saved as RobertaForMaskedLM, but the export builds the head for bert and distilbert only
    with pytest.raises(UnsupportedModelError, match="builds for bert, distilbert, not for roberta"):
        run_export(ExportOptions(model=str(tiny_checkpoint("roberta")), task="sparse-embedding", out=tmp_path))
    # a BertModel checkpoint has no masked-LM head to load
    with pytest.raises(CheckpointError, match="lacks tensor.*cls.predictions"):
        run_export(ExportOptions(model=str(tiny_checkpoint("bert")), task="sparse-embedding", out=tmp_path))


def test_a_pretraining_checkpoint_walks_into_the_masked_lm_model(tiny_tokenizer, tmp_path):
    """bert-base-uncased's layout (BertForPreTraining: pooler, next-sentence head, the decoder tied to the word
    embeddings and saved once): the masked-LM head is loaded, the rest accounted for, and the walked model
    answers what the checkpoint's own model answers."""
    from nexus_sli.exporter.export.checkpoint import Checkpoint
    from nexus_sli.exporter.export.source import load_config
    from nexus_sli.exporter.export.walk import walk

    torch.manual_seed(13)
    pretraining = transformers.BertForPreTraining(BertConfig(**COMMON, architectures=["BertForPreTraining"])).eval()
    folder = save(pretraining, tiny_tokenizer, tmp_path / "pretraining")
    with Checkpoint(folder) as checkpoint:
        model, _, report = walk(load_config(folder), checkpoint, TASK)
    skipped = {key for keys in report.skipped.values() for key in keys}
    assert {"bert.pooler.dense.weight", "cls.seq_relationship.weight"} <= skipped
    assert not any(key.startswith("cls.predictions.") for key in skipped)
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    feeds = {k: torch.from_numpy(v) for k, v in padded_feeds(LENGTHS, WIDTH, seed=5).items()}
    with torch.no_grad():
        expected = pretraining(**feeds).prediction_logits
        torch.testing.assert_close(model(**feeds).logits, expected, rtol=1e-5, atol=1e-5)
