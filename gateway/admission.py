"""Admission control: a bound on the inference requests the gateway has in flight.

Past ``max_concurrent_requests`` a request is refused at once with a 429 and
``Retry-After``, as TEI answers past its ``--max-concurrent-requests``.  The
gateway keeps no queue of its own: Triton's batchers queue and merge what is
admitted, and a request that waits behind a burst until its caller gives up
still costs the server its work.  A refusal costs nothing, and every client
that honours ``Retry-After`` (the ``openai`` SDK does) sends it again later.

Only the routes that call Triton for inference are bounded; health probes,
scrapes and the routes that read the gateway's own model list are always answered.
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import GatewayError, api_of, render
from .metrics import Metrics

#: ``Retry-After`` of a refusal, in seconds: the least the header can say; a place frees as soon as
#: any admitted request is answered.
RETRY_AFTER_S = 1


def inference_paths(routes: Iterable[Route]) -> frozenset[str]:
    """The routes admission bounds: every POST route calls Triton; the GET routes (models, info,
    health, metrics) read what the gateway already holds."""
    return frozenset(route.path for route in routes if "POST" in (route.methods or ()))


def overloaded(limit: int) -> GatewayError:
    return GatewayError("overloaded", f"the gateway is answering its limit of {limit} concurrent requests "
                        f"(--max-concurrent-requests); retry after {RETRY_AFTER_S} s",
                        code="rate_limit_exceeded", retry_after=RETRY_AFTER_S)


class AdmissionMiddleware:
    """Counts the requests on ``paths`` in flight and refuses those past ``limit``.  A plain ASGI
    middleware: one event loop serves every request, so a counter needs no lock, and the refusal
    is written before the request's body is read."""

    def __init__(self, app: ASGIApp, limit: int, paths: frozenset[str], metrics: Metrics):
        self.app, self.limit, self.paths, self.metrics = app, limit, paths, metrics
        #: inference requests admitted and not yet answered
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        # by method too: GET / is a health probe, POST / an inference request
        if scope["type"] != "http" or scope["method"] != "POST" or path not in self.paths:
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            self.metrics.refused.labels(self.metrics.route(scope)).inc()
            await render(overloaded(self.limit), api_of(path))(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
