"""Sparse (SPLADE) embeddings: one weight per vocabulary entry, from a masked-LM head.

The encoder graph runs the model's masked-LM head and ends in SPLADE pooling,
``max`` (or ``sum``) over the text's tokens of ``log(1 + relu(logits))``, as
sentence-transformers' ``SpladePooling`` computes it (``export/pooling.py``); it
answers ``SPARSE_EMBEDDING``, ``[vocab]`` per text, zeros where a term is
inactive.  Families with a masked-LM head that the exporter builds: bert and
distilbert (``EncoderFamily.masked_lm``).
"""

from __future__ import annotations

import numpy as np

from .model_parameters import SPLADE_ACTIVATION, SPLADE_POOLING, VOCAB_SIZE, write
from .spec import VOCAB, TaskSpec, Tensor, register, text


def parse(outputs: list[np.ndarray]) -> np.ndarray:
    """One dense ``[vocab]`` row per text, over every chunk the client sent."""
    return np.concatenate(outputs) if outputs else np.zeros((0, 0), np.float32)


def post_params(config, embedder) -> dict[str, str]:
    """How the head pools (a graph that pools ignores them), and the vocabulary size clients index into."""
    return write({SPLADE_POOLING: embedder.strategy, SPLADE_ACTIVATION: embedder.activation,
                  VOCAB_SIZE: int(config.vocab_size)})


SPEC = register(TaskSpec(
    name="sparse-embedding",
    auto_class="AutoModelForMaskedLM",
    outputs=(("logits", "logits"),),
    inputs=(text("TEXT"),),
    results=(Tensor("SPARSE_EMBEDDING", "FP32", (VOCAB,)),),
    encoder_outputs=(Tensor("logits", "FP32", (-1, VOCAB)),),
    post_inputs=("logits", "attention_mask"),
    tokenizer_mode="single",
    head="sparse-embedding",
    agreement=None,
    parse=parse,
    # not from the architecture: most *ForMaskedLM checkpoints (bert-base-uncased) are exported for dense
    # embeddings; a sentence-transformers folder with a SpladePooling module says sparse (export/pipeline.py)
    inferred_from=lambda architecture, config: False,
    post_params=post_params,
    per_token=True,
    pooled_by="splade",
))
