"""Text classification: one label distribution per text (softmax, or sigmoids for multi-label)."""

from __future__ import annotations

import numpy as np

from .model_parameters import MULTI_LABEL, write
from .results import Label
from .spec import LABELS, TaskSpec, Tensor, label_params, register, sequence_classifier, text


def parse(outputs: list[np.ndarray], id2label: dict[int, str], top_k: int) -> list[list[Label]]:
    """The ``top_k`` labels of each text, best first."""
    result = []
    for scores in (row for out in outputs for row in out):
        order = np.argsort(-scores)[:top_k]
        result.append([Label(id2label.get(int(i), str(int(i))), float(scores[i])) for i in order])
    return result


def post_params(config, embedder) -> dict[str, str]:
    multi_label = getattr(config, "problem_type", None) == "multi_label_classification"
    return {**label_params(config), **write({MULTI_LABEL: multi_label})}


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
