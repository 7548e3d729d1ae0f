"""The encoder shims' length groups: optimal for their cost model, split only between lengths, and on a
GPU one run for a batch of ordinary texts."""

from __future__ import annotations

import numpy as np
import pytest

from nexus_sli.exporter.serving.backends.batching import (
    GPU_RUN_COST_TOKENS,
    RUN_COST_TOKENS,
    run_cost,
    length_groups,
)


def cost(lengths: np.ndarray, groups: list[np.ndarray], run_cost_tokens: float) -> float:
    return float(sum(run_cost(len(g), float(lengths[g].max()), run_cost_tokens) for g in groups))


def cheapest_by_rows(lengths: np.ndarray, run_cost_tokens: float) -> float:
    """The optimum over every split of the length-sorted rows, row by row (the grouping's definition)."""
    ordered = np.sort(lengths).astype(np.float64)
    best = [0.0]
    for j in range(1, len(ordered) + 1):
        best.append(min(best[i] + run_cost(j - i, ordered[j - 1], run_cost_tokens) for i in range(j)))
    return best[-1]


@pytest.mark.parametrize("run_cost_tokens", [RUN_COST_TOKENS, GPU_RUN_COST_TOKENS])
@pytest.mark.parametrize("seed", range(6))
def test_groups_cost_what_the_best_split_of_the_rows_costs(seed, run_cost_tokens):
    rng = np.random.default_rng(seed)
    # an execution's mix: many short texts with repeated lengths, a few long ones
    lengths = np.concatenate([rng.integers(4, 40, 60), rng.integers(100, 512, 8)])
    rng.shuffle(lengths)
    groups = length_groups(lengths, run_cost_tokens)
    assert sorted(np.concatenate(groups).tolist()) == list(range(len(lengths)))
    assert cost(lengths, groups, run_cost_tokens) == pytest.approx(cheapest_by_rows(lengths, run_cost_tokens))


def test_rows_of_one_length_share_a_group():
    lengths = np.array([7, 30, 7, 300, 30, 7, 300])
    for group in length_groups(lengths):
        for length in set(lengths[group].tolist()):
            assert set(np.flatnonzero(lengths == length)) <= set(group.tolist())


def test_a_gpu_runs_a_batch_of_ordinary_texts_at_once_where_a_cpu_splits_it():
    lengths = np.array([8] * 24 + [60] * 8)
    assert len(length_groups(lengths, GPU_RUN_COST_TOKENS)) == 1
    assert len(length_groups(lengths, RUN_COST_TOKENS)) == 2
