"""Each client method as a plan: the requests to send and how to read the answers.

The sync and async clients differ only in how they send a plan's requests, so
everything else (input checks, chunking, result types) lives here once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from nexus_sli.tasks import get_task

from . import protocol as p
from .errors import InvalidInputError

Request = dict[str, np.ndarray]


@dataclass
class Plan:
    task: str
    requests: list[Request]
    output: str
    finish: Callable[[list[np.ndarray]], Any]


def _texts_plan(task: str, texts, info: p.ModelInfo, parse) -> Plan:
    """One request per chunk of texts; ``parse`` reads every chunk's outputs at once."""
    items, single = p.as_list(texts)
    requests = [{"TEXT": p.strings(chunk).reshape(-1, 1)} for chunk in p.chunks(items, info.max_batch_size)]

    def finish(outs):
        found = parse(outs)
        return found[0] if single else found
    return Plan(task, requests, get_task(task).client_output, finish)


def embed(texts, info: p.ModelInfo) -> Plan:
    return _texts_plan("embedding", texts, info, get_task("embedding").parse)


def classify(texts, info: p.ModelInfo, top_k: int = 1) -> Plan:
    spec = get_task("classification")
    return _texts_plan(spec.name, texts, info, lambda outs: spec.parse(outs, info.id2label, top_k))


def ner(texts, info: p.ModelInfo) -> Plan:
    return _texts_plan("token-classification", texts, info, get_task("token-classification").parse)


def answer(question: str, context: str, info: p.ModelInfo, top_k: int = 1) -> Plan:
    for name, value in (("question", question), ("context", context)):
        p.check_text(value, name)
    if not context.strip():
        raise InvalidInputError("context is empty: there is nothing to find an answer in")
    spec = get_task("question-answering")
    request = {"QUESTION": p.strings([question]), "CONTEXT": p.strings([context])}
    return Plan(spec.name, [request], spec.client_output, lambda outs: spec.parse(outs, top_k))


def rerank(query: str, documents, info: p.ModelInfo, top_k: int | None = None, chunk: int = 64) -> Plan:
    p.check_text(query, "query")
    items, _ = p.as_list(documents, "documents")
    spec = get_task("rerank")
    requests = [{"QUERY": p.strings([query]), "DOCUMENTS": p.strings(c)} for c in p.chunks(items, chunk)]
    return Plan(spec.name, requests, spec.client_output, lambda outs: spec.parse(outs, items, top_k))
