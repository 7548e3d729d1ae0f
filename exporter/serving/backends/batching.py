"""Which rows of an encoder execution run together, and at what length.

Triton hands the encoder every request it merged: rows of texts from a
4-token query to a 512-token paragraph, all padded to one width.  Running
them as one batch pays for the padding; running each alone pays the fixed
cost of a run many times.  :func:`length_groups` sorts the rows by real length and
splits them into the groups that minimise the estimated cost, each group
run at its own longest real length.

The cost model: a run costs a fixed price, expressed as ``run_cost_tokens``
tokens, and each token costs more as the sequence grows (attention is quadratic),
by a factor ``1 + length / QUADRATIC_LENGTH``.  On a CPU the fixed price is small
(:data:`RUN_COST_TOKENS`, fitted by timing encoder runs; the grouping is not
sensitive to it: bench/data/tried.md, "The length groups' cost model").  On a
GPU it is large (:data:`GPU_RUN_COST_TOKENS`): a launch costs what thousands of
tokens do, and rows of a batch run side by side (docs/gpu.md, "No padding computed").
"""

from __future__ import annotations

import numpy as np

RUN_COST_TOKENS = 32.0
#: A GPU run's fixed price: padding a small batch to thousands of token positions cost about nothing on
#: an H100 (bench/data/tried.md, "The GPU served path's levers, built and not yet measured on a GPU").
GPU_RUN_COST_TOKENS = 8192.0
QUADRATIC_LENGTH = 600.0


def real_lengths(attention_mask: np.ndarray) -> np.ndarray:
    """One past the last non-zero mask position of each row (at least 1)."""
    mask = np.asarray(attention_mask).astype(bool)
    width = mask.shape[1]
    last = width - np.argmax(mask[:, ::-1], axis=1)
    return np.where(mask.any(axis=1), last, 1).astype(np.int64)


def run_cost(rows: np.ndarray, length: float, run_cost_tokens: float) -> np.ndarray:
    """The model's estimate of one run of ``rows`` rows at ``length`` tokens, in tokens."""
    return run_cost_tokens + rows * length * (1.0 + length / QUADRATIC_LENGTH)


def length_groups(lengths: np.ndarray, run_cost_tokens: float = RUN_COST_TOKENS) -> list[np.ndarray]:
    """Groups of row indices, each run as one batch at its longest length.

    Optimal for the cost model among groupings of the length-sorted rows (dynamic programming:
    ``best[j]`` is the cheapest way to run the rows of the ``j`` shortest lengths, the last group
    holding those of lengths ``i..j-1``).  Groups split only between two lengths: moving rows of a
    group's longest length into it from the next group never costs more, so an optimum splits there,
    and the work grows with the distinct lengths of an execution, not with its rows."""
    order = np.argsort(lengths, kind="stable")
    distinct, counts = np.unique(np.asarray(lengths)[order], return_counts=True)
    rows_before = np.concatenate([[0], np.cumsum(counts)])
    n = len(distinct)
    best = np.zeros(n + 1)
    start = np.zeros(n + 1, dtype=np.int64)
    for j in range(1, n + 1):
        costs = best[:j] + run_cost(rows_before[j] - rows_before[:j], float(distinct[j - 1]), run_cost_tokens)
        start[j] = int(np.argmin(costs))
        best[j] = costs[start[j]]
    groups, j = [], n
    while j > 0:
        groups.append(order[rows_before[start[j]]:rows_before[j]])
        j = start[j]
    return groups[::-1]
