"""nexus-sli gateway: the HTTP APIs embedding users already code against, in front of Triton.

OpenAI's ``/v1/embeddings`` and ``/v1/models``, and text-embeddings-inference's
``/embed``, ``/rerank``, ``/predict``, ``/similarity``, ``/tokenize``,
``/decode`` and ``/info``, answered by forwarding to Triton over gRPC with
:class:`nexus_sli.client.AsyncEncoderClient`.  The models and their
tasks are read from the server (:mod:`.discovery`); nothing in the model
repository changes.  docs/gateway.md describes the routes, limits and errors.
"""

from .config import API_KEY_ENV, GatewayConfig

__all__ = ["API_KEY_ENV", "REQUIRED_MODULES", "GatewayConfig", "create_app", "serve"]

#: The modules of the ``gateway`` extra the gateway imports beyond the client's: ``nexus-sli serve`` looks for
#: them (without importing them) before it starts a gateway beside Triton.
REQUIRED_MODULES = ("starlette", "uvicorn", "prometheus_client", "orjson")


def __getattr__(name: str):
    # The ASGI stack is imported only when used: the CLI reads the defaults above
    # without it, and an install without the ``gateway`` extra still runs the rest.
    if name == "create_app":
        from .app import create_app
        return create_app
    if name == "serve":
        from .server import serve
        return serve
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
