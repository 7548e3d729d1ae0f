"""What goes over the wire for each task, shared by the sync and async clients.

A call is sent as a list of requests (chunks no larger than the server's
``max_batch_size``), each a list of (input name, numpy array); the task's spec
(:mod:`nexus_sli.tasks`) turns the responses' arrays into typed results.
"""

from __future__ import annotations

import asyncio
import http.client
import re
import sys
import time
from collections.abc import Mapping

import numpy as np

from . import error_codes
from .errors import (
    DeadlineExceededError,
    InferenceError,
    InvalidInputError,
    ModelNotFoundError,
    ModelUnavailableError,
    NoModelError,
    ServerBusyError,
    ServerUnavailableError,
)


def model_name(given: str | None, default: str | None) -> str:
    """The model a call names, else the client's default; :class:`NoModelError` when neither."""
    name = given or default
    if not name:
        raise NoModelError("no model named: pass model=... to the call, or to the client "
                           "(EncoderClient(url, model=...)) as its default")
    return name


def check_text(value, what: str) -> str:
    """``value`` if it is a str that UTF-8 can carry (no lone surrogates), else InvalidInputError."""
    if not isinstance(value, str):
        raise InvalidInputError(f"{what} is {type(value).__name__}, expected str")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInputError(f"{what} cannot be sent as UTF-8 ({exc.reason} at character {exc.start})") from None
    return value


def as_list(texts, what: str = "texts") -> tuple[list[str], bool]:
    """(items, was_single): a single string and a list (any iterable) both work; items must be str.  Anything
    else is an InvalidInputError: bytes would be read as a list of ints, a dict as its keys."""
    single = isinstance(texts, str)
    if isinstance(texts, (bytes, bytearray, memoryview)):
        raise InvalidInputError(f"{what} is {type(texts).__name__}, expected a str or a list of str "
                                "(decode bytes first)")
    if not single and (isinstance(texts, Mapping) or not _iterable(texts)):
        raise InvalidInputError(f"{what} is {type(texts).__name__}, expected a str or a list of str")
    items = [texts] if single else list(texts)
    for index, item in enumerate(items):
        check_text(item, f"{what}[{index}]")
    return items, single


def _iterable(value) -> bool:
    try:
        iter(value)
    except TypeError:
        return False
    return True


def strings(items: list[str]) -> np.ndarray:
    return np.array([item.encode("utf-8") for item in items], dtype=object)


def chunks(items: list[str], size: int) -> list[list[str]]:
    size = max(size, 1)
    return [items[i:i + size] for i in range(0, len(items), size)]


#: The tokenizer step's words for one item of a request (a text over the model's length, truncation off):
#: its index within that request.
_ITEM_OF_REQUEST = re.compile(r"\btext (\d+)(?= has )")


def in_callers_list(message: str, what: str, start: int, stop: int) -> str:
    """A server's ``message`` about a request that carried ``what[start:stop]`` of the caller's list, naming the
    caller's index: rewritten where it has the step's known words (``text 6 has`` in the request of
    ``texts[64:128]``: ``texts[70] has``), else with that part of the list added."""
    rewritten, found = _ITEM_OF_REQUEST.subn(lambda m: f"{what}[{start + int(m.group(1))}]", message, count=1)
    return rewritten if found else f"{message} (in {what}[{start}:{stop}])"


#: Our own errors, by the code the server-side models put in front of them.
_BY_CODE = {error_codes.INVALID_INPUT: InvalidInputError, error_codes.INFERENCE_FAILED: InferenceError}
#: Triton's own errors, by the transport's status: gRPC status name or HTTP status code.  Triton answers
#: UNAVAILABLE (a model version not at ready state while it reloads, a server shutting down) as HTTP 503.
#: 502 comes from a proxy in front of Triton (an ingress, a load balancer) that could not reach it or lost
#: the connection mid-answer, as a refused or reset connection does here; its 504 is :data:`_PROXY_TIMEOUT`.
_BY_STATUS = {"StatusCode.NOT_FOUND": ModelNotFoundError, "404": ModelNotFoundError,
              "StatusCode.INVALID_ARGUMENT": InvalidInputError, "400": InvalidInputError,
              "StatusCode.UNAVAILABLE": ServerUnavailableError, "503": ServerUnavailableError,
              "502": ServerUnavailableError}
#: A proxy in front of Triton that stopped waiting for its answer: Triton may still hold the request, so it
#: is a passed deadline, not sent again (:func:`~nexus_sli.client.replicas.retryable`).
_PROXY_TIMEOUT = "504"
#: A python-backend worker that died (and is being restarted), or a model being loaded
#: again, is reported by Triton with an INTERNAL status and only these words; they are
#: Triton's, not ours, so they cannot carry a code.
_TRITON_MODEL_RESTARTING = re.compile(
    r"Stub process .* is not healthy|stub process has exited|has no available versions", re.IGNORECASE)


#: A model's queue policy refusing a request: its queue full, or the request's time in it past the
#: policy's timeout.  Triton's words with an UNAVAILABLE status, which alone would read as a server down.
_TRITON_QUEUE_REFUSED = re.compile(r"Exceeds maximum queue size|Request timeout expired", re.IGNORECASE)
#: The second of those: the request's timeout in the queue passed.  Its words do not say whose timeout,
#: the policy's own or the shorter one the client sent (:func:`queue_timeout`); the call's clock does.
_TRITON_QUEUE_TIMED_OUT = re.compile(r"Request timeout expired", re.IGNORECASE)


