"""What goes over the wire for each task, shared by the sync and async clients.

A call is sent as a list of requests (chunks no larger than the server's
``max_batch_size``), each a list of (input name, numpy array); the task's spec
(:mod:`nexus_sli.tasks`) turns the responses' arrays into typed results.
"""

from __future__ import annotations

import http.client
import re

import numpy as np

from . import error_codes
from .errors import (
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
    """(items, was_single): a single string and a list both work; items must be str."""
    single = isinstance(texts, str)
    items = [texts] if single else list(texts)
    for index, item in enumerate(items):
        check_text(item, f"{what}[{index}]")
    return items, single


def strings(items: list[str]) -> np.ndarray:
    return np.array([item.encode("utf-8") for item in items], dtype=object)


def chunks(items: list[str], size: int) -> list[list[str]]:
    size = max(size, 1)
    return [items[i:i + size] for i in range(0, len(items), size)]


#: Our own errors, by the code the server-side models put in front of them.
_BY_CODE = {error_codes.INVALID_INPUT: InvalidInputError, error_codes.INFERENCE_FAILED: InferenceError}
#: Triton's own errors, by the transport's status: gRPC status name or HTTP status code.
_BY_STATUS = {"StatusCode.NOT_FOUND": ModelNotFoundError, "404": ModelNotFoundError,
              "StatusCode.INVALID_ARGUMENT": InvalidInputError, "400": InvalidInputError,
              "StatusCode.UNAVAILABLE": ServerUnavailableError,
              # the client's deadline passed: a server that hangs is treated as one that is down (retryable)
              "StatusCode.DEADLINE_EXCEEDED": ServerUnavailableError}
#: A python-backend worker that died (and is being restarted), or a model being loaded
#: again, is reported by Triton with an INTERNAL status and only these words; they are
#: Triton's, not ours, so they cannot carry a code.
_TRITON_MODEL_RESTARTING = re.compile(
    r"Stub process .* is not healthy|stub process has exited|has no available versions", re.IGNORECASE)


#: A model's queue policy refusing a request: its queue full, or the request's time in it past the
#: policy's timeout.  Triton's words with an UNAVAILABLE status, which alone would read as a server down.
_TRITON_QUEUE_REFUSED = re.compile(r"Exceeds maximum queue size|Request timeout expired", re.IGNORECASE)


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
    """Whether ``exc`` is the client's own deadline passing: the server may still hold the request
    (queued, or running), so sending it again would add a second copy to an overloaded server."""
    return isinstance(exc, TimeoutError) or _status(exc) == "StatusCode.DEADLINE_EXCEEDED"


def translate(exc: Exception, model: str) -> Exception:
    """A tritonclient / transport exception as one of ours."""
    text = str(exc)
    code = error_codes.code_of(text)
    if code is not None:
        return _BY_CODE[code](text)
    if _TRITON_MODEL_RESTARTING.search(text):
        return ModelUnavailableError(f"model {model!r} cannot serve right now (a worker is being restarted or the "
                                     f"model reloaded); retry in a few seconds. Server said: {text}")
    if _TRITON_QUEUE_REFUSED.search(text):
        return ServerBusyError(f"model {model!r} is overloaded: the server's queue refused the request or dropped "
                               f"it unrun; retry after a pause. Server said: {text}")
    status = _status(exc)
    # OSError: refused or reset; HTTPException: the HTTP connection closed mid-response (a server
    # that died while answering: geventhttpclient's HTTPConnectionClosed), both retryable
    transport = isinstance(exc, (OSError, http.client.HTTPException))
    kind = ServerUnavailableError if transport else _BY_STATUS.get(str(status), InferenceError)
    if timed_out(exc):
        said = text.splitlines()[0] if text else type(exc).__name__
        return ServerUnavailableError(f"Triton server did not answer within the client's timeout ({said}); "
                                      "check that it is not stuck or overloaded, then retry")
    if kind is ServerUnavailableError:
        return kind(f"Triton server unreachable ({text.splitlines()[0] if text else type(exc).__name__}); "
                    "check that it runs and the URL is right, then retry")
    if kind is ModelNotFoundError:
        return kind(f"model {model!r} is not served or not ready: {text}")
    return kind(text)


def not_ready(model: str) -> ModelUnavailableError:
    """A model the server knows (its config answers) that is not ready: loading, or loading again."""
    return ModelUnavailableError(f"model {model!r} is not ready yet (loading, or being reloaded); "
                                 "retry in a few seconds")
