"""Token classification (NER): labelled entities with character offsets into each text."""

from __future__ import annotations

import json

import numpy as np

from .results import Entity
from .spec import LABELS, TaskSpec, Tensor, label_params, register, text


def parse(outputs: list[np.ndarray]) -> list[list[Entity]]:
    """The entities of each text (the head sends one JSON list per text)."""
    return [[Entity(**e) for e in json.loads(item)] for out in outputs for item in out.reshape(-1)]


SPEC = register(TaskSpec(
    name="token-classification",
    auto_class="AutoModelForTokenClassification",
    outputs=(("logits", "logits"),),
    inputs=(text("TEXT"),),
    results=(text("ENTITIES"),),
    encoder_outputs=(Tensor("logits", "FP32", (-1, LABELS)),),
    post_inputs=("TEXT", "logits", "offsets", "attention_mask", "special_tokens_mask"),
    tokenizer_mode="single",
    head="token-classification",
    agreement="tokens",
    parse=parse,
    inferred_from=lambda architecture, config: architecture.endswith("ForTokenClassification"),
    post_params=lambda config, embedder: label_params(config),
    # special_tokens_mask: the tokens the head skips (the tokenizer's own; a real token may have an empty span)
    token_extras=(Tensor("offsets", "INT64", (-1, 2)), Tensor("special_tokens_mask", "INT64", (-1,))),
    per_token=True,
))
