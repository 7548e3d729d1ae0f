"""What both embedding routes share: the size check, normalisation, and the float/base64 encodings."""

from __future__ import annotations

import base64

import numpy as np

from .discovery import ServedModel
from .errors import GatewayError


def check_dimensions(value, model: ServedModel) -> None:
    """``dimensions`` may only restate the model's own size: a model trained for shorter
    (Matryoshka) embeddings would say so, and no export does yet."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise GatewayError("invalid", f"dimensions must be a positive integer, got {value!r}", param="dimensions")
    if value != model.dimensions:
        raise GatewayError("invalid", f"model {model.name!r} makes {model.dimensions}-dimensional embeddings and "
                           f"was not trained for shorter ones; omit dimensions or send {model.dimensions}",
                           param="dimensions", code="dimensions_not_supported")


def normalizes(model: ServedModel) -> bool:
    """Whether the served model's post-processing already normalises (the export's choice)."""
    return model.params.get("normalize", "false") == "true"


def unit_rows(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.maximum(norms, 1e-12)


def encode(vector: np.ndarray, encoding_format: str):
    """One embedding as OpenAI sends it: a list of floats, or base64 of little-endian float32."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return np.asarray(vector, dtype=np.float32).tolist()
