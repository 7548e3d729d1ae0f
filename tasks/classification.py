"""Text classification: scores per label for each text (softmax, sigmoids, or a regression's raw values)."""

from __future__ import annotations

import numpy as np

from .model_parameters import MULTI_LABEL, SCORE_FUNCTION, write
from .results import Label
from .spec import LABELS, TaskSpec, Tensor, check_top_k, label_params, register, sequence_classifier, text


def parse(outputs: list[np.ndarray], id2label: dict[int, str], top_k: int | None) -> list[list[Label]]:
    """The ``top_k`` labels of each text, best first (None: every label); labels of equal score in label order, as
    transformers' TextClassificationPipeline sorts them."""
    check_top_k(top_k, "every label")
    result = []
    for scores in (row for out in outputs for row in out):
        # stable: numpy's default sort may reorder equal scores (sigmoids saturated at 1, softmaxes at 0)
        order = np.argsort(-scores, kind="stable")[:top_k]
        result.append([Label(id2label.get(int(i), str(int(i))), float(scores[i])) for i in order])
    return result


def score_function(config) -> str:
    """How the head turns logits into scores, chosen from the config as transformers' TextClassificationPipeline
    chooses its ``function_to_apply``: none for a regression, a sigmoid per label for multi-label models and
    models of one label, else a softmax (a config that says none of this: its own ``function_to_apply``, else
    none)."""
    problem_type, labels = getattr(config, "problem_type", None), getattr(config, "num_labels", 2)
    if problem_type == "regression":
        return "none"
    if problem_type == "multi_label_classification" or labels == 1:
        return "sigmoid"
    if problem_type == "single_label_classification" or labels > 1:
        return "softmax"
    return getattr(config, "function_to_apply", None) or "none"


def post_params(config, embedder) -> dict[str, str]:
    multi_label = getattr(config, "problem_type", None) == "multi_label_classification"
    return {**label_params(config), **write({MULTI_LABEL: multi_label, SCORE_FUNCTION: score_function(config)})}


SPEC = register(TaskSpec(
    name="classification",
    auto_class="AutoModelForSequenceClassification",
    outputs=(("logits", "logits"),),
    inputs=(text("TEXT"),),
    results=(Tensor("SCORES", "FP32", (LABELS,)),),
    encoder_outputs=(Tensor("logits", "FP32", (LABELS,)),),
    post_inputs=("logits",),
    tokenizer_mode="single",
    head="classification",
    agreement="rows",
    parse=parse,
    inferred_from=lambda architecture, config: (sequence_classifier(architecture)
                                                and getattr(config, "num_labels", 2) != 1),
    post_params=post_params,
))
