"""TEI's routes of the served tokenizer: ``POST /tokenize`` and ``POST /decode``.

Both ask the model's tokenizer step (``NAME_tokenizer``) for its text modes, so
the tokens are the ones the model reads: its tokenizer.json, its prompts.  They
belong to no task, so the model is the one the request names, else the
gateway's ``tei_model``, else the only one served.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from nexus_sli.client.model_info import ModelInfo

from .answers import answer
from .embeddings import check_prompt
from .errors import GatewayError
from .limits import check_count, check_texts, check_tokens_answered, flag, read_json, text_list


async def model_of_any_task(request: Request, name) -> ModelInfo:
    """The model of a route every task has: the one named, else the gateway's ``tei_model``, else the only one."""
    if name is not None and not isinstance(name, str):
        raise GatewayError("invalid", "model must be a string", param="model")
    catalog = request.app.state.backend.catalog
    if name:
        return await catalog.get(name, None)
    pinned = request.app.state.config.tei_model
    return await catalog.only() if pinned is None else await catalog.pinned(pinned, None)


def _check_text_mode(model: ModelInfo, route: str) -> None:
    """424 where the model's tokenizer step lacks the text mode ``route`` needs (``TokenizerStep``)."""
    step = model.tokenizer_step
    if step is None or not (step.decodes if route == "/decode" else step.tokenizes):
        raise GatewayError("unsupported", f"the tokenizer of model {model.name!r} (task {model.task!r}) does not "
                           f"answer {route}: the tokenizers of single-text tasks do, in repositories exported since "
                           "they gained it; export the model again", param="model", code="tokenizer_mode_missing")


async def tokenize(request: Request) -> Response:
    """Each text's tokens as TEI's SimpleToken, from the served tokenizer (prompted as /embed, untruncated)."""
    state = request.app.state
    body = await read_json(request, state.config.max_body_bytes)
    if "inputs" not in body:
        raise GatewayError("invalid", "inputs is required: a string or a list of strings", param="inputs")
    texts = check_texts(text_list(body["inputs"], "inputs"), state.config, "inputs")
    add_special_tokens = flag(body, "add_special_tokens", True)
    model = await model_of_any_task(request, body.get("model"))
    prompt_name = check_prompt(body.get("prompt_name"), model)
    _check_text_mode(model, "/tokenize")
    found = await state.backend.tokenize(model, texts, prompt_name, add_special_tokens)
    state.metrics.texts.labels(request.url.path).inc(len(texts))
    # counted as the step answered them (not truncated): each token becomes a dict of five fields on the event loop
    check_tokens_answered(sum(len(tokens["ids"]) for tokens in found), state.config, "/tokenize")
    # no value of it can be NaN (ids and offsets are integers): nothing for answer() to walk
    return answer([_simple_tokens(tokens) for tokens in found], model.name, values=())


def _simple_tokens(tokens: dict) -> list[dict]:
    """One text's tokens as TEI's SimpleToken: ``start``/``stop`` are UTF-8 byte offsets into the prompted text,
    as TEI's Rust tokenizer counts them (the step's ``bytes``); a special token covers none of the text.
    Repositories exported before ``bytes`` answer character offsets (``offsets``) instead."""
    spans = tokens.get("bytes", tokens["offsets"])
    return [{"id": i, "text": text, "special": special, "start": None if special else start,
             "stop": None if special else stop}
            for i, text, special, (start, stop) in zip(tokens["ids"], tokens["text"], tokens["special"], spans)]


async def decode(request: Request) -> Response:
    """The text of each list of token ids, from the served tokenizer."""
    state = request.app.state
    body = await read_json(request, state.config.max_body_bytes)
    rows = check_count(_id_rows(body.get("ids")), state.config, "ids", "list of token ids")
    skip_special_tokens = flag(body, "skip_special_tokens", True)
    model = await model_of_any_task(request, body.get("model"))
    _check_text_mode(model, "/decode")
    texts = await state.backend.decode(model, rows, skip_special_tokens)
    state.metrics.texts.labels(request.url.path).inc(len(rows))
    return answer(texts, model.name)


#: TEI's token ids are u32.
MAX_ID = 2**32 - 1


def _id_rows(value) -> list[list[int]]:
    """TEI's InputIds: one list of token ids, or a batch of them; none, or an empty list, is TEI's Empty."""
    def ids(row) -> bool:
        return isinstance(row, list) and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= MAX_ID
                                             for i in row)

    if ids(value) and value:
        return [value]
    if not (isinstance(value, list) and all(ids(row) for row in value)):
        raise GatewayError("invalid", f"ids is required: a list of token ids (integers from 0 to {MAX_ID}), or a "
                           "list of such lists", param="ids")
    for index, row in enumerate(value):  # no ids at all ([]) is check_count's Empty
        if not row:
            raise GatewayError("empty", f"ids[{index}] is empty: send at least one token id", param="ids")
    return value


ROUTES = [Route("/tokenize", tokenize, methods=["POST"]), Route("/decode", decode, methods=["POST"])]
