"""text-embeddings-inference's routes: ``POST /embed``, ``/embed_sparse``, ``/embed_all``, ``/rerank``, ``/predict``,
``/similarity`` and ``GET /info`` (``/tokenize`` and ``/decode``: :mod:`.tei_tokens`), and ours beside them,
``/embed_multi_vector`` (a late-interaction model's vectors per text, as ``/embed_all`` answers token vectors).

Request and response shapes are TEI's (its OpenAPI description is kept as test
data in tests/data/tei/).  TEI serves one model, so its requests name none; here
the one model serving the route's task answers (or the gateway's ``tei_model``),
and a request may add ``"model": "<name>"`` where several do.  The routes every
task has (``/info``, ``/tokenize``, ``/decode``) take the one model served, the
``tei_model``, or the one named (``GET /info``: ``?model=NAME``).  Where TEI has an option the served model
cannot honour, the answer is a clear error, never a silently different result (``truncate``:
:mod:`.tei_truncation`).
"""

from __future__ import annotations

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from nexus_sli.client.calls import unit_rows
from nexus_sli.tasks.multi_vector import DOCUMENT

from . import tei_info, tei_tokens
from .answers import answer
from .discovery import Tasks, named, serving
from .embeddings import check_dimensions, check_input_type, check_prompt
from .errors import GatewayError
from .limits import check_count, check_texts, check_token_vectors, flag, read_json, text_list
from .tei_tokens import model_of_any_task
from .tei_truncation import check_direction, check_truncate


async def _model(request: Request, body: dict, task: Tasks):
    """The model the request names, else the gateway's ``tei_model`` where it serves ``task`` (one of them, for
    a tuple), else the one model serving it."""
    name = body.get("model")
    catalog = request.app.state.backend.catalog
    if name is None:
        pinned = request.app.state.config.tei_model
        if pinned is None:
            return await catalog.only_for(task)
        model = await catalog.pinned(pinned, task)
        if serving(model, task):
            return model
        # the pinned model serves another task (one pin for /embed): this route takes its task's only model
        try:
            return await catalog.only_for(task)
        except GatewayError as exc:
            exc.message += f" (the gateway's --tei-model {pinned!r} serves {model.task!r}, not {named(task)})"
            raise
    if not isinstance(name, str):
        raise GatewayError("invalid", "model must be a string", param="model")
    return await catalog.get(name, task)


def _no_raw_scores(body: dict) -> None:
    """/predict: a softmax cannot be undone (its logits are known only up to a constant)."""
    if flag(body, "raw_scores", False):
        raise GatewayError("invalid", "raw_scores is not available on /predict: the served classifiers return "
                           "their scores (softmax, sigmoid, or a regression's raw values: function_to_apply), "
                           "and a softmax's logits cannot be recovered", param="raw_scores")


#: The tasks /rerank takes: a cross-encoder, or a late-interaction model ranking by its own score.
RERANKERS = ("rerank", "multi-vector")

#: The served score is float32: it is kept inside (smallest normal float32, 1 - float32's step
#: below 1), so that a score rounded to 0 or 1 still has a finite logit.
_LOW, _HIGH = float(np.finfo(np.float32).tiny), 1.0 - float(np.finfo(np.float32).epsneg)


def logits(scores: list[float]) -> list[float]:
    """The reranker's logits from its served scores, ``sigmoid(logit)`` (heads.py): the inverse,
    ``log(p) - log1p(-p)``.  Exact up to the float32 rounding of ``p``, which grows as ``p``
    nears 1 (docs/gateway.md, "/rerank"); where float32 rounds ``p`` to 1 (logit past about 16.6)
    or to 0 (below about -87) the clip gives the furthest logit float32 can tell apart."""
    p = np.clip(np.asarray(scores, dtype=np.float64), _LOW, _HIGH)
    return (np.log(p) - np.log1p(-p)).tolist()


async def _embedding_request(request: Request, task: str, vectors_of: str | None = None):
    """(state, body, texts, model, prompt_name) of a TEI embedding-kind request: ``inputs``, the truncation
    options, ``prompt_name``; the model serving ``task``.  ``vectors_of``: the route, where it answers a vector
    per token (bounded by :func:`check_token_vectors` before any call to Triton)."""
    state = request.app.state
    body = await read_json(request, state.config.max_body_bytes)
    if "inputs" not in body:
        raise GatewayError("invalid", "inputs is required: a string or a list of strings", param="inputs")
    texts = check_texts(text_list(body["inputs"], "inputs"), state.config, "inputs")
    check_direction(body)
    model = await _model(request, body, task)
    prompt_name = check_prompt(body.get("prompt_name"), model)
    if vectors_of is not None:
        check_token_vectors(texts, model, state.config, vectors_of)
    await check_truncate(state.backend, body, model, texts, "inputs", prompt_name)
    return state, body, texts, model, prompt_name


