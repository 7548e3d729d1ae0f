"""The ASGI application: routes, errors in each API's shape, auth, metrics, and the Triton connection."""

from __future__ import annotations

from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from nexus_sli.client import ClientError
from nexus_sli.client.replicas import Resolve

from . import openai_routes, tei_routes
from .admission import AdmissionMiddleware, inference_paths
from .auth import OPEN_PATHS, ApiKeyMiddleware
from .backend import Backend
from .config import GatewayConfig
from .errors import UNFORESEEN, GatewayError, api_of, from_client, from_http, render, status_of, unforeseen
from .metrics import Metrics, MetricsMiddleware


async def health(request: Request) -> Response:
    """200 when Triton is ready; 503 (TEI's ``Unhealthy``) with ``Retry-After`` when it is not.  Served on every
    probe path (``/health``, and TEI's ``GET /ping`` and ``GET /``)."""
    state = request.app.state
    if await state.backend.ready():
        return JSONResponse({"status": "ok", "triton": state.config.triton})
    return render(GatewayError("unavailable", f"Triton at {state.config.triton} is not ready",
                               retry_after=state.config.retry_after_s), "tei")


async def metrics(request: Request) -> Response:
    return request.app.state.metrics.response()


def create_app(config: GatewayConfig, resolve: Resolve | None = None) -> Starlette:
    """The gateway for ``config``; it connects to Triton when it starts (ASGI lifespan).
    ``resolve(host, port)``: how a ``dns:///`` name in ``config.triton`` is resolved (default: the
    system's resolver)."""
    probes = [Route(path, health, methods=["GET"]) for path in sorted(OPEN_PATHS)]
    routes = [*openai_routes.ROUTES, *tei_routes.ROUTES, *probes, Route("/metrics", metrics, methods=["GET"])]
    counters = Metrics(routes)

    @asynccontextmanager
    async def lifespan(app: Starlette):
        app.state.backend = Backend(config.triton, config.discovery_ttl_s, config.triton_timeout_s,
                                    config.triton_retry_s, resolve)
        try:
            yield
        finally:
            await app.state.backend.close()

    async def gateway_error(request: Request, exc: GatewayError) -> Response:
        return render(exc, api_of(request.url.path))

    async def client_error(request: Request, exc: ClientError) -> Response:
        return render(from_client(exc, config.retry_after_s), api_of(request.url.path))

    async def http_error(request: Request, exc: HTTPException) -> Response:
        # Starlette's own refusals (no such route, wrong method) in the API's shape, not plain text
        return render(from_http(exc, request), api_of(request.url.path))

    async def unexpected(request: Request, exc: Exception) -> Response:
        # still the API's shape (Starlette logs the traceback)
        return render(unforeseen(exc), api_of(request.url.path))

    # metrics outermost: a request refused for its API key or for load is counted too; the key is
    # checked before admission, so a caller without one never takes an admitted request's place
    middleware = [Middleware(MetricsMiddleware, metrics=counters,
                             unforeseen_status=lambda path: status_of(UNFORESEEN, api_of(path)))]
    if config.api_key:
        middleware.append(Middleware(ApiKeyMiddleware, api_key=config.api_key))
    if config.max_concurrent_requests:
        middleware.append(Middleware(AdmissionMiddleware, limit=config.max_concurrent_requests,
                                     paths=inference_paths(routes), metrics=counters))
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                    exception_handlers={GatewayError: gateway_error, ClientError: client_error,
                                        HTTPException: http_error, Exception: unexpected})
    app.state.config, app.state.metrics = config, counters
    return app
