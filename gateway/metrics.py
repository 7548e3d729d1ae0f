"""Request counts, latency histograms and requests in flight, in Prometheus' text format at ``/metrics``.

Each app has its own registry, so two gateways in one process (tests) never
share counts.  Requests are labelled by the path pattern of the route the
gateway has for them (``/v1/models/{model:path}``, one series for every model
asked), and ``other`` for any other path; methods by name for HTTP's own, and
``other`` for any other token a client sends; so a scanner cannot grow the
label set.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.responses import Response
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .auth import is_probe

#: Seconds; a batch of 2048 texts on a CPU takes tens of seconds.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

#: The methods labelled by name: HTTP's (RFC 9110 and PATCH).
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "CONNECT"})

#: Not load: probes (auth.is_probe) and scrapes are left out of the in-flight gauge (a scrape would count itself).
SCRAPE_PATH = "/metrics"


class Metrics:
    def __init__(self, routes: Iterable[Route]):
        self.routes = list(routes)
        self.registry = CollectorRegistry()
        self.requests = Counter("nexus_sli_gateway_requests", "HTTP requests answered, by route and status",
                                ["route", "method", "status"], registry=self.registry)
        self.latency = Histogram("nexus_sli_gateway_request_duration_seconds",
                                 "Time from request to response, by route", ["route", "method"],
                                 buckets=BUCKETS, registry=self.registry)
        self.texts = Counter("nexus_sli_gateway_texts", "Texts sent to Triton, by route", ["route"],
                             registry=self.registry)
        # a load signal of its own: refusals are also in the requests' 429s, mixed with Triton's full queue
        self.refused = Counter("nexus_sli_gateway_requests_refused",
                               "Requests refused at once (429) because the gateway had --max-concurrent-requests "
                               "in flight, by route", ["route"], registry=self.registry)
        # No labels: one series per gateway from its start, 0 when idle, which the autoscaler's
        # metric (deploy/k8s/monitoring/prometheus-adapter-values.yaml) needs to exist
        self.in_flight = Gauge("nexus_sli_gateway_requests_in_flight",
                               "HTTP requests being answered now (probes and scrapes left out)", registry=self.registry)

    def route(self, scope: Scope) -> str:
        """The path pattern of the route that takes ``scope``'s path, matched as the router matches it (a route
        of its path taking another method: the 405's); ``other`` where none does."""
        partial = None
        for route in self.routes:
            match, _ = route.matches(scope)
            if match == Match.FULL:
                return route.path
            if match == Match.PARTIAL and partial is None:
                partial = route.path
        return partial or "other"

    @staticmethod
    def method(name: str) -> str:
        return name if name in METHODS else "other"

    def response(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class MetricsMiddleware:
    """Counts each HTTP request, times it from its arrival to its last byte, and keeps the in-flight
    gauge.  A plain ASGI middleware: Starlette's ``BaseHTTPMiddleware`` runs every request through a
    task and memory streams of its own, which a short query pays for (bench/data/tried.md, "The
    gateway's HTTP stack")."""

    def __init__(self, app: ASGIApp, metrics: Metrics, unforeseen_status: Callable[[str], int] = lambda path: 500):
        self.app, self.metrics = app, metrics
        #: the status of a path's answer to an exception no handler inside took: the app's handler of every
        #: other exception answers it outside this middleware (in Starlette's ServerErrorMiddleware)
        self.unforeseen_status = unforeseen_status

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method, start = scope["path"], scope["method"], time.perf_counter()
        status = None
        counted = path != SCRAPE_PATH and not is_probe(method, path)

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        if counted:
            self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, sending)
        finally:
            if counted:
                self.metrics.in_flight.dec()
            if status is None:  # an exception, answered outside
                status = self.unforeseen_status(path)
            route, named = self.metrics.route(scope), self.metrics.method(method)
            self.metrics.latency.labels(route, named).observe(time.perf_counter() - start)
            self.metrics.requests.labels(route, named, str(status)).inc()
