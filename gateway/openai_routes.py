"""OpenAI's embeddings API: ``POST /v1/embeddings`` and ``GET /v1/models``.

As OpenAI defines them (platform.openai.com/docs/api-reference/embeddings):
``input`` a string or a list of strings, ``model``, ``encoding_format``
``float`` or ``base64``, ``dimensions``, ``user`` (accepted, unused); the answer
is ``{"object": "list", "data": [{"object": "embedding", "index", "embedding"}],
"model", "usage": {"prompt_tokens", "total_tokens"}}``.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from .embeddings import check_dimensions, encode, normalizes, unit_rows
from .errors import GatewayError
from .limits import check_texts, read_json, text_list

ENCODING_FORMATS = ("float", "base64")


async def embeddings(request: Request) -> JSONResponse:
    state = request.app.state
    body = await read_json(request, state.config.max_body_bytes)
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise GatewayError("invalid", "model is required: the name of a served embedding model "
                           "(GET /v1/models lists them)", param="model")
    if "input" not in body:
        raise GatewayError("invalid", "input is required: a string or a list of strings", param="input")
    texts = check_texts(text_list(body["input"], "input"), state.config, "input")
    encoding_format = body.get("encoding_format") or "float"
    if encoding_format not in ENCODING_FORMATS:
        raise GatewayError("invalid", f"encoding_format must be one of {', '.join(ENCODING_FORMATS)}, "
                           f"got {encoding_format!r}", param="encoding_format")
    model = await state.backend.catalog.get(name, "embedding")
    check_dimensions(body.get("dimensions"), model)
    vectors, tokens = await state.backend.embed_counted(model, texts)
    state.metrics.texts.labels(request.url.path).inc(len(texts))
    if not normalizes(model):  # OpenAI's embeddings are unit vectors; so are these
        vectors = unit_rows(vectors)
    data = [{"object": "embedding", "index": i, "embedding": encode(v, encoding_format)}
            for i, v in enumerate(vectors)]
    return JSONResponse({"object": "list", "data": data, "model": model.name,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def models(request: Request) -> JSONResponse:
    """Every model Triton serves through the gateway; ``task`` (ours) says which route serves it.
    The list is the catalog's (read again after its refresh interval), so polling this route
    never turns into a discovery per request."""
    served = await request.app.state.backend.catalog.models()
    data = [{"id": m.name, "object": "model", "created": 0, "owned_by": "nexus-sli", "task": m.task}
            for m in sorted(served.values(), key=lambda m: m.name)]
    return JSONResponse({"object": "list", "data": data})


ROUTES = [Route("/v1/embeddings", embeddings, methods=["POST"]), Route("/v1/models", models, methods=["GET"])]
