"""What goes over the wire for each task, shared by the sync and async clients.

A call is planned as a list of requests (chunks no larger than the server's
``max_batch_size``), each a list of (input name, numpy array); the responses'
arrays are then turned into typed results.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np

from .errors import (
    InferenceError,
    InvalidInputError,
    ModelNotFoundError,
    ModelUnavailableError,
    ServerUnavailableError,
    WrongTaskError,
)

@dataclass(frozen=True)
class ModelInfo:
    name: str
    task: str
    max_batch_size: int
    params: dict

    @classmethod
    def from_config(cls, name: str, config: dict) -> "ModelInfo":
        params = {k: v.get("string_value", v.get("stringValue", "")) for k, v in config.get("parameters", {}).items()}
        return cls(name, params.get("task", ""), int(config.get("max_batch_size", 0)), params)

    def expect(self, task: str) -> None:
        if self.task != task:
            raise WrongTaskError(f"model {self.name!r} serves task {self.task or 'unknown'!r}, not {task!r}")

    @property
    def id2label(self) -> dict[int, str]:
        return {int(k): v for k, v in json.loads(self.params.get("id2label", "{}")).items()}


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


#: Triton's words for a model whose worker process died (and is being restarted),
#: or that is being loaded again: the model exists, the request may be retried.
_MODEL_RESTARTING = re.compile(r"Stub process .* is not healthy|stub process has exited|has no available versions",
                               re.IGNORECASE)


def translate(exc: Exception, model: str) -> Exception:
    """A tritonclient / transport exception as one of ours."""
    text = str(exc)
    if _MODEL_RESTARTING.search(text):
        return ModelUnavailableError(f"model {model!r} cannot serve right now (a worker is being restarted or the "
                                     f"model reloaded); retry in a few seconds. Server said: {text}")
    if isinstance(exc, OSError) or re.search(r"UNAVAILABLE|Connection refused|Failed to connect|connect error",
                                             text, re.IGNORECASE):
        return ServerUnavailableError(f"Triton server unreachable ({text.splitlines()[0] if text else type(exc).__name__}); "
                                      "check that it runs and the URL is right, then retry")
    if re.search(r"unknown model|not found|is not ready|unavailable model", text, re.IGNORECASE):
        return ModelNotFoundError(f"model {model!r} is not served or not ready: {text}")
    if re.search(r"UTF-8|tokens; the model takes|is empty|is missing|exactly one|is too long|takes at most|"
                 r"could not be tokenized|unexpected shape|data-type is|batch-size must be", text):
        return InvalidInputError(text)
    return InferenceError(text)


def not_ready(model: str) -> ModelUnavailableError:
    """A model the server knows (its config answers) that is not ready: loading, or loading again."""
    return ModelUnavailableError(f"model {model!r} is not ready yet (loading, or being reloaded); "
                                 "retry in a few seconds")
