"""Reranking: a cross-encoder scores each (query, document) pair; one query per request."""

from __future__ import annotations

import numpy as np

from .results import Ranked
from .spec import TaskSpec, Tensor, check_top_k, label_params, register, sequence_classifier, text


def parse(outputs: list[np.ndarray], documents: list[str], top_k: int | None) -> list[Ranked]:
    """The documents by relevance, best first (all of them, or the ``top_k`` best)."""
    check_top_k(top_k, "every document")
    scores = np.concatenate(outputs) if outputs else np.zeros((0,), np.float32)
    ranked = sorted((Ranked(i, float(s), documents[i]) for i, s in enumerate(scores)), key=lambda r: -r.score)
    return ranked if top_k is None else ranked[:top_k]


SPEC = register(TaskSpec(
    name="rerank",
    auto_class="AutoModelForSequenceClassification",
    outputs=(("logits", "logits"),),
    inputs=(text("QUERY"), text("DOCUMENTS", (-1,))),
    results=(Tensor("SCORES", "FP32", (-1,)),),
    encoder_outputs=(Tensor("logits", "FP32", (1,)),),
    post_inputs=("logits",),
    tokenizer_mode="pair",
    head="rerank",
    agreement="order",
    parse=parse,
    # a sequence classifier with one label is a cross-encoder
    inferred_from=lambda architecture, config: (sequence_classifier(architecture)
                                                and getattr(config, "num_labels", 2) == 1),
    post_params=lambda config, embedder: label_params(config),
    batched=False,
    pair=True,
))
