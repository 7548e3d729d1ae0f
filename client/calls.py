"""Each client method as a call: the requests to send and how to read the answers.

The sync and async clients differ only in how they send a call's requests, so
everything else (input checks, chunking, result types) lives here once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from nexus_sli.tasks import bge_m3, get_task
from nexus_sli.tasks.multi_vector import DOCUMENT, QUERY
from nexus_sli.tasks.results import M3Embedding, SparseEmbedding
from nexus_sli.tasks.spec import TOKEN_MASK, TOKEN_TASK, check_top_k

from . import late_interaction
from . import protocol as p
from .error_codes import INPUT_TYPE_PARAMETER, PROMPT_PARAMETER, TOKEN_COUNT_OUTPUT
from .errors import InvalidInputError, WrongTaskError
from .model_info import ModelInfo

#: The least norm a vector is divided by (the served pooling's guard, python_models/encoding.py)
MIN_NORM = 1e-12

Request = dict[str, np.ndarray]


@dataclass
class Call:
    """What one client method sends, and how its answers become the method's result."""
    task: str
    requests: list[Request]
    #: the outputs asked for; ``finish`` gets each request's arrays (one output: the array itself)
    outputs: tuple[str, ...]
    finish: Callable[[list], Any]
    #: request parameters sent with every request (the prompt's name)
    parameters: dict = field(default_factory=dict)
    #: the model the requests go to, where not the one the call named (token embeddings: its ``_tokens`` ensemble)
    model: str | None = None
    #: each request's own parameters beside :attr:`parameters`, in :attr:`requests` order (None: none); a
    #: late-interaction rerank sends its query and its documents as two sides
    request_parameters: list[dict] | None = None
    #: each request's part of the caller's list, (its name, start, stop), in :attr:`requests` order (None: each
    #: request, or the only one, numbers its items as the caller's list does)
    places: list[tuple[str, int, int] | None] | None = None

    def parameters_of(self, index: int) -> dict:
        """The parameters request ``index`` is sent with."""
        return {**self.parameters, **(self.request_parameters[index] if self.request_parameters else {})}

    def located(self, index: int, error: Exception) -> Exception:
        """Request ``index``'s ``error``, an :class:`InvalidInputError` naming the place in the caller's list of the
        part that request carried: the server numbers the items of each request from 0."""
        place = self.places[index] if self.places else None
        if place is None or type(error) is not InvalidInputError:
            return error
        return InvalidInputError(p.in_callers_list(str(error), *place))

    def read(self, answers: list[tuple[np.ndarray, ...]]):
        """The call's result from every request's arrays, in :attr:`outputs` order."""
        return self.finish([a[0] for a in answers] if len(self.outputs) == 1 else answers)


def _texts_call(task: str, texts, info: ModelInfo, parse, parameters: dict | None = None,
                outputs: tuple[str, ...] | None = None, model: str | None = None) -> Call:
    """One request per chunk of texts; ``parse`` reads every chunk's outputs at once."""
    items, single = p.as_list(texts)
    parts = p.chunks(items, info.max_batch_size)
    requests = [{"TEXT": p.strings(chunk).reshape(-1, 1)} for chunk in parts]

    def finish(outs):
        found = parse(outs)
        return found[0] if single else found
    return Call(task, requests, outputs or (get_task(task).client_output,), finish, parameters or {}, model,
                places=_places("texts", parts))


def _places(what: str, parts: list[list]) -> list[tuple[str, int, int]] | None:
    """Each of a list's chunks as its place in that list, ``(what, start, stop)``; None for one chunk (its
    items are numbered as in the list)."""
    if len(parts) < 2:
        return None
    stops = np.cumsum([len(part) for part in parts]).tolist()
    return [(what, stop - len(part), stop) for part, stop in zip(parts, stops)]


