"""How a reduced-precision graph's decisions are judged against PyTorch fp32's.

Each metric counts, for one batch, the decisions both made the same way, the
decisions made, and the ties: decisions PyTorch itself cannot make, because
its top scores are closer than :data:`TIE_MARGIN`.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

#: The fp32 parity tolerance of the exporter's validation (its ``max_abs_diff``): two
#: reference scores closer than this can be ordered either way by an export that
#: passes parity, so they are no decision to agree on.
TIE_MARGIN = 1e-4

Counts = tuple[int, int, int]


def _top_two_gap(scores: np.ndarray) -> np.ndarray:
    """Best minus second-best score; inf for a single score, nan (a tie) where both are -inf (masked)."""
    if scores.shape[-1] < 2:
        return np.full(scores.shape[:-1], np.inf)
    top = np.sort(scores, axis=-1)
    with np.errstate(invalid="ignore"):
        return top[..., -1] - top[..., -2]


def _rows(g: np.ndarray, e: np.ndarray, mask: np.ndarray):
    """One label per text."""
    return g.argmax(-1) == e.argmax(-1), _top_two_gap(e) > TIE_MARGIN


def _tokens(g: np.ndarray, e: np.ndarray, mask: np.ndarray):
    """One label per real token; padding positions are no decision."""
    real = mask.astype(bool)
    return (g.argmax(-1) == e.argmax(-1))[real], (_top_two_gap(e) > TIE_MARGIN)[real]


def _span(g: np.ndarray, e: np.ndarray, mask: np.ndarray):
    """The best position (span start or end) among the real tokens."""
    gm, em = np.where(mask > 0, g, -np.inf), np.where(mask > 0, e, -np.inf)
    return gm.argmax(-1) == em.argmax(-1), _top_two_gap(em) > TIE_MARGIN


def _order(g: np.ndarray, e: np.ndarray, mask: np.ndarray):
    """Every pair of rows ranked the same way (relevance scores)."""
    dg, de = g[:, 0][:, None] - g[:, 0][None, :], e[:, 0][:, None] - e[:, 0][None, :]
    upper = np.triu_indices(len(g), 1)
    return np.sign(dg[upper]) == np.sign(de[upper]), np.abs(de[upper]) > TIE_MARGIN


METRICS: dict[str, Callable] = {"rows": _rows, "tokens": _tokens, "span": _span, "order": _order}


def agreement(metric: str, got: list[np.ndarray], expected: list[np.ndarray], mask: np.ndarray) -> Counts:
    """(agreeing, decided, ties) over every output of one batch."""
    agree = total = ties = 0
    for g, e in zip(got, expected):
        same, decided = METRICS[metric](g, e, mask)
        agree += int((same & decided).sum())
        total += int(decided.sum())
        ties += int((~decided).sum())
    return agree, total, ties


def ranked_pairs(got: np.ndarray, expected: np.ndarray, scale: np.ndarray, top: int) -> Counts:
    """(agreeing, decided, ties) over the pairs that decide each query's top ``top`` results.

    ``got`` and ``expected`` are ``[queries, results]`` scores (a query's own row left out); ``scale`` is
    ``[queries]``, the score each query's ranking is read against (its best reference score).  Each of a
    query's ``top`` best results by ``expected``, paired with every result ranked below it, is one decision:
    agreeing where ``got`` orders the pair as ``expected`` does.  A pair whose reference scores are within
    :data:`TIE_MARGIN` times the query's ``scale`` is a tie (no decision), as for labels; scores are relative
    here because their range depends on the similarity (a lexical score or MaxSim is no cosine)."""
    count = min(top, expected.shape[1])
    rows = np.arange(len(expected))[:, None]
    best = np.argsort(-expected, axis=1, kind="stable")[:, :count]
    rank = np.full(expected.shape, count)
    rank[rows, best] = np.arange(count)
    below = rank[:, None, :] > np.arange(count)[None, :, None]  # [queries, top, results]: each pair counted once
    de = expected[rows, best][:, :, None] - expected[:, None, :]
    dg = got[rows, best][:, :, None] - got[:, None, :]
    decided = below & (np.abs(de) > TIE_MARGIN * np.abs(scale)[:, None, None])
    same = np.sign(dg) == np.sign(de)
    return int((same & decided).sum()), int(decided.sum()), int((below & ~decided).sum())
