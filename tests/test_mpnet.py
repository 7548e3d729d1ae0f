"""MPNet: the relative position bias lives in the encoder, outside its layers.

The walk rebuilds the layers and loads the encoder's ``relative_attention_bias``
table with the embeddings; the exported graph recomputes the bias buckets for
whatever length it is fed.  These tests hold the export to transformers' own
``MPNetModel`` (loaded by transformers, not by the walk) at lengths in each kind
of bucket (exact up to distance 8, log-spaced up to 128, clamped past it), and
export a seeded tiny model for every task the family serves.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
import transformers

from nexus_sli.exporter.export import export_report
from nexus_sli.exporter.export.checkpoint import Checkpoint
from nexus_sli.exporter.export.families import family_for
from nexus_sli.exporter.export.onnx_export import export_onnx, model_input_names
from nexus_sli.exporter.export.pipeline import ExportOptions, run_export
from nexus_sli.exporter.export.source import load_config
from nexus_sli.exporter.export.walk import walk
from nexus_sli.tasks import get_task
from helpers.tiny_models import COMMON, VOCAB, TINY_CONFIGS, padded_feeds

#: one row per kind of bucket: exact (<= 8), log-spaced (<= 128) and clamped (> 128)
LENGTHS = [1, 5, 9, 40, 128, 200, 256]
PAD = 1  # MPNetEmbeddings fixes padding_idx at 1


def _mpnet_feeds(lengths: list[int], width: int) -> dict[str, np.ndarray]:
    """Right-padded random ids (real tokens drawn from 5 up, so never the pad id), padded with MPNet's pad id."""
    feeds = padded_feeds(lengths, width, seed=len(lengths))
    ids = feeds["input_ids"]
    ids[feeds["attention_mask"] == 0] = PAD
    return {"input_ids": ids, "attention_mask": feeds["attention_mask"]}


@pytest.fixture(scope="module")
def plain_graph(tiny_checkpoint, tmp_path_factory):
    """The tiny MPNet checkpoint walked and exported as the plain graph (token states out)."""
    directory = tiny_checkpoint("mpnet")
    config = load_config(directory)
    task = get_task("embedding")
    with Checkpoint(directory) as checkpoint:
        model, _, report = walk(config, checkpoint, task)
    path = tmp_path_factory.mktemp("mpnet-onnx") / "plain.onnx"
    inputs = export_onnx(model, task, model_input_names(model, config), VOCAB, path)
    return directory, path, inputs, report


def test_mpnet_is_registered_with_its_facts(tiny_checkpoint):
    config = load_config(tiny_checkpoint("mpnet"))
    family = family_for("mpnet", ["MPNetForMaskedLM"], config)
    assert family.model_type == "mpnet"
    assert family.max_positions(config) == 256  # 258 positions, numbered from padding_idx + 1
    assert family.create_layer(config, 0).__class__.__name__ == "MPNetLayer"


def test_walk_loads_the_bias_table_outside_the_layers(plain_graph):
    _, _, inputs, report = plain_graph
    assert inputs == ["input_ids", "attention_mask"]  # MPNet has no segment embeddings
    assert report.layers_loaded == 2
    # the masked-LM head of the saved MPNetForMaskedLM is accounted for, not silently dropped
    assert any(key.startswith("lm_head.") for key in report.skipped["pre-training head the task does not use"])


@pytest.mark.parametrize("length", LENGTHS)
def test_graph_matches_transformers_mpnet_at_each_length(plain_graph, length):
    directory, path, _, _ = plain_graph
    reference = transformers.MPNetModel.from_pretrained(directory, attn_implementation="eager").eval()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = _mpnet_feeds([length], length)
    with torch.no_grad():
        expected = reference(**{k: torch.from_numpy(v) for k, v in feeds.items()}).last_hidden_state.numpy()
    (got,) = session.run(["last_hidden_state"], feeds)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