def answered_version(result) -> str | None:
    """The model version that answered (tritonclient's result, HTTP's JSON header or gRPC's message): a new
    one means the model was swapped for a new export (``nexus-sli serve``'s search), whose description may
    differ (its precision, backend)."""
    response = result.get_response()
    version = response.get("model_version") if isinstance(response, dict) else getattr(response, "model_version", None)
    return str(version) if version else None


def newest_version(metadata: dict) -> str | None:
    """The newest of the versions a model's metadata (JSON) lists: the one its description was read at."""
    versions = [int(v) for v in metadata.get("versions", []) if str(v).isdigit()]
    return str(max(versions)) if versions else None


def note_version(versions: dict[str, str], info: dict, model: str, result) -> None:
    """Forget ``model``'s cached description (``info``) where ``result`` comes from another version than the
    last answer did (``versions``: the last version each model answered with)."""
    version = answered_version(result)
    if version is not None and versions.setdefault(model, version) != version:
        versions[model] = version
        info.pop(model, None)


def queue_timeout(timeout_s: float | None) -> dict:
    """The call's deadline as Triton's per-request ``timeout`` (microseconds), for ``infer``.  A batching
    step whose queue policy lets a request shorten its timeout drops the request unrun once it has
    waited that long in the step's queue (an ensemble passes it to its steps); other models ignore it.
    Without it, work the caller stopped waiting for is still computed: a cancelled gRPC call is not
    taken out of a step's queue."""
    return {"timeout": int(timeout_s * 1_000_000)} if timeout_s else {}


def _status(exc: Exception) -> str | None:
    return str(exc.status()) if callable(getattr(exc, "status", None)) else None


def timed_out(exc: Exception) -> bool:
    """Whether ``exc`` is the transport's deadline passing (gRPC's ``DEADLINE_EXCEEDED``, a socket's or
    aiohttp's timeout): the server may still hold the request (queued, or running)."""
    # asyncio's TimeoutError is the builtin from Python 3.11, a class of its own before
    return isinstance(exc, (TimeoutError, asyncio.TimeoutError)) or _status(exc) == "StatusCode.DEADLINE_EXCEEDED"


def past_deadline(started: float, timeout_s: float | None) -> bool:
    """Whether a request sent at ``started`` (``time.monotonic()``) has outlived the deadline ``timeout_s``
    it carried.  A step drops it at that deadline counted from when it entered the step's queue, which is
    after it was sent: a drop the client's deadline caused always comes this late, one by a queue
    policy's shorter timeout sooner."""
    return timeout_s is not None and time.monotonic() - started >= timeout_s


def translate(exc: Exception, model: str, deadline_passed: bool = False) -> Exception:
    """A tritonclient / transport exception as one of ours.  ``deadline_passed``: the call's own deadline
    had passed when it failed (:func:`past_deadline`), so a step's queue that dropped it for its time
    there dropped it at that deadline, a :class:`DeadlineExceededError`, not an overloaded server's
    :class:`ServerBusyError`."""
    text = str(exc)
    code = error_codes.code_of(text)
    if code is not None:
        return _BY_CODE[code](text)
    if _TRITON_MODEL_RESTARTING.search(text):
        return ModelUnavailableError(f"model {model!r} cannot serve right now (a worker is being restarted or the "
                                     f"model reloaded); retry in a few seconds. Server said: {text}")
    if _status(exc) == _PROXY_TIMEOUT:
        return DeadlineExceededError(f"a proxy in front of the Triton server stopped waiting for its answer (HTTP "
                                     f"504: {text.splitlines()[0] if text else 'no message'}); the server may be "
                                     "overloaded: retry later, or with fewer calls at once")
    if timed_out(exc) or (deadline_passed and _TRITON_QUEUE_TIMED_OUT.search(text)):
        said = text.splitlines()[0] if text else type(exc).__name__
        return DeadlineExceededError(f"Triton server did not answer within the client's timeout ({said}); it may "
                                     "be overloaded or stuck: retry later, with a longer timeout_s or fewer calls "
                                     "at once")
    if _TRITON_QUEUE_REFUSED.search(text):
        return ServerBusyError(f"model {model!r} is overloaded: the server's queue refused the request or dropped "
                               f"it unrun; retry after a pause. Server said: {text}")
    status = _status(exc)
    kind = ServerUnavailableError if _transport(exc) else _BY_STATUS.get(str(status), InferenceError)
    if kind is ServerUnavailableError:
        return kind(f"Triton server unreachable ({text.splitlines()[0] if text else type(exc).__name__}); "
                    "check that it runs and the URL is right, then retry")
    if kind is ModelNotFoundError:
        return kind(f"model {model!r} is not served or not ready: {text}")
    return kind(text)


def _transport(exc: Exception) -> bool:
    """Whether ``exc`` is the connection failing, not the server answering: retryable.  OSError: refused or
    reset.  HTTPException: the synchronous HTTP client's connection closed mid-response (a server that died
    while answering: geventhttpclient's HTTPConnectionClosed).  The asyncio HTTP client's aiohttp says the
    same with errors that are no OSError: ServerDisconnectedError (closed before answering), and
    ClientPayloadError (closed mid-body)."""
    if isinstance(exc, (OSError, http.client.HTTPException)):
        return True
    aiohttp = sys.modules.get("aiohttp")  # not imported: the error cannot be one of its own
    return aiohttp is not None and isinstance(exc, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError))


def not_ready(model: str) -> ModelUnavailableError:
    """A model the server knows (its config answers) that is not ready: loading, or loading again."""
    return ModelUnavailableError(f"model {model!r} is not ready yet (loading, or being reloaded); "
                                 "retry in a few seconds")
