"""What each task returns to a client: small typed results, parsed by the task specs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Label:
    label: str
    score: float


@dataclass(frozen=True)
class Entity:
    text: str
    label: str
    start: int
    end: int
    score: float


@dataclass(frozen=True)
class Answer:
    text: str
    start: int
    end: int
    score: float


@dataclass(frozen=True)
class Ranked:
    index: int
    score: float
    document: str


@dataclass(frozen=True, eq=False)
class SparseEmbedding:
    """A text's active vocabulary terms: their ids (ascending) and weights."""

    indices: np.ndarray
    values: np.ndarray

    def dense(self, size: int) -> np.ndarray:
        """The ``[size]`` vector (size: the model's vocabulary, ``vocab_size`` of its ensemble)."""
        vector = np.zeros(size, np.float32)
        vector[self.indices] = self.values
        return vector


@dataclass(frozen=True, eq=False)
class M3Embedding:
    """A text's BGE-M3 outputs from one pass; None where the call did not ask for it."""

    #: the dense vector ``[hidden]``, unit norm
    dense: np.ndarray | None
    #: the lexical weights: per token id its largest weight
    sparse: SparseEmbedding | None
    #: the ColBERT vectors ``[tokens, dim]``, unit norm (every token but the first)
    vectors: np.ndarray | None
