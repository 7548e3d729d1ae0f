"""A route's answer made of a model's values, as JSON.

JSON has no NaN or infinity (Starlette's ``JSONResponse`` refuses them).  A model that answers one has
failed on those inputs (an overflow at a reduced precision, a broken export); the caller is told so, with
the model's name, as the API reports a failed inference (OpenAI's 500, TEI's 424 ``Backend``), not as a
fault of the gateway's own.
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from .errors import GatewayError


def answer(content, model: str) -> JSONResponse:
    """``content``, the values ``model`` answered, as the route's JSON response."""
    try:
        return JSONResponse(content)
    except ValueError:  # json.dumps(allow_nan=False): a value that is not finite
        raise GatewayError("backend", f"model {model!r} answered a value that is not a finite number (NaN or "
                           "infinity) for these inputs, which JSON cannot carry; an export at a reduced precision "
                           "can overflow on some texts: compare an export with --precision fp32",
                           code="non_finite_output") from None
