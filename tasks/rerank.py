"""Reranking: a cross-encoder scores each (query, document) pair; one query per request.  The score is
sentence-transformers' ``CrossEncoder.predict``'s: the logit through the activation the model's config names
(:func:`score_function`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .model_parameters import SCORE_FUNCTION, write
from .results import Ranked
from .spec import TaskError, TaskSpec, Tensor, check_top_k, label_params, register, sequence_classifier, text

#: The activations a CrossEncoder's config may name (its class path), as the head's score functions.
ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid", "torch.nn.modules.linear.Identity": "none"}


def parse(outputs: list[np.ndarray], documents: list[str], top_k: int | None) -> list[Ranked]:
    """The documents by relevance, best first (all of them, or the ``top_k`` best)."""
    check_top_k(top_k, "every document")
    scores = np.concatenate(outputs) if outputs else np.zeros((0,), np.float32)
    ranked = sorted((Ranked(i, float(s), documents[i]) for i, s in enumerate(scores)), key=lambda r: -r.score)
    return ranked if top_k is None else ranked[:top_k]


#: Where sentence-transformers from its v6 saves a CrossEncoder's activation (its ``activation_fn`` key), beside
#: the checkpoint; it takes precedence over what ``config.json`` names.
ST_CONFIG = "config_sentence_transformers.json"


def score_function(config) -> str:
    """The head's score function, as sentence-transformers' ``CrossEncoder`` chooses the activation: the one its
    ``config_sentence_transformers.json`` names (from its v6), else the one ``config.json`` names
    (``sentence_transformers.activation_fn``; before its v4, ``sbert_ce_default_activation_function``), each
    only where it is torch's (another it would not import without ``trust_remote_code``), else a sigmoid of the
    one logit."""
    for path in (_saved_activation(config), _config_activation(config)):
        if isinstance(path, str) and path.startswith("torch."):
            if path not in ACTIVATIONS:
                raise TaskError(f"the cross-encoder's config names the activation {path}, which the served head "
                                f"does not apply (it applies {', '.join(ACTIVATIONS)})")
            return ACTIVATIONS[path]
    return "sigmoid"


def _saved_activation(config):
    """``activation_fn`` of the ``config_sentence_transformers.json`` beside the checkpoint the config was read
    from (``name_or_path``); None where there is none."""
    folder = getattr(config, "name_or_path", None)
    file = Path(folder) / ST_CONFIG if folder else None
    if file is None or not file.is_file():
        return None
    try:
        saved = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise TaskError(f"{file} is not valid JSON ({exc})") from None
    return saved.get("activation_fn") if isinstance(saved, dict) else None


def _config_activation(config):
    """The activation ``config.json`` names: a ``sentence_transformers`` entry that has the key decides, even
    where it is null, as in ``CrossEncoder.get_default_activation_fn``."""
    named = getattr(config, "sentence_transformers", None)
    if isinstance(named, dict) and "activation_fn" in named:
        return named["activation_fn"]
    return getattr(config, "sbert_ce_default_activation_function", None)


def refusal(config) -> str | None:
    """A cross-encoder answers one logit a pair, its score; a classifier of several labels has no one score."""
    labels = getattr(config, "num_labels", 2)
    if labels == 1:
        return None
    return (f"a reranker scores a (query, document) pair with one logit, and this checkpoint has {labels} labels; "
            "export it with --task classification to serve its labels")


def post_params(config, embedder) -> dict[str, str]:
    return {**label_params(config), **write({SCORE_FUNCTION: score_function(config)})}


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
    refusal=refusal,
    post_params=post_params,
    batched=False,
    pair=True,
))
