"""Each client method as a plan: the requests to send and how to read the answers.

The sync and async clients differ only in how they send a plan's requests, so
everything else (input checks, chunking, result types) lives here once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from . import protocol as p
from .errors import InvalidInputError

Request = dict[str, np.ndarray]


@dataclass
class Plan:
    task: str
    requests: list[Request]
    output: str
    finish: Callable[[list[np.ndarray]], Any]


def _texts_plan(task: str, texts, info: p.ModelInfo, finish) -> Plan:
    items, single = p.as_list(texts)
    requests = [{"TEXT": p.strings(chunk).reshape(-1, 1)} for chunk in p.chunks(items, info.max_batch_size)]
    return Plan(task, requests, p.OUTPUTS[task], lambda outs: finish(outs, single))


def embed(texts, info: p.ModelInfo) -> Plan:
    def finish(outs, single):
        vectors = np.concatenate(outs) if outs else np.zeros((0, 0), np.float32)
        return vectors[0] if single else vectors
    return _texts_plan("embedding", texts, info, finish)


def classify(texts, info: p.ModelInfo, top_k: int = 1) -> Plan:
    def finish(outs, single):
        found = [row for out in outs for row in p.labels(out, info, top_k)]
        return found[0] if single else found
    return _texts_plan("classification", texts, info, finish)


def ner(texts, info: p.ModelInfo) -> Plan:
    def finish(outs, single):
        found = [row for out in outs for row in p.entity_lists(out)]
        return found[0] if single else found
    return _texts_plan("token-classification", texts, info, finish)


def answer(question: str, context: str, info: p.ModelInfo, top_k: int = 1) -> Plan:
    for name, value in (("question", question), ("context", context)):
        p.check_text(value, name)
    if not context.strip():
        raise InvalidInputError("context is empty: there is nothing to find an answer in")
    request = {"QUESTION": p.strings([question]), "CONTEXT": p.strings([context])}
    return Plan("question-answering", [request], "ANSWERS", lambda outs: p.answers(outs[0], top_k))


def rerank(query: str, documents, info: p.ModelInfo, top_k: int | None = None, chunk: int = 64) -> Plan:
    p.check_text(query, "query")
    items, _ = p.as_list(documents, "documents")
    requests = [{"QUERY": p.strings([query]), "DOCUMENTS": p.strings(c)} for c in p.chunks(items, chunk)]

    def finish(outs):
        scores = np.concatenate(outs) if outs else np.zeros((0,), np.float32)
        return p.ranking(scores, items, top_k)
    return Plan("rerank", requests, "SCORES", finish)
