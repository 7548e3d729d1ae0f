"""Late-interaction scores of the vectors a multi-vector model serves, and BGE-M3's lexical score.

A late-interaction (ColBERT) model answers one vector per scored token of each
text (``embed_multi_vector``).  A query and a document are compared by MaxSim:
each query vector's best dot product with any of the document's vectors, summed
over the query's vectors (sentence-transformers' ``util.maxsim``).  MeanMaxSim
divides that by the query's vector count, so that scores compare across queries
of different lengths (``util.mean_maxsim``; BGE-M3's ColBERT score).  A model
names the one it was trained with (its ``similarity`` parameter,
``ModelInfo.similarity``): :func:`score` applies it.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from nexus_sli.tasks.results import SparseEmbedding

from .errors import InvalidInputError

#: The model's similarity names (sentence-transformers' ``similarity_fn_name``), each as whether MaxSim is
#: divided by the query's vector count.
SIMILARITIES = {"maxsim": False, "meanmaxsim": True}
#: A document without any scored vector (every token in the model's skiplist, say) scores this, below every
#: real score: sentence-transformers' value, so that rankings agree.
EMPTY_DOCUMENT_SCORE = -1e9
#: The most dot products one step holds at once (about 64 MB in fp32): a large corpus is scored in pieces.
CHUNK_ELEMENTS = 1 << 24


def maxsim(queries, documents, mean: bool = False) -> np.ndarray:
    """``[len(queries), len(documents)]`` float32 MaxSim scores (``mean``: MeanMaxSim).

    Each side is a list of ``[n_i, dim]`` arrays, one per text, ``n_i`` may differ (or one ``[n, dim]`` array:
    one text).  Computed in float32, whatever the vectors' dtype.  A query without vectors scores 0 against
    every document; a document without vectors scores :data:`EMPTY_DOCUMENT_SCORE` (MeanMaxSim: divided by
    the query's vector count, as sentence-transformers does)."""
    queries, documents = _texts(queries, "queries"), _texts(documents, "documents")
    _same_size(queries + documents)
    scores = np.zeros((len(queries), len(documents)), np.float32)
    query_lengths, document_lengths = [len(q) for q in queries], [len(d) for d in documents]
    for q_start, q_end in _pieces(query_lengths, int(CHUNK_ELEMENTS ** 0.5)):
        per_document_token = max(sum(query_lengths[q_start:q_end]), 1)
        for d_start, d_end in _pieces(document_lengths, CHUNK_ELEMENTS // per_document_token):
            scores[q_start:q_end, d_start:d_end] = _piece(queries[q_start:q_end], documents[d_start:d_end])
    if mean:
        scores /= np.maximum(np.asarray(query_lengths, np.float32), 1)[:, None]
    return scores


def _piece(queries: list[np.ndarray], documents: list[np.ndarray]) -> np.ndarray:
    """MaxSim of a few queries and documents at once: every dot product, the max per document, the sum per query."""
    scores = np.zeros((len(queries), len(documents)), np.float32)
    asked = [i for i, q in enumerate(queries) if len(q)]
    filled = [j for j, d in enumerate(documents) if len(d)]
    if asked and filled:  # reduceat needs segments with something in them: a query without vectors keeps its 0
        dots = _stack(queries, asked) @ _stack(documents, filled).T
        best = np.maximum.reduceat(dots, _starts(documents, filled), axis=1)
        scores[np.ix_(asked, filled)] = np.add.reduceat(best, _starts(queries, asked), axis=0)
    scores[:, [j for j, d in enumerate(documents) if not len(d)]] = EMPTY_DOCUMENT_SCORE
    return scores


def _stack(texts: list[np.ndarray], chosen: list[int]) -> np.ndarray:
    return np.concatenate([texts[i] for i in chosen])


def _starts(texts: list[np.ndarray], chosen: list[int]) -> np.ndarray:
    """Where each chosen text's vectors begin in :func:`_stack`'s rows."""
    return np.concatenate([[0], np.cumsum([len(texts[i]) for i in chosen])[:-1]]).astype(np.intp)


def _pieces(lengths: list[int], limit: int) -> list[tuple[int, int]]:
    """``(start, end)`` runs of texts whose vectors together stay within ``limit`` (at least one text each)."""
    pieces, start, total = [], 0, 0
    for index, length in enumerate(lengths):
        if index > start and total + length > limit:
            pieces.append((start, index))
            start, total = index, 0
        total += length
    return pieces + [(start, len(lengths))] if lengths else []


def _texts(value, name: str) -> list[np.ndarray]:
    """One side as a list of float32 ``[n_i, dim]`` arrays."""
    if isinstance(value, np.ndarray) and value.ndim == 2:
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise InvalidInputError(f"{name} must be a list of [vectors, dim] arrays (one per text), or one such array; "
                                f"got {type(value).__name__}{getattr(value, 'shape', '')}")
    found = []
    for index, item in enumerate(value):
        array = np.asarray(item, dtype=np.float32)
        if array.size == 0 and array.ndim < 2:  # a text without vectors, as an empty list
            array = array.reshape(0, 0)
        if array.ndim != 2:
            raise InvalidInputError(f"{name}[{index}] must be a [vectors, dim] array, got shape {array.shape}")
        found.append(array)
    return found


def _same_size(texts: list[np.ndarray]) -> None:
    sizes = sorted({t.shape[1] for t in texts if len(t)})
    if len(sizes) > 1:
        raise InvalidInputError(f"the vectors differ in size ({', '.join(map(str, sizes))}): score the vectors of "
                                "one model")


def score(similarity: str, queries, documents) -> np.ndarray:
    """:func:`maxsim` as the model's ``similarity`` names it (``maxsim`` or ``meanmaxsim``)."""
    if similarity not in SIMILARITIES:
        raise InvalidInputError(f"unknown late-interaction similarity {similarity!r}; known: {', '.join(SIMILARITIES)}")
    return maxsim(queries, documents, mean=SIMILARITIES[similarity])


def lexical_score(a, b):
    """BGE-M3's lexical matching score: over the token ids both texts have, the sum of their weights'
    products (FlagEmbedding's ``compute_lexical_matching_score``).  ``a`` and ``b``: a :class:`SparseEmbedding`
    or a ``{token id: weight}`` mapping (FlagEmbedding's, ids as strings), one each (a float) or a list of
    them each (``[len(a), len(b)]`` float32)."""
    if isinstance(a, list) and isinstance(b, list):
        terms_b = [_terms(item) for item in b]
        return np.asarray([[_dot(_terms(item), other) for other in terms_b] for item in a], np.float32)
    if isinstance(a, list) or isinstance(b, list):
        raise InvalidInputError("lexical_score takes one text's weights on each side, or a list on each side")
    return _dot(_terms(a), _terms(b))


def _terms(weights) -> dict:
    if isinstance(weights, SparseEmbedding):
        return dict(zip(weights.indices.tolist(), weights.values.astype(np.float64).tolist()))
    if isinstance(weights, Mapping):  # FlagEmbedding writes ids as strings
        return {int(k) if isinstance(k, str) and k.isdigit() else k: float(v) for k, v in weights.items()}
    raise InvalidInputError(f"lexical weights must be a SparseEmbedding or a {{token id: weight}} mapping, "
                            f"got {type(weights).__name__}")


def _dot(a: dict, b: dict) -> float:
    return float(sum(weight * b[key] for key, weight in a.items() if key in b))
