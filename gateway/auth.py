"""The optional API key: ``Authorization: Bearer <key>`` on every route but ``/health``."""

from __future__ import annotations

import secrets

from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request

from .errors import GatewayError, api_of, render

#: Routes open without the key: a load balancer's health probe carries none.
OPEN_PATHS = frozenset({"/health"})


class ApiKeyMiddleware(BaseHTTPMiddleware):
    def __init__(self, app, api_key: str):
        super().__init__(app)
        self._expected = f"Bearer {api_key}".encode()

    async def dispatch(self, request: Request, call_next):
        if request.url.path in OPEN_PATHS:
            return await call_next(request)
        given = request.headers.get("authorization", "").encode()
        # constant time: the comparison must not tell how much of a guess was right
        if not secrets.compare_digest(given, self._expected):
            what = "no API key was sent" if not given else "the API key is not valid"
            error = GatewayError("unauthorized", f"{what}: send the header 'Authorization: Bearer <key>'",
                                 code="invalid_api_key")
            return render(error, api_of(request.url.path))
        return await call_next(request)