def _prompt(prompt_name: str | None, info: ModelInfo) -> dict:
    """The request parameter naming a prompt, checked against the model's prompts before anything is sent."""
    return {} if info.check_prompt(prompt_name) is None else {PROMPT_PARAMETER: prompt_name}


def unit_rows(vectors: np.ndarray) -> np.ndarray:
    """Each vector over its L2 norm (never over less than :data:`MIN_NORM`)."""
    return vectors / np.maximum(np.linalg.norm(vectors, axis=-1, keepdims=True), MIN_NORM)


def embed(texts, info: ModelInfo, prompt_name: str | None = None, dimensions: int | None = None) -> Call:
    """``dimensions`` (Matryoshka): each vector cut to that size, then L2-normalised again (a unit vector,
    as OpenAI's shortened embeddings are).  The served vector is the model's pipeline up to and including
    its normalisation, and normalising is scale-free, so this equals cutting the model's unnormalised
    output and normalising that.  ``dimensions`` is checked before anything is sent where the model's config
    states its size."""
    info.expect("embedding")  # first: a model of another task would refuse a size or prompt for it
    parse = get_task("embedding").parse
    if info.dimensions:
        info.check_dimensions(dimensions)

    def read(outs):
        vectors = parse(outs, info.dimensions)  # no text: no answer, and [0, the model's size]
        return vectors if dimensions is None else unit_rows(info.cut(vectors, dimensions))
    return _texts_call("embedding", texts, info, read, _prompt(prompt_name, info))


def embed_counted(texts, info: ModelInfo, prompt_name: str | None = None) -> Call:
    """(embeddings ``[n, dims]``, the tokens the model read) from the same requests: the model's
    ``TOKEN_COUNT`` output, each text's tokens as the encoder reads them (special tokens and the prompt
    included, after truncation), summed, as OpenAI's ``usage`` counts them."""
    if not info.counts_tokens:
        raise WrongTaskError(f"model {info.name!r} answers no token counts: it is not an embedding model, or it "
                             "was exported before they were served (export it again)")
    spec = get_task("embedding")

    def read(answers) -> tuple[np.ndarray, int]:
        vectors = spec.parse([vectors for vectors, _ in answers], info.dimensions)
        return vectors, int(sum(counts.sum() for _, counts in answers))
    items, _ = p.as_list(texts)  # a single string too: the result is always the pair
    outputs = (spec.client_output, TOKEN_COUNT_OUTPUT)
    return _texts_call(spec.name, items, info, read, _prompt(prompt_name, info), outputs)


def sparsify(rows: np.ndarray, top_k: int | None, threshold: float) -> list[SparseEmbedding]:
    """Each dense ``[vocab]`` row as its terms over ``threshold`` (the ``top_k`` largest of them where
    given, as sentence-transformers' ``max_active_dims``), ids ascending."""
    return [selected(np.arange(len(row)), row, top_k, threshold) for row in rows]


def selected(ids: np.ndarray, weights: np.ndarray, top_k: int | None, threshold: float) -> SparseEmbedding:
    """The terms ``ids`` (ascending) whose weights are over ``threshold``, the ``top_k`` largest of them where
    given (ties: the lower id first)."""
    active = np.flatnonzero(weights > threshold)
    if top_k is not None and len(active) > top_k:
        active = np.sort(active[np.argsort(-weights[active], kind="stable")[:top_k]])
    return SparseEmbedding(ids[active].astype(np.int64), weights[active].astype(np.float32))


def embed_sparse(texts, info: ModelInfo, prompt_name: str | None = None, top_k: int | None = None,
                 threshold: float = 0.0) -> Call:
    """A SPLADE model's ``[vocab]`` rows, or a BGE-M3 model's lexical weights, as each text's terms."""
    _check_top_k(top_k, "every active term")
    info.expect("sparse-embedding")  # first: a model of another task would refuse a prompt for it
    if info.task == bge_m3.SPEC.name:
        return _texts_call("sparse-embedding", texts, info, lambda answers: [
            selected(*terms, top_k, threshold) for terms in _lexical(answers)], _prompt(prompt_name, info), M3_SPARSE)
    parse = get_task("sparse-embedding").parse
    return _texts_call("sparse-embedding", texts, info, lambda outs: sparsify(parse(outs), top_k, threshold),
                       _prompt(prompt_name, info))


