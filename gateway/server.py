"""Run the gateway on uvicorn, and say where it listens once it does."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import sys

import uvicorn

from .app import create_app
from .config import API_KEY_ENV, GatewayConfig


def urls(config: GatewayConfig) -> str:
    # A wildcard bind is reached on loopback from this machine.  The same mapping as
    # exporter.serving.server.client_host, repeated: the gateway may not import the exporter.
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(config.host, config.host)
    base = f"http://{f'[{host}]' if ':' in host else host}:{config.port}"
    return f"{base} (OpenAI: {base}/v1, TEI: {base}/embed /rerank /predict)"


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the gateway to this machine."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name other than localhost: it may resolve to anything
        return False


def exposure_warning(config: GatewayConfig) -> str | None:
    """The warning for a gateway reachable beyond this machine with no API key, else None."""
    if config.api_key or is_loopback(config.host):
        return None
    return (f"nexus-sli gateway: WARNING: listening on {config.host!r} with no API key: anyone who reaches this "
            f"port can use the models. Set the {API_KEY_ENV} environment variable (an --api-key value is visible "
            "to every user in the process list), or bind 127.0.0.1 (docs/gateway.md)")


class _Server(uvicorn.Server):
    """uvicorn, except that a stop asked by SIGTERM or Ctrl-C ends the process normally.

    uvicorn re-raises the signal it caught once it has shut down, so the process would die
    by it (exit 143 / 130) even after a clean stop; a process manager, and ``nexus-sli
    serve`` beside it, would read that as a crash."""

    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            try:
                yield
            finally:
                # uvicorn's own (private) list of the signals it caught, read once we are done: nothing
                # to re-raise.  Where a uvicorn lacks it, the signal is re-raised as uvicorn intends.
                getattr(self, "_captured_signals", []).clear()


async def _serve(server: uvicorn.Server, config: GatewayConfig) -> None:
    task = asyncio.create_task(_until_stopped(server))
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        print(f"nexus-sli gateway is ready: {urls(config)}, forwarding to Triton gRPC {config.triton}", flush=True)
    await task


async def _until_stopped(server: uvicorn.Server) -> None:
    try:
        await server.serve()
    except SystemExit:  # uvicorn's way out where it cannot bind, its reason logged: serve() answers 1, no traceback
        pass


def serve(config: GatewayConfig) -> int:
    """Serve until stopped.  Ctrl-C or SIGTERM: uvicorn finishes open requests, then stops,
    and the exit code is 0; 1 when the gateway could not start (the port taken, say)."""
    warning = exposure_warning(config)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    server = _Server(uvicorn.Config(create_app(config), host=config.host, port=config.port,
                                    log_level="warning", access_log=False))
    asyncio.run(_serve(server, config))
    return 0 if server.started else 1
