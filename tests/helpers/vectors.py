"""Comparing vectors the way every fidelity check here does."""

from __future__ import annotations

import numpy as np


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine of ``a`` and ``b`` along their last axis."""
    a = a / np.linalg.norm(a, axis=-1, keepdims=True)
    b = b / np.linalg.norm(b, axis=-1, keepdims=True)
    return np.sum(a * b, axis=-1)