#: a BGE-M3 model's outputs for each of its three results (``tasks/bge_m3.py``)
M3_DENSE, M3_SPARSE, M3_VECTORS = ("EMBEDDING",), ("SPARSE_WEIGHTS", "TOKEN_IDS"), ("MULTI_VECTOR", "SCORE_MASK")


def _lexical(answers) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each text's (ids, weights) from every request's (``SPARSE_WEIGHTS``, ``TOKEN_IDS``): per id the largest
    of its tokens' weights (:func:`tasks.bge_m3.lexical`)."""
    return [bge_m3.lexical(row, ids) for weights, token_ids in answers for row, ids in zip(weights, token_ids)]


def embed_m3(texts, info: ModelInfo, dense: bool = True, sparse: bool = True, multi_vector: bool = True) -> Call:
    """Each text's BGE-M3 outputs (:class:`M3Embedding`) from one set of requests: the encoder runs once per
    text, whichever outputs are asked for; those not asked for are None."""
    wanted = [(dense, M3_DENSE), (sparse, M3_SPARSE), (multi_vector, M3_VECTORS)]
    if not any(asked for asked, _ in wanted):
        raise InvalidInputError("embed_m3 asks for nothing: set dense, sparse or multi_vector")
    outputs = tuple(name for asked, names in wanted if asked for name in names)

    def parse(answers) -> list[M3Embedding]:
        got = [dict(zip(outputs, answer if len(outputs) > 1 else (answer,))) for answer in answers]
        found = [
            list(get_task("embedding").parse([g["EMBEDDING"] for g in got])) if dense else None,
            [SparseEmbedding(*terms) for terms in _lexical([(g["SPARSE_WEIGHTS"], g["TOKEN_IDS"]) for g in got])]
            if sparse else None,
            get_task("multi-vector").parse([(g["MULTI_VECTOR"], g["SCORE_MASK"]) for g in got])
            if multi_vector else None,
        ]
        count = sum(len(g[outputs[0]]) for g in got)
        return [M3Embedding(*(rows[i] if rows is not None else None for rows in found)) for i in range(count)]
    return _texts_call(bge_m3.SPEC.name, texts, info, parse, outputs=outputs)


def embed_tokens(texts, info: ModelInfo, prompt_name: str | None = None) -> Call:
    """Each text's token vectors ``[tokens, hidden]`` (special tokens included), from the embedding
    model's ``NAME_tokens`` ensemble (its ``token_model`` parameter)."""
    tokens_model = info.token_model
    if not tokens_model:
        raise WrongTaskError(f"model {info.name!r} serves no token embeddings: it is not an embedding model, or "
                             "it was exported before they were served (export it again)")
    states, mask = get_task("embedding").token_states.name, TOKEN_MASK.name

    def parse(answers) -> list[np.ndarray]:
        # row i's real tokens are the first mask[i].sum() states (the tokenizer pads on the right)
        return [vectors[:int(row_mask.sum())] for got, row_mask_batch in answers
                for vectors, row_mask in zip(got, row_mask_batch)]
    return _texts_call(TOKEN_TASK, texts, info, parse, _prompt(prompt_name, info), (states, mask), tokens_model)


def embed_multi_vector(texts, info: ModelInfo, input_type: str = DOCUMENT, prompt_name: str | None = None) -> Call:
    """Each text's vectors ``[n_i, dim]``, one per token the model scores on that side (``input_type``:
    ``query`` or ``document``: its marker, length, query expansion and skiplist)."""
    spec = get_task("multi-vector")
    info.expect(spec.name)  # first: a model of another task would refuse a side or prompt for it
    parameters = {INPUT_TYPE_PARAMETER: info.check_input_type(input_type), **_prompt(prompt_name, info)}
    return _texts_call(spec.name, texts, info, spec.parse, parameters, _names(spec.results))


