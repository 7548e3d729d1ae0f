"""The optional API key: ``Authorization: Bearer <key>`` on every route but the health probes."""

from __future__ import annotations

import secrets

from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request

from .errors import GatewayError, api_of, render

#: The health probes, ``GET`` routes open without the key (a load balancer's probe carries none): ``/health``, and
#: TEI's aliases of it, ``/ping`` (SageMaker's) and ``/`` (whose ``POST`` is ``/embed``, which needs the key).
OPEN_PATHS = frozenset({"/health", "/ping", "/"})


def is_probe(method: str, path: str) -> bool:
    return method in ("GET", "HEAD") and path in OPEN_PATHS


def bearer_key(authorization: str) -> bytes | None:
    """The key of an ``Authorization`` header's Bearer credentials, None for another scheme or none.  RFC 9110:
    the scheme is case-insensitive (``bearer KEY`` is the same), one or more spaces before the key."""
    scheme, space, key = authorization.partition(" ")
    return key.lstrip(" ").encode() if space and scheme.lower() == "bearer" else None


class ApiKeyMiddleware(BaseHTTPMiddleware):
    def __init__(self, app, api_key: str):
        super().__init__(app)
        self._expected = api_key.encode()

    async def dispatch(self, request: Request, call_next):
        if is_probe(request.method, request.url.path):
            return await call_next(request)
        given = request.headers.get("authorization", "")
        key = bearer_key(given)
        # constant time: the comparison must not tell how much of a guess was right (the scheme is no secret)
        if key is None or not secrets.compare_digest(key, self._expected):
            what = "no API key was sent" if not given else "the API key is not valid"
            error = GatewayError("unauthorized", f"{what}: send the header 'Authorization: Bearer <key>'",
                                 code="invalid_api_key")
            return render(error, api_of(request.url.path))
        return await call_next(request)
