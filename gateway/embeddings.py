"""What the embedding routes share: the model's prompt, side and size checks as 400s naming the field, and
OpenAI's float/base64 encodings.  The rules themselves are the model description's
(:class:`~nexus_sli.client.model_info.ModelInfo`); here they only take the gateway's error shape."""

from __future__ import annotations

import base64

import numpy as np

from nexus_sli.client.errors import DimensionsError, UnknownInputTypeError, UnknownPromptError
from nexus_sli.client.model_info import ModelInfo

from .errors import GatewayError


def check_prompt(value, model: ModelInfo) -> str | None:
    """``prompt_name`` if it names one of the model's prompts; None (the model's default prompt, if any)."""
    try:
        return model.check_prompt(value)
    except UnknownPromptError as exc:
        listed = ", ".join(exc.known) if exc.known else "none: this model has no prompts"
        raise GatewayError("invalid", f"unknown prompt_name {exc.prompt_name!r} for model {exc.model!r}; its "
                           f"prompts: {listed}", param="prompt_name", code="prompt_not_found") from None


def check_input_type(value, model: ModelInfo) -> str:
    """``input_type``: a side the late-interaction model reads (``query`` or ``document``)."""
    try:
        return model.check_input_type(value)
    except UnknownInputTypeError as exc:
        raise GatewayError("invalid", str(exc), param="input_type", code="invalid_input_type") from None


def check_dimensions(value, model: ModelInfo) -> int | None:
    """``dimensions``: any size from 1 to the model's (each route cuts the vectors to it, and says whether
    they are normalised again)."""
    try:
        return model.check_dimensions(value)
    except DimensionsError as exc:
        hint = f"; it was trained for {', '.join(map(str, exc.trained))}" if exc.trained else ""
        raise GatewayError("invalid", f"dimensions must be an integer from 1 to {exc.size} for model "
                           f"{exc.model!r}{hint}; got {exc.dimensions!r}", param="dimensions") from None


def encode(vector: np.ndarray, encoding_format: str):
    """One embedding as OpenAI sends it: float32 values (written as a list by :func:`.answers.answer`), or base64
    of little-endian float32."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return np.asarray(vector, dtype=np.float32)
