"""A route's answer made of a model's values, as JSON.

The values go out as orjson writes them: numpy arrays read directly, float32 values in their shortest form (as
TEI's serde writes an ``f32``), many times faster than Python's ``json`` over ``tolist()``, whose time holds the
event loop of every other request (bench/data/tried.md, "An answer of every token's vector").

JSON has no NaN or infinity (orjson would write ``null``).  A model that answers one has failed on those inputs
(an overflow at a reduced precision, a broken export); the caller is told so, with the model's name, as the API
reports a failed inference (OpenAI's 500, TEI's 424 ``Backend``), not as a fault of the gateway's own.
"""

from __future__ import annotations

import math

import numpy as np
import orjson
from starlette.responses import Response

from .errors import GatewayError


def answer(content, model: str, values=None) -> Response:
    """``content``, the values ``model`` answered (numpy arrays, lists, dicts, numbers, text), as the route's JSON
    response.  ``values``: those values in one array, where ``content`` spreads them over many small ones (a dict
    a row): checked at once, where a walk over the rows takes about 40% as long as writing them."""
    if not _finite(content if values is None else values):
        raise GatewayError("backend", f"model {model!r} answered a value that is not a finite number (NaN or "
                           "infinity) for these inputs, which JSON cannot carry; an export at a reduced precision "
                           "can overflow on some texts: compare an export with --precision fp32",
                           code="non_finite_output")
    return Response(orjson.dumps(content, default=_contiguous, option=orjson.OPT_SERIALIZE_NUMPY),
                    media_type="application/json")


def _finite(value) -> bool:
    if isinstance(value, np.ndarray):
        return not np.issubdtype(value.dtype, np.inexact) or bool(np.isfinite(value).all())
    if isinstance(value, (float, np.floating)):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return all(_finite(item) for item in value)
    return True


def _contiguous(value):
    """What orjson hands back: an array it does not read directly (a column cut of a matrix is not C-contiguous)."""
    if isinstance(value, np.ndarray):
        return np.ascontiguousarray(value)
    raise TypeError(f"{type(value).__name__} is not JSON")
