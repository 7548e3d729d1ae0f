"""Sentence embeddings: the encoder's token states, pooled and (usually) normalised."""

from __future__ import annotations

import numpy as np

from .model_parameters import NORMALIZE, POOLING, write
from .spec import EMBEDDED, HIDDEN, TaskSpec, Tensor, register, text


def parse(outputs: list[np.ndarray], dims: int = 0) -> np.ndarray:
    """One embedding row per text, over every chunk the client sent; none sent (no text): ``[0, dims]``, the
    model's size where the caller knows it."""
    return np.concatenate(outputs) if outputs else np.zeros((0, dims), np.float32)


def post_params(config, embedder) -> dict[str, str]:
    return write({POOLING: embedder.pooling, NORMALIZE: embedder.normalize})


SPEC = register(TaskSpec(
    name="embedding",
    auto_class="AutoModel",
    outputs=(("last_hidden_state", "last_hidden_state"),),
    inputs=(text("TEXT"),),
    results=(Tensor("EMBEDDING", "FP32", (EMBEDDED,)),),
    encoder_outputs=(Tensor("last_hidden_state", "FP32", (-1, HIDDEN)),),
    post_inputs=("last_hidden_state", "attention_mask"),
    tokenizer_mode="single",
    head="embedding",
    agreement=None,
    parse=parse,
    post_params=post_params,
    per_token=True,
    pooled_by="sentence",
    # beside the pooled embedding, each token's state: served as NAME_tokens (TEI's /embed_all)
    token_states=Tensor("TOKEN_EMBEDDINGS", "FP32", (-1, HIDDEN)),
    usage=True,  # OpenAI's /v1/embeddings
))
