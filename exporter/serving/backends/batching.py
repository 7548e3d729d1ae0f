"""Which rows of an encoder execution run together, and at what length.

Triton hands the encoder every request it merged: rows of texts from a
4-token query to a 512-token paragraph, all padded to one width.  Running
them as one batch pays for the padding; running each alone pays the fixed
cost of a run many times.  :func:`length_groups` sorts the rows by real length and
splits them into the groups that minimise the estimated cost, each group
run at its own longest real length.

The cost model: a run costs a fixed price, expressed as
:data:`RUN_COST_TOKENS` tokens, and each token costs more as the sequence
grows (attention is quadratic), by a factor ``1 + length / QUADRATIC_LENGTH``.
The constants were fitted by timing encoder runs; the grouping is not
sensitive to them (bench/data/tried.md, "The length groups' cost model").
"""

from __future__ import annotations

import numpy as np

RUN_COST_TOKENS = 32.0
QUADRATIC_LENGTH = 600.0


def real_lengths(attention_mask: np.ndarray) -> np.ndarray:
    """One past the last non-zero mask position of each row (at least 1)."""
    mask = np.asarray(attention_mask).astype(bool)
    width = mask.shape[1]
    last = width - np.argmax(mask[:, ::-1], axis=1)
    return np.where(mask.any(axis=1), last, 1).astype(np.int64)


def _run_cost(rows: np.ndarray, length: float) -> np.ndarray:
    return RUN_COST_TOKENS + rows * length * (1.0 + length / QUADRATIC_LENGTH)


def length_groups(lengths: np.ndarray) -> list[np.ndarray]:
    """Groups of row indices, each run as one batch at its longest length.

    Optimal for the cost model among groupings of the length-sorted rows
    (dynamic programming: ``best[j]`` is the cheapest way to run the ``j``
    shortest rows, the last group being rows ``i..j-1``)."""
    order = np.argsort(lengths, kind="stable")
    ordered = np.asarray(lengths, dtype=np.float64)[order]
    n = len(order)
    best = np.zeros(n + 1)
    start = np.zeros(n + 1, dtype=np.int64)
    for j in range(1, n + 1):
        firsts = np.arange(j)
        costs = best[:j] + _run_cost(j - firsts, ordered[j - 1])
        start[j] = int(np.argmin(costs))
        best[j] = costs[start[j]]
    groups, j = [], n
    while j > 0:
        groups.append(order[start[j]:j])
        j = start[j]
    return groups[::-1]