async def embed(request: Request) -> Response:
    state, body, texts, model, prompt_name = await _embedding_request(request, "embedding")
    dimensions = check_dimensions(body.get("dimensions"), model)
    normalize = flag(body, "normalize", True)
    if not normalize and model.normalizes:
        raise GatewayError("invalid", f"normalize=false is not available for model {model.name!r}: its export "
                           "normalises in the server (export it with normalisation off for raw vectors)",
                           param="normalize")
    vectors = await state.backend.embed(model, texts, prompt_name)  # TEI reports no token counts: none are made
    state.metrics.texts.labels(request.url.path).inc(len(texts))
    vectors = model.cut(vectors, dimensions)
    # TEI's order: cut, then normalise only when asked (``normalize``, true by default), so that
    # normalize=false returns the cut values as the model made them (OpenAI's route always normalises)
    if normalize and (dimensions is not None or not model.normalizes):
        vectors = unit_rows(vectors)
    return answer(np.asarray(vectors, dtype=np.float32), model.name)


async def embed_sparse(request: Request) -> Response:
    """A sparse-embedding (SPLADE) model's active terms per text, or a BGE-M3 model's lexical weights, as TEI's
    ``[{index, value}]``, ids ascending."""
    state, _, texts, model, prompt_name = await _embedding_request(request, "sparse-embedding")
    found = await state.backend.client.embed_sparse(texts, model=model.name, prompt_name=prompt_name)
    state.metrics.texts.labels(request.url.path).inc(len(texts))
    return answer([[{"index": int(i), "value": np.float32(v)} for i, v in zip(e.indices, e.values)]
                   for e in found], model.name)


async def embed_all(request: Request) -> Response:
    """Each token's vector, unpooled, per text (special tokens included), from the embedding model's
    token ensemble (``NAME_tokens``)."""
    state, _, texts, model, prompt_name = await _embedding_request(request, "embedding", "/embed_all")
    found = await state.backend.client.embed_tokens(texts, model=model.name, prompt_name=prompt_name)
    state.metrics.texts.labels(request.url.path).inc(len(texts))
    return answer([np.asarray(vectors, dtype=np.float32) for vectors in found], model.name)


async def embed_multi_vector(request: Request) -> Response:
    """A late-interaction (multi-vector) model's vectors per text, one per token it scores on the side
    ``input_type`` names (``query`` or ``document``, default ``document``)."""
    state, body, texts, model, prompt_name = await _embedding_request(request, "multi-vector", "/embed_multi_vector")
    input_type = check_input_type(DOCUMENT if body.get("input_type") is None else body["input_type"], model)
    found = await state.backend.client.embed_multi_vector(texts, model=model.name, input_type=input_type,
                                                          prompt_name=prompt_name)
    state.metrics.texts.labels(request.url.path).inc(len(texts))
    return answer([np.asarray(vectors, dtype=np.float32) for vectors in found], model.name)


async def rerank(request: Request) -> Response:
    state = request.app.state
    body = await read_json(request, state.config.max_body_bytes)
    query = body.get("query")
    if not isinstance(query, str):
        raise GatewayError("invalid", "query is required: a string", param="query")
    if not isinstance(body.get("texts"), list):  # TEI's texts is a list: a lone string is refused, as TEI does
        raise GatewayError("invalid", "texts is required: a list of strings", param="texts")
    texts = check_texts(text_list(body["texts"], "texts", "a list of strings"), state.config, "texts", empty_ok=True)
    check_texts([query], state.config, "query", empty_ok=True)
    if not query and "" in texts:  # as TEI, a pair is refused only where both of its sides are empty
        raise GatewayError("empty", f"query and texts[{texts.index('')}] are both empty: a pair needs some text",
                           param="texts")
    check_direction(body)
    raw_scores = flag(body, "raw_scores", False)
    return_text = flag(body, "return_text", False)
    model = await _model(request, body, RERANKERS)
    await check_truncate(state.backend, body, model, texts, "texts")
    ranked = await state.backend.client.rerank(query, texts, model=model.name)
    state.metrics.texts.labels(request.url.path).inc(len(texts))
    scores = _tei_scores(model, [r.score for r in ranked], raw_scores)
    return answer([{"index": r.index, "score": score, **({"text": r.document} if return_text else {})}
                   for r, score in zip(ranked, scores)], model.name)


def _tei_scores(model, scores: list[float], raw_scores: bool) -> list[float]:
    """TEI's rerank scores from the served ones: the sigmoid of the logit, or the logit itself (``raw_scores``),
    whatever the cross-encoder's own activation (a sigmoid, or none: the served score is its logit).  The
    order is the same either way.  A late-interaction score is no probability: it is its own raw score."""
    if not model.serves("rerank"):
        return scores
    if (model.score_function or "sigmoid") == "none":
        return scores if raw_scores else (1.0 / (1.0 + np.exp(-np.asarray(scores, dtype=np.float64)))).tolist()
    return logits(scores) if raw_scores else scores


