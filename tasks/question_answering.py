"""Extractive question answering: answer spans in a context, long contexts in overlapping windows."""

from __future__ import annotations

import json

import numpy as np

from .results import Answer
from .spec import TaskSpec, Tensor, check_top_k, label_params, register, text


def parse(outputs: list[np.ndarray], top_k: int | None) -> list[Answer]:
    """The ``top_k`` best answers (the head sends one JSON list per question; None: all of them)."""
    check_top_k(top_k, "every answer the model sent")
    return [Answer(**a) for a in json.loads(outputs[0].reshape(-1)[0])][:top_k]


SPEC = register(TaskSpec(
    name="question-answering",
    auto_class="AutoModelForQuestionAnswering",
    outputs=(("start_logits", "start_logits"), ("end_logits", "end_logits")),
    inputs=(text("QUESTION"), text("CONTEXT")),
    results=(text("ANSWERS"),),
    encoder_outputs=(Tensor("start_logits", "FP32", (-1,)), Tensor("end_logits", "FP32", (-1,))),
    post_inputs=("CONTEXT", "start_logits", "end_logits", "offsets", "context_mask", "word_spans"),
    tokenizer_mode="qa",
    head="question-answering",
    agreement="span",
    parse=parse,
    inferred_from=lambda architecture, config: architecture.endswith("ForQuestionAnswering"),
    post_params=lambda config, embedder: label_params(config),
    # word_spans: each context token's word, which answers are widened to (repositories exported before it
    # lack it and keep their own steps, which read only offsets)
    token_extras=(Tensor("offsets", "INT64", (-1, 2)), Tensor("context_mask", "INT64", (-1,)),
                  Tensor("word_spans", "INT64", (-1, 2))),
    batched=False,
    pair=True,
    per_token=True,
))
