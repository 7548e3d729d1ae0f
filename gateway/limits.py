"""What one request may carry: a bounded JSON body, and bounded texts.

Every limit that refuses a request says its value in the message, so a caller
knows how to split the work.
"""

from __future__ import annotations

import json
import sys

from starlette.requests import Request

from nexus_sli.client import InvalidInputError
from nexus_sli.client.model_info import ModelInfo
from nexus_sli.client.protocol import check_text

from .config import GatewayConfig
from .errors import GatewayError


async def read_json(request: Request, max_bytes: int) -> dict:
    """The request's JSON object; 413 past ``max_bytes`` (read no further), 400 if it does not parse."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _body_too_large(max_bytes)
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > max_bytes:
            raise _body_too_large(max_bytes)
    try:
        value = json.loads(body)
    except RecursionError:  # nesting deeper than the parser's stack ("[[[[..."): no request needs it
        raise GatewayError("malformed", "the request body is not valid JSON here: it is nested too deeply") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GatewayError("malformed", f"the request body is not valid JSON: {exc}") from None
    except ValueError:  # an integer of more digits than Python converts (sys.get_int_max_str_digits, 4300)
        raise GatewayError("malformed", "the request body is not valid JSON here: a number in it has more than "
                           f"{sys.get_int_max_str_digits()} digits") from None
    if not isinstance(value, dict):
        raise GatewayError("invalid", f"the request body must be a JSON object, got {type(value).__name__}")
    return value


def _body_too_large(max_bytes: int) -> GatewayError:
    return GatewayError("too_large", f"the request body is larger than this gateway's limit of {max_bytes} bytes; "
                        "send fewer texts per request", code="body_too_large")


def check_token_vectors(texts: list, model: ModelInfo, config: GatewayConfig, route: str) -> None:
    """A 400/422 before any work where ``texts`` could make more vectors than ``config.max_token_vectors``, each
    counted at its model's longest (its tokenizer step's ``max_length``; none stated: not bounded here)."""
    longest = model.tokenizer_step.max_length if model.tokenizer_step else 0
    if not longest or len(texts) * longest <= config.max_token_vectors:
        return
    limit = f"--max-token-vectors {config.max_token_vectors}"
    most = config.max_token_vectors // longest
    advice = (f"a request takes at most {most} texts here ({limit}); got {len(texts)}: split them into several "
              "requests" if most else f"more than this gateway's {limit}: start it with a larger one to serve it")
    raise GatewayError("invalid", f"{route} answers up to {longest} vectors a text for model {model.name!r}, so "
                       + advice, param="inputs", code="too_many_inputs")


def check_tokens_answered(tokens: int, config: GatewayConfig, route: str) -> None:
    """The error of :func:`check_token_vectors` where an answer of ``tokens`` tokens, counted once the tokenizer
    made them (``/tokenize``: untruncated, so no model's length bounds them), is past ``config.max_token_vectors``."""
    if tokens > config.max_token_vectors:
        raise GatewayError("invalid", f"{route} would answer {tokens} tokens for these texts, more than this "
                           f"gateway's --max-token-vectors {config.max_token_vectors}: split them into several "
                           "requests", param="inputs", code="too_many_inputs")


def check_count(items: list, config: GatewayConfig, param: str, item: str = "item") -> list:
    """``items`` if there are some (else TEI's ``Empty``) and at most ``config.max_inputs``."""
    if not items:
        raise GatewayError("empty", f"{param} is empty: send at least one {item}", param=param)
    if len(items) > config.max_inputs:
        # OpenAI's 400 for too many inputs, TEI's batch-size Validation error (not the 413 of a large body)
        raise GatewayError("invalid", f"{param} has {len(items)} items; this gateway takes at most "
                           f"{config.max_inputs} per request: split them into several requests",
                           param=param, code="too_many_inputs")
    return items


def check_texts(texts: list[str], config: GatewayConfig, param: str, empty_ok: bool = False) -> list[str]:
    """``texts`` if they are within the gateway's limits (count, characters per text); a text UTF-8
    cannot carry (a lone surrogate such as ``"\\ud800"``, valid JSON) is refused too, and an empty one
    unless ``empty_ok`` (a side of a pair): OpenAI refuses it, and TEI with its ``Empty`` error."""
    check_count(texts, config, param, "text")
    for index, text in enumerate(texts):
        if not text and not empty_ok:
            raise GatewayError("empty", f"{param}[{index}] is empty: send some text, or leave it out (OpenAI and TEI "
                               "refuse an empty text too)", param=param)
        if len(text) > config.max_input_chars:
            raise GatewayError("invalid", f"{param}[{index}] has {len(text)} characters; this gateway takes at "
                               f"most {config.max_input_chars} per text", param=param, code="input_too_long")
        try:
            check_text(text, f"{param}[{index}]")
        except InvalidInputError as exc:
            raise GatewayError("invalid", str(exc), param=param, code="invalid_input") from None
    return texts


#: What a TEI route says of token ids: TEI takes them (its ``InputType::Ids``), this gateway does not.
TEI_IDS_ADVICE = "unlike TEI, it takes no token-id inputs: send the texts (POST /decode turns token ids into text)"


def text_list(value, param: str, what: str = "a string or a list of strings", *,
              ids_advice: str = TEI_IDS_ADVICE) -> list[str]:
    """A string or a list of strings as a list; token-id arrays (the message ends with ``ids_advice``) and
    anything else are refused."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return value
    if isinstance(value, list) and value and all(isinstance(i, int) or (isinstance(i, list) and all(
            isinstance(j, int) for j in i)) for i in value):
        raise GatewayError("invalid", f"{param} holds token ids: this gateway takes text only (the server "
                           f"tokenizes with the model's own tokenizer); {ids_advice}", param=param,
                           code="token_ids_not_supported")
    raise GatewayError("invalid", f"{param} must be {what}, got {_describe(value)}", param=param)


def _describe(value) -> str:
    if isinstance(value, list):
        kinds = sorted({type(item).__name__ for item in value})
        return f"a list of {', '.join(kinds) or 'nothing'}"
    return "null" if value is None else type(value).__name__


def flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise GatewayError("invalid", f"{name} must be true or false, got {_describe(value)}", param=name)
    return value
