"""What both embedding routes share: prompts, Matryoshka sizes, normalisation, and the float/base64 encodings."""

from __future__ import annotations

import base64
import json

import numpy as np

from .discovery import ServedModel
from .errors import GatewayError


def prompts(model: ServedModel) -> dict[str, str]:
    """The model's named prompts (from its sentence-transformers config; empty: none)."""
    return json.loads(model.params.get("prompts", "{}"))


def trained_dimensions(model: ServedModel) -> list[int]:
    """The sizes the model was trained for (Matryoshka), largest first, where its card names them."""
    return json.loads(model.params.get("matryoshka_dims", "[]"))


def check_prompt(value, model: ServedModel) -> str | None:
    """``prompt_name`` if it names one of the model's prompts; None (the model's default prompt, if any)."""
    if value is None:
        return None
    known = prompts(model)
    if not isinstance(value, str) or value not in known:
        listed = ", ".join(known) if known else "none: this model has no prompts"
        raise GatewayError("invalid", f"unknown prompt_name {value!r} for model {model.name!r}; its prompts: {listed}",
                           param="prompt_name", code="prompt_not_found")
    return value


def check_dimensions(value, model: ServedModel) -> int | None:
    """``dimensions``: any size from 1 to the model's (the vectors are cut to it and normalised again)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= model.dimensions:
        trained = trained_dimensions(model)
        hint = f"; it was trained for {', '.join(map(str, trained))}" if trained else ""
        raise GatewayError("invalid", f"dimensions must be an integer from 1 to {model.dimensions} for model "
                           f"{model.name!r}{hint}; got {value!r}", param="dimensions")
    return value


def normalizes(model: ServedModel) -> bool:
    """Whether the served model's post-processing already normalises (the export's choice)."""
    return model.params.get("normalize", "false") == "true"


def encode(vector: np.ndarray, encoding_format: str):
    """One embedding as OpenAI sends it: a list of floats, or base64 of little-endian float32."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return np.asarray(vector, dtype=np.float32).tolist()
