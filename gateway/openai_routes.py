"""OpenAI's embeddings API: ``POST /v1/embeddings`` (also ``/embeddings``, as TEI serves it), ``GET /v1/models``
and ``GET /v1/models/{model}``.

As OpenAI defines them (platform.openai.com/docs/api-reference/embeddings):
``input`` a string or a list of strings, ``model``, ``encoding_format``
``float`` or ``base64``, ``dimensions`` (any size from 1 to the model's: cut,
then normalised), ``user`` (accepted, unused), and ours, ``prompt_name`` (one
of the model's prompts; the SDK sends it in ``extra_body``); the answer
is ``{"object": "list", "data": [{"object": "embedding", "index", "embedding"}],
"model", "usage": {"prompt_tokens", "total_tokens"}}``.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from nexus_sli.client.calls import unit_rows
from nexus_sli.tasks.spec import TOKEN_TASK

from .answers import answer
from .embeddings import check_dimensions, check_prompt, encode
from .errors import GatewayError
from .limits import check_texts, read_json, text_list

ENCODING_FORMATS = ("float", "base64")
#: LangChain's OpenAIEmbeddings sends tiktoken ids unless told not to: say how
IDS_ADVICE = "send the texts instead (LangChain's OpenAIEmbeddings: check_embedding_ctx_length=False)"


async def embeddings(request: Request) -> Response:
    state = request.app.state
    body = await read_json(request, state.config.max_body_bytes)
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise GatewayError("invalid", "model is required: the name of a served embedding model "
                           "(GET /v1/models lists them)", param="model")
    if "input" not in body:
        raise GatewayError("invalid", "input is required: a string or a list of strings", param="input")
    texts = check_texts(text_list(body["input"], "input", ids_advice=IDS_ADVICE), state.config, "input")
    # absent or null: the default; any other value one of the formats (an empty string or false is no format)
    encoding_format = "float" if body.get("encoding_format") is None else body["encoding_format"]
    if encoding_format not in ENCODING_FORMATS:
        raise GatewayError("invalid", f"encoding_format must be one of {', '.join(ENCODING_FORMATS)}, "
                           f"got {encoding_format!r}", param="encoding_format")
    model = await state.backend.catalog.get(name, "embedding")
    dimensions = check_dimensions(body.get("dimensions"), model)
    prompt_name = check_prompt(body.get("prompt_name"), model)  # ours: the openai SDK sends it in extra_body
    vectors, tokens = await state.backend.embed_counted(model, texts, prompt_name)
    state.metrics.texts.labels(request.url.path).inc(len(texts))
    vectors = model.cut(vectors, dimensions)
    # OpenAI's embeddings are always unit vectors, shortened ones too: a cut vector is normalised again,
    # and so is one from a model that does not normalise in the server (TEI's routes normalise only if asked)
    if dimensions is not None or not model.normalizes:
        vectors = unit_rows(vectors)
    data = [{"object": "embedding", "index": i, "embedding": encode(v, encoding_format)}
            for i, v in enumerate(vectors)]
    # the vectors checked as one matrix (base64 carries any float32, NaN too)
    return answer({"object": "list", "data": data, "model": model.name,
                   "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}, model.name,
                  vectors if encoding_format == "float" else ())


async def models(request: Request) -> JSONResponse:
    """Every model Triton serves through the gateway; ``task`` (ours) says which route serves it.
    The list is the catalog's (read again after its refresh interval), so polling this route
    never turns into a discovery per request."""
    served = await request.app.state.backend.catalog.models()
    # an embedding model's NAME_tokens ensemble is part of it (TEI's /embed_all), not a model of its own
    data = [_model_object(m) for m in sorted(served.values(), key=lambda m: m.name) if m.task != TOKEN_TASK]
    return JSONResponse({"object": "list", "data": data})


async def model(request: Request) -> JSONResponse:
    """One model of :func:`models` (the openai SDK's ``models.retrieve``); an unknown one is a 404."""
    name = request.path_params["model"]
    found = await request.app.state.backend.catalog.get(name, None)  # a 404 if unknown, a 503 if reloading
    if found.task == TOKEN_TASK:  # part of its embedding model, as in the list
        raise GatewayError("not_found", f"model {name!r} is part of another model, not one of its own (GET "
                           "/v1/models lists the served ones)", param="model", code="model_not_found")
    return JSONResponse(_model_object(found))


def _model_object(model) -> dict:
    """OpenAI's model object, and ours: ``task`` says which route serves it."""
    return {"id": model.name, "object": "model", "created": 0, "owned_by": "nexus-sli", "task": model.task,
            "precision": model.precision, "backend": model.backend, **_described(model)}


def _described(model) -> dict:
    """Ours, for embedding models: the size, the sizes it was trained for (Matryoshka; any size up to
    ``dimensions`` may be asked for), and its named prompts."""
    if not model.serves("embedding"):
        return {}
    return {"dimensions": model.dimensions, "matryoshka_dimensions": model.trained_dimensions,
            "prompts": model.prompts, "default_prompt_name": model.default_prompt_name}


# TEI serves OpenAI's embeddings route without /v1 too (errors.OPENAI_ALIASES: answered in OpenAI's shape)
ROUTES = [Route("/v1/embeddings", embeddings, methods=["POST"]), Route("/embeddings", embeddings, methods=["POST"]),
          Route("/v1/models", models, methods=["GET"]), Route("/v1/models/{model:path}", model, methods=["GET"])]