def _predict_inputs(value) -> tuple[list[str], bool]:
    """(texts, single) from TEI's PredictInput: a string or a one-string list (one input, answered as a flat
    list), a pair of strings, or a batch of one-string lists and pairs."""
    if isinstance(value, str):
        return [value], True
    if isinstance(value, list) and value and all(isinstance(item, str) for item in value):
        return [_one_text(value)], True
    if isinstance(value, list) and all(isinstance(item, list) and all(isinstance(t, str) for t in item)
                                       for item in value):
        return [_one_text(item) for item in value], False
    raise GatewayError("invalid", "inputs must be a string or a batch of one-text lists [[\"text\"], ...]",
                       param="inputs")


def _one_text(sequence: list[str]) -> str:
    """The text of one of TEI's sequences: one string; a pair is TEI's form for sentence-pair models."""
    if len(sequence) == 2:
        raise GatewayError("invalid", "inputs holds a pair of strings (TEI's form for sentence-pair models); the "
                           "served classifiers take one text: send a string, or a batch [[\"text\"], ...]",
                           param="inputs")
    if len(sequence) != 1:
        raise GatewayError("invalid", f"inputs holds a sequence of {len(sequence)} strings: TEI's are one text "
                           "[\"text\"] or a pair [\"text\", \"text\"]", param="inputs")
    return sequence[0]


async def predict(request: Request) -> Response:
    state = request.app.state
    body = await read_json(request, state.config.max_body_bytes)
    if "inputs" not in body:
        raise GatewayError("invalid", "inputs is required", param="inputs")
    texts, single = _predict_inputs(body["inputs"])
    check_texts(texts, state.config, "inputs")
    check_direction(body)
    _no_raw_scores(body)
    model = await _model(request, body, "classification")
    await check_truncate(state.backend, body, model, texts, "inputs")
    labels = await state.backend.client.classify(texts, model=model.name, top_k=max(model.dimensions, 1))
    state.metrics.texts.labels(request.url.path).inc(len(texts))
    rows = [[{"label": lab.label, "score": lab.score} for lab in row] for row in labels]
    return answer(rows[0] if single else rows, model.name)


async def similarity(request: Request) -> Response:
    """The cosine of ``source_sentence`` with each of ``sentences``, from one embedding call."""
    state = request.app.state
    body = await read_json(request, state.config.max_body_bytes)
    source, sentences = _similarity_inputs(body.get("inputs"))
    texts = check_count([source, *sentences], state.config, "inputs")  # the source counts against the limit
    check_texts([source], state.config, "inputs.source_sentence")
    check_texts(sentences, state.config, "inputs.sentences")
    # only absent or null is none: 0, "", [] or false is refused, not read as {}
    parameters = {} if body.get("parameters") is None else body["parameters"]
    if not isinstance(parameters, dict):
        raise GatewayError("invalid", "parameters must be an object", param="parameters")
    check_direction(parameters)
    model = await _model(request, body, "embedding")  # one that does not embed: TEI's 424
    prompt_name = check_prompt(parameters.get("prompt_name"), model)
    names = ["inputs.source_sentence", *(f"inputs.sentences[{i}]" for i in range(len(sentences)))]
    await check_truncate(state.backend, parameters, model, texts, "inputs", prompt_name, names)
    vectors = unit_rows(await state.backend.embed(model, texts, prompt_name))
    state.metrics.texts.labels(request.url.path).inc(len(texts))
    return answer((vectors[1:] @ vectors[0]).astype(np.float32), model.name)


def _similarity_inputs(value) -> tuple[str, list[str]]:
    if not isinstance(value, dict) or not isinstance(value.get("source_sentence"), str):
        raise GatewayError("invalid", "inputs is required: {\"source_sentence\": \"...\", \"sentences\": [...]}",
                           param="inputs")
    sentences = text_list(value.get("sentences"), "inputs.sentences", "a list of strings")
    if not isinstance(value["sentences"], list):
        raise GatewayError("invalid", "inputs.sentences must be a list of strings", param="inputs")
    if not sentences:
        raise GatewayError("empty", "inputs.sentences is empty: send at least one sentence", param="inputs")
    return value["source_sentence"], sentences


async def info(request: Request) -> JSONResponse:
    model = await model_of_any_task(request, request.query_params.get("model"))
    return JSONResponse(tei_info.info(model, request.app.state.config))


# TEI answers ``POST /`` too (for an embedding model: embed); huggingface_hub's InferenceClient posts there
ROUTES = [Route("/", embed, methods=["POST"]), Route("/embed", embed, methods=["POST"]),
          Route("/embed_sparse", embed_sparse, methods=["POST"]), Route("/embed_all", embed_all, methods=["POST"]),
          Route("/embed_multi_vector", embed_multi_vector, methods=["POST"]),
          Route("/rerank", rerank, methods=["POST"]), Route("/predict", predict, methods=["POST"]),
          Route("/similarity", similarity, methods=["POST"]), Route("/info", info, methods=["GET"]),
          *tei_tokens.ROUTES]
