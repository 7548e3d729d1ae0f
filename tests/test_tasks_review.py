"""The task layer against the reference implementations users compare with, where an earlier answer differed:
a CrossEncoder saved by sentence-transformers v6 (its activation in ``config_sentence_transformers.json``), and
classification labels of equal score (transformers sorts them in label order)."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

from nexus_sli.exporter.export.source import load_config
from nexus_sli.exporter.triton.python_models.heads import HEADS
from nexus_sli.tasks import get_task
from nexus_sli.tasks.spec import TaskError
from test_task_heads import _classifier, _wordpiece

PAIRS = [("what did they find", "it was water, in the cellar"), ("what did they find", "a plan")]


def _saved_cross_encoder(path, activation: torch.nn.Module | None):
    """A one-label CrossEncoder saved by the installed sentence-transformers (``activation``: its own choice)."""
    from sentence_transformers import CrossEncoder

    model, tokenizer = _classifier(1), _wordpiece()
    model.save_pretrained(path / "base")
    tokenizer.save_pretrained(path / "base")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        CrossEncoder(str(path / "base"), device="cpu", activation_fn=activation).save(str(path / "ce"))
    return path / "ce", model, tokenizer


@pytest.mark.parametrize("activation, function", [(torch.nn.Identity(), "none"), (None, "sigmoid")])
def test_rerank_scores_follow_the_activation_a_saved_cross_encoder_names(tmp_path, activation, function):
    """sentence-transformers v6 saves the activation in ``config_sentence_transformers.json`` only, and
    ``CrossEncoder`` applies it on load: the served scores are ``predict``'s, not a sigmoid of them."""
    from sentence_transformers import CrossEncoder

    folder, model, tokenizer = _saved_cross_encoder(tmp_path, activation)
    params = get_task("rerank").post_params(load_config(folder), None)
    assert params["function_to_apply"] == function
    with torch.no_grad():
        logits = model(**tokenizer([q for q, _ in PAIRS], [d for _, d in PAIRS], return_tensors="pt",
                                   padding=True)).logits.numpy()
    served = HEADS["rerank"]({"logits": logits}, params)["SCORES"]
    expected = CrossEncoder(str(folder), device="cpu").predict(PAIRS)
    np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-6)


def test_the_saved_activation_goes_before_config_json_and_an_unapplied_one_is_refused(tmp_path):
    folder, _, _ = _saved_cross_encoder(tmp_path, torch.nn.Identity())
    config = load_config(folder)
    config.sentence_transformers = {"activation_fn": "torch.nn.modules.activation.Sigmoid"}
    assert get_task("rerank").post_params(config, None)["function_to_apply"] == "none"
    saved = json.loads((folder / "config_sentence_transformers.json").read_text())
    (folder / "config_sentence_transformers.json").write_text(
        json.dumps({**saved, "activation_fn": "mypackage.Scale"}))  # not torch's: CrossEncoder falls back
    assert get_task("rerank").post_params(config, None)["function_to_apply"] == "sigmoid"
    (folder / "config_sentence_transformers.json").write_text(
        json.dumps({**saved, "activation_fn": "torch.nn.modules.activation.Tanh"}))
    with pytest.raises(TaskError, match="names the activation torch.nn.modules.activation.Tanh"):
        get_task("rerank").post_params(config, None)


def test_labels_of_equal_score_come_in_label_order_as_the_text_classification_pipeline_gives_them():
    """Saturated sigmoids of a multi-label model are equal float32 scores: ranked, and cut by ``top_k``, in label
    order, as transformers' pipeline (a stable sort) ranks them, whatever numpy's default sort does."""
    import transformers

    labels = 120
    model = _classifier(labels, problem_type="multi_label_classification")
    logits = np.full((1, labels), -3.0, np.float32)
    logits[0, ::3] = 40.0  # sigmoid 1.0 in float32
    logits[0, 7] = 1.0
    pipe = transformers.pipeline("text-classification", model=model, tokenizer=_wordpiece())
    expected = pipe.postprocess({"logits": torch.tensor(logits)}, top_k=None, _legacy=False)
    scores = HEADS["classification"]({"logits": logits}, get_task("classification").post_params(model.config, None))
    served = get_task("classification").parse([scores["SCORES"]], model.config.id2label, None)[0]
    assert [label.label for label in served] == [row["label"] for row in expected]
    # elementwise sigmoids of the same float32 logits, no sum: numpy's and torch's differ by an ulp at most
    np.testing.assert_allclose([label.score for label in served], [row["score"] for row in expected], rtol=1e-6)
    top = get_task("classification").parse([scores["SCORES"]], model.config.id2label, 3)[0]
    assert [label.label for label in top] == [model.config.id2label[i] for i in (0, 3, 6)]


def test_a_classifier_of_several_labels_is_refused_as_a_reranker_before_its_walk(tmp_path, tiny_tokenizer):
    """``--task rerank`` forced on a two-label classifier: its graph answers two logits a pair where the served
    head takes one, so the export would pass and every request fail; it is refused, naming the task to use."""
    from nexus_sli.exporter.errors import NexusError
    from nexus_sli.exporter.export.pipeline import ExportOptions, run_export

    model = _classifier(2)
    model.config.architectures = ["BertForSequenceClassification"]
    model.save_pretrained(tmp_path / "ckpt")
    tiny_tokenizer.save(str(tmp_path / "ckpt" / "tokenizer.json"))
    with pytest.raises(NexusError, match="has 2 labels.*--task classification"):
        run_export(ExportOptions(model=str(tmp_path / "ckpt"), name="rr", out=tmp_path / "repo", task="rerank"))
    assert not (tmp_path / "repo").exists()
    assert get_task("rerank").refusal(_classifier(1).config) is None
