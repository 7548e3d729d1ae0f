"""BGE-M3: its dense vector, its sparse lexical weights and its ColBERT vectors from one encoder run.

A BGE-M3 checkpoint is an xlm-roberta encoder with two linear heads beside its
weights (``sparse_linear.pt``, ``colbert_linear.pt``; ``export/m3_heads.py``).
The encoder graph ends in the three heads and answers, per text:

- ``EMBEDDING`` ``[hidden]``: the CLS state, L2-normalised (the dense vector);
- ``SPARSE_WEIGHTS`` ``[sequence]``: each token's weight, ``relu`` of the
  sparse head, zero on padding and on the cls, eos, pad and unk ids; with
  ``TOKEN_IDS`` (the tokenizer's ``input_ids``) a client keeps per id its
  largest weight, FlagEmbedding's lexical weights;
- ``MULTI_VECTOR`` ``[sequence, dim]`` with ``SCORE_MASK``: the ColBERT
  vectors, as the ``multi-vector`` task answers them (every token but the
  first, ``</s>`` included), scored by MeanMaxSim.

A request asks for the outputs it needs; the ensemble answers the others too
only where asked.  The tokenizer step is the ``sided`` one with both sides
alike (no marker, no expansion or skiplist, the model's length) and the first
token never scored.  ``--task auto`` picks it for a folder with both heads.
"""

from __future__ import annotations

import numpy as np

from . import embedding, model_parameters
from .model_parameters import NORMALIZE, POOLING, SIMILARITY, VECTOR_SIZE, write
from .multi_vector import INPUT_TYPES, SCORE_MASK
from .spec import EMBEDDED, HIDDEN, TaskSpec, Tensor, register, text

#: what a BGE-M3 model answers, as a client or the gateway asks a model for it (``ModelInfo.serves``)
SERVES = "embedding,sparse-embedding,multi-vector"
#: how the token weights are answered: per token with their ids (a client reduces them per id), not a
#: ``[vocab]`` row as a SPLADE model's
SPARSE_FORM = "tokens"


def lexical(weights: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One text's lexical weights from its token weights ``[sequence]`` and token ids (at least as long; the
    encoder may cut the padding the ids keep): (ids ascending, per id its tokens' largest weight), zero
    weights left out, as FlagEmbedding's ``_process_token_weights``."""
    kept = weights > 0
    found, where = np.unique(ids[:len(weights)][kept], return_inverse=True)
    values = np.zeros(len(found), np.float32)
    np.maximum.at(values, where, weights[kept].astype(np.float32))
    return found.astype(np.int64), values


def post_params(config, embedder) -> dict[str, str]:
    """What clients read: the outputs it serves, the ColBERT vectors' similarity and size, the sides a
    request may name, and how the sparse weights come."""
    return write({model_parameters.SERVES: SERVES, SIMILARITY: embedder.similarity,
                  VECTOR_SIZE: embedder.vector_size, model_parameters.INPUT_TYPES: INPUT_TYPES,
                  model_parameters.SPARSE_FORM: SPARSE_FORM, POOLING: "cls", NORMALIZE: True})


SPEC = register(TaskSpec(
    name="bge-m3",
    auto_class="AutoModel",
    outputs=(("last_hidden_state", "last_hidden_state"),),
    inputs=(text("TEXT"),),
    results=(Tensor("EMBEDDING", "FP32", (HIDDEN,)), Tensor("SPARSE_WEIGHTS", "FP32", (-1,)),
             Tensor("TOKEN_IDS", "INT64", (-1,)), Tensor("MULTI_VECTOR", "FP32", (-1, EMBEDDED)),
             Tensor("SCORE_MASK", "INT64", (-1,))),
    encoder_outputs=(Tensor("last_hidden_state", "FP32", (-1, HIDDEN)),),
    post_inputs=("last_hidden_state", "attention_mask", SCORE_MASK),
    tokenizer_mode="sided",
    head="bge-m3",
    agreement=None,  # cosine: the dense vector, each ColBERT vector, each text's token weights
    parse=embedding.parse,  # the first result, the dense vectors; clients read the others by name
    post_params=post_params,
    token_extras=(Tensor(SCORE_MASK, "INT64", (-1,)),),
    per_token=True,
    pooled_by="bge-m3",
    usage=True,  # OpenAI's /v1/embeddings
    token_results=(("TOKEN_IDS", "input_ids"), ("SCORE_MASK", SCORE_MASK)),
))