def test_graph_matches_transformers_mpnet_on_a_padded_batch_of_every_length(plain_graph):
    directory, path, _, _ = plain_graph
    reference = transformers.MPNetModel.from_pretrained(directory, attn_implementation="eager").eval()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = _mpnet_feeds(LENGTHS, max(LENGTHS))
    with torch.no_grad():
        expected = reference(**{k: torch.from_numpy(v) for k, v in feeds.items()}).last_hidden_state.numpy()
    (got,) = session.run(["last_hidden_state"], feeds)
    for row, n in enumerate(LENGTHS):  # padding rows' states are never read: compare the real tokens
        np.testing.assert_allclose(got[row, :n], expected[row, :n], atol=1e-4, rtol=0)


# -- every task the family serves -------------------------------------------------------------------

#: task -> (transformers class, config overrides)
TASK_MODELS = {
    "embedding": ("MPNetForMaskedLM", {}),
    "classification": ("MPNetForSequenceClassification",
                       {"num_labels": 3, "id2label": {0: "a", 1: "b", 2: "c"}, "label2id": {"a": 0, "b": 1, "c": 2}}),
    "rerank": ("MPNetForSequenceClassification", {"num_labels": 1}),
    "token-classification": ("MPNetForTokenClassification", {"num_labels": 5}),
    "question-answering": ("MPNetForQuestionAnswering", {"num_labels": 2}),
}
AUTO_CLASSES = {"embedding": "AutoModel", "classification": "AutoModelForSequenceClassification",
                "rerank": "AutoModelForSequenceClassification",
                "token-classification": "AutoModelForTokenClassification",
                "question-answering": "AutoModelForQuestionAnswering"}


def _task_checkpoint(task: str, directory, tokenizer):
    architecture, overrides = TASK_MODELS[task]
    _, family_overrides = TINY_CONFIGS["mpnet"]
    config = transformers.MPNetConfig(**{**COMMON, **family_overrides, **overrides})
    config.architectures = [architecture]
    torch.manual_seed(11)
    model = getattr(transformers, architecture)(config).eval()
    if task == "rerank":  # random scores sit within 1e-9 of each other: spread them so rankings are decisions
        with torch.no_grad():
            model.classifier.out_proj.weight.mul_(1000)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


@pytest.mark.parametrize("task", list(TASK_MODELS))
def test_every_task_exports_and_matches_transformers(task, tiny_tokenizer, tmp_path):
    checkpoint = _task_checkpoint(task, tmp_path / "ckpt", tiny_tokenizer)
    run_export(ExportOptions(model=str(checkpoint), task=task, name="m", out=tmp_path / "repo"))
    encoder = tmp_path / "repo" / "m_encoder"
    report = export_report.read(encoder)
    assert report.validation.passed is True and report.model_type == "mpnet" and report.task == task
    assert report.validation.max_abs_diff <= 1e-4

    # the served graph against transformers' own task model, on a padded batch
    reference = getattr(transformers, AUTO_CLASSES[task]).from_pretrained(
        checkpoint, attn_implementation="eager").eval()
    session = ort.InferenceSession(str(encoder / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = _mpnet_feeds([12, 30, 7], 30)
    with torch.no_grad():
        output = reference(**{k: torch.from_numpy(v) for k, v in feeds.items()})
    names = [o.name for o in session.get_outputs()]
    got = dict(zip(names, session.run(None, feeds)))
    spec = get_task(task)
    if task == "embedding":  # the graph ends in the pooling (mean, no Normalize module in this checkpoint)
        mask = torch.from_numpy(feeds["attention_mask"]).unsqueeze(-1).float()
        expected = ((output.last_hidden_state * mask).sum(1) / mask.sum(1)).numpy()
        np.testing.assert_allclose(got[names[0]], expected, atol=1e-4, rtol=0)
        return
    for name, attribute in spec.outputs:
        expected = getattr(output, attribute).numpy()
        if spec.per_token:  # the graph cuts trailing padding: compare the real tokens of each row
            for row, n in enumerate([12, 30, 7]):
                np.testing.assert_allclose(got[name][row, :n], expected[row, :n], atol=1e-4, rtol=0)
        else:
            np.testing.assert_allclose(got[name], expected, atol=1e-4, rtol=0)