def _check_top_k(top_k, every: str) -> None:
    """``top_k`` refused before anything is sent (:func:`tasks.spec.check_top_k`)."""
    try:
        check_top_k(top_k, every)
    except ValueError as exc:
        raise InvalidInputError(str(exc)) from None


def classify(texts, info: ModelInfo, top_k: int = 1) -> Call:
    _check_top_k(top_k, "every label")
    spec = get_task("classification")
    return _texts_call(spec.name, texts, info, lambda outs: spec.parse(outs, info.id2label, top_k))


def ner(texts, info: ModelInfo) -> Call:
    return _texts_call("token-classification", texts, info, get_task("token-classification").parse)


def answer(question: str, context: str, info: ModelInfo, top_k: int = 1) -> Call:
    for name, value in (("question", question), ("context", context)):
        p.check_text(value, name)
    if not context.strip():
        raise InvalidInputError("context is empty: there is nothing to find an answer in")
    _check_top_k(top_k, "every answer")
    spec = get_task("question-answering")
    request = {"QUESTION": p.strings([question]), "CONTEXT": p.strings([context])}
    return Call(spec.name, [request], (spec.client_output,), lambda outs: spec.parse(outs, top_k))


def rerank(query: str, documents, info: ModelInfo, top_k: int | None = None) -> Call:
    """A cross-encoder scores each (query, document) pair, as many documents a request as the model takes
    (:attr:`ModelInfo.rows_per_request`); a late-interaction model's score compares the query's vectors with
    each document's (:func:`late_rerank`)."""
    p.check_text(query, "query")
    items, _ = p.as_list(documents, "documents")
    _check_top_k(top_k, "every document")
    spec = get_task("rerank")
    if not info.serves(spec.name) and info.serves("multi-vector"):
        return late_rerank(query, items, info, top_k)
    parts = p.chunks(items, info.rows_per_request)
    requests = [{"QUERY": p.strings([query]), "DOCUMENTS": p.strings(part)} for part in parts]
    return Call(spec.name, requests, (spec.client_output,), lambda outs: spec.parse(outs, items, top_k),
                places=_places("documents", parts))


def late_rerank(query: str, documents: list[str], info: ModelInfo, top_k: int | None = None) -> Call:
    """The documents by the late-interaction model's own score (its ``similarity``: MaxSim or MeanMaxSim) of
    the query's vectors (query side) against each document's (document side), best first."""
    similarity, spec = info.similarity, get_task("multi-vector")
    if not documents:  # nothing to rank: the query is not sent either (as a cross-encoder sends nothing)
        return Call(spec.name, [], (spec.client_output,), lambda answers: [])
    if similarity not in late_interaction.SIMILARITIES:
        raise WrongTaskError(f"model {info.name!r} names no late-interaction similarity (its similarity "
                             f"parameter is {similarity!r}): it cannot rank by it")
    parts = p.chunks(documents, info.max_batch_size)
    requests = [{"TEXT": p.strings(texts).reshape(-1, 1)} for texts in [[query], *parts]]
    sides = [{INPUT_TYPE_PARAMETER: QUERY}] + [{INPUT_TYPE_PARAMETER: DOCUMENT}] * (len(requests) - 1)

    def finish(answers) -> list:
        vectors = spec.parse(answers)
        scores = late_interaction.score(similarity, vectors[:1], vectors[1:])[0]
        return get_task("rerank").parse([scores], documents, top_k)
    places = _places("documents", parts)
    return Call(spec.name, requests, _names(spec.results), finish, request_parameters=sides,
                places=[None, *places] if places else None)


def _names(tensors) -> tuple[str, ...]:
    return tuple(tensor.name for tensor in tensors)
