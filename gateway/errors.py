"""Errors, each answered in the caller's API's own error shape.

One :class:`GatewayError` is raised everywhere; how it is written depends on the
route: OpenAI's routes (``/v1/...``, and TEI's alias ``/embeddings``) answer
``{"error": {"message", "type", "param", "code"}}``, TEI's answer ``{"error",
"error_type"}`` with TEI's error types and statuses.  The client's exceptions map onto it in :func:`from_client`.
"""

from __future__ import annotations

from typing import NamedTuple

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.routing import Match

from nexus_sli.client import (
    ClientError,
    InvalidInputError,
    ModelNotFoundError,
    NoModelError,
    RetryableError,
    ServerBusyError,
    WrongTaskError,
)


class Kind(NamedTuple):
    """How one kind of error is answered by each API."""

    openai_status: int
    tei_status: int
    openai_type: str
    #: TEI's ``ErrorType`` as TEI serialises it (its variant names, capitalised)
    tei_type: str


#: Each kind of error, as each API answers it.  TEI's statuses are its own (router/src/http/server.rs):
#: ``Validation`` is a 422 and ``Empty`` a 400, a failed inference and a model of the wrong kind a 424
#: (``Backend``); its JSON extractor answers a body that does not parse with a 400, one past its payload
#: limit with a 413.  OpenAI answers every invalid request with a 400.
KINDS = {
    # the body does not parse as JSON
    "malformed": Kind(400, 400, "invalid_request_error", "Validation"),
    # it parses, and a field is missing or wrong, or past a limit (too many inputs, too long a text)
    "invalid": Kind(400, 422, "invalid_request_error", "Validation"),
    # no inputs at all
    "empty": Kind(400, 400, "invalid_request_error", "Empty"),
    "not_found": Kind(404, 404, "invalid_request_error", "Validation"),
    # a model of another task (TEI: "model is not a re-ranker model", a Backend error)
    "wrong_task": Kind(400, 424, "invalid_request_error", "Backend"),
    # the served model cannot do what the route asks (its tokenizer lacks /tokenize's mode)
    "unsupported": Kind(400, 424, "invalid_request_error", "Backend"),
    # the body past --max-body-bytes
    "too_large": Kind(413, 413, "invalid_request_error", "Validation"),
    "unauthorized": Kind(401, 401, "invalid_request_error", "Validation"),
    "no_route": Kind(404, 404, "invalid_request_error", "Validation"),
    "method_not_allowed": Kind(405, 405, "invalid_request_error", "Validation"),
    # more requests at once than the gateway admits, or than Triton's queue holds: OpenAI's rate-limit
    # answer, which its SDK retries after Retry-After; TEI's "Model is overloaded"
    "overloaded": Kind(429, 429, "rate_limit_error", "Overloaded"),
    "unavailable": Kind(503, 503, "server_error", "Unhealthy"),
    "backend": Kind(500, 424, "server_error", "Backend"),
}


class GatewayError(Exception):
    """A request the gateway refuses or could not serve; ``code`` is OpenAI's machine-readable code."""

    def __init__(self, kind: str, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None, allow: str | None = None):
        if kind not in KINDS:
            raise ValueError(f"unknown error kind {kind!r}; known kinds: {', '.join(KINDS)}")
        super().__init__(message)
        self.kind, self.message, self.param, self.code, self.retry_after = kind, message, param, code, retry_after
        #: the ``Allow`` header of a 405: the methods the route takes
        self.allow = allow

    def status(self, api: str) -> int:
        return status_of(self.kind, api)


def status_of(kind: str, api: str) -> int:
    return KINDS[kind].tei_status if api == "tei" else KINDS[kind].openai_status


#: how an exception no route foresaw (a bug, not a caller's mistake) is answered
UNFORESEEN = "backend"


def unforeseen(exc: Exception) -> GatewayError:
    return GatewayError(UNFORESEEN, f"the gateway failed on this request: {type(exc).__name__}: {exc}",
                        code="internal_error")


def from_client(exc: ClientError, retry_after: int) -> GatewayError:
    """The client's exception as a gateway error with the right status."""
    message = str(exc)
    if isinstance(exc, ModelNotFoundError):
        return GatewayError("not_found", message, param="model", code="model_not_found")
    if isinstance(exc, (WrongTaskError, NoModelError)):
        return GatewayError("wrong_task", message, param="model", code="wrong_task")
    if isinstance(exc, InvalidInputError):
        return GatewayError("invalid", message, param="input", code="invalid_input")
    # Triton refused the request for its full queue: overloaded, not down
    if isinstance(exc, ServerBusyError):
        return GatewayError("overloaded", message, code="rate_limit_exceeded", retry_after=retry_after)
    # every other retryable error (server down or too slow, model reloading, all replicas failed) is a 503
    if isinstance(exc, RetryableError):
        return GatewayError("unavailable", message, code="server_unavailable", retry_after=retry_after)
    return GatewayError("backend", message, code="inference_failed")


def from_http(exc: HTTPException, request) -> GatewayError:
    """Starlette's own refusals (404 no such route, 405 wrong method) as gateway errors.
    Only those two reach here: the routes raise :class:`GatewayError` themselves."""
    if exc.status_code == 405:
        allowed = _allowed_methods(request)
        return GatewayError("method_not_allowed", f"{request.method} {request.url.path} is not served; use "
                            f"{allowed or 'another method'}", code="method_not_allowed",
                            allow=allowed or None)
    if exc.status_code == 404:
        return GatewayError("no_route", f"no route {request.url.path}: OpenAI's are POST /v1/embeddings and GET "
                            "/v1/models, TEI's POST /embed, /rerank, /predict (docs/gateway.md)",
                            code="unknown_url")
    return GatewayError("invalid", str(exc.detail))


def _allowed_methods(request) -> str:
    """Every method some route of the path takes: Starlette's 405 names the first such route's alone (``/`` is
    TEI's POST and a GET probe)."""
    methods = set()
    for route in request.app.routes:
        if route.matches({**request.scope, "method": ""})[0] != Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return ", ".join(sorted(methods))


#: OpenAI's routes outside /v1: TEI's alias of its embeddings route.
OPENAI_ALIASES = frozenset({"/embeddings"})


def api_of(path: str) -> str:
    """Which API a path belongs to, and so which error shape it answers with."""
    return "openai" if path.startswith("/v1/") or path == "/v1" or path in OPENAI_ALIASES else "tei"


def render(error: GatewayError, api: str) -> JSONResponse:
    kind = KINDS[error.kind]
    headers = {"Retry-After": str(error.retry_after)} if error.retry_after is not None else {}
    if error.kind == "unauthorized":
        headers["WWW-Authenticate"] = "Bearer"
    if error.allow:
        headers["Allow"] = error.allow
    if api == "openai":
        body = {"error": {"message": error.message, "type": kind.openai_type, "param": error.param,
                          "code": error.code}}
    else:
        body = {"error": error.message, "error_type": kind.tei_type}
    return JSONResponse(body, status_code=error.status(api), headers=headers)
