"""Timing the candidate graphs side by side, so that ``auto`` keeps the fastest.

A candidate is timed on what clients send (the bench's workloads): one client
batch of :data:`BATCH` validation texts of mixed lengths, and one short query
alone.  Its score is the sum of the two medians: the batch dominates, so the
choice is mostly throughput, but a graph with a high fixed cost per run pays
for it in the lone query.  Texts are tokenised as the served tokenizer does
(padded to the batch's longest text; CPU graphs cut that padding themselves).

The candidates take turns, one run each per round, rather than one after the
other: a machine whose speed drifts (other jobs, turbo, a noisy neighbour)
then slows every candidate alike instead of the one that happened to be timed
during the slow spell.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from nexus_sli.exporter.triton.python_models.encoding import encode

from .validate import validation_texts

#: Texts in the client batch the bench sends (``make bench``: batches of 32).
BATCH = 32


@dataclass(frozen=True)
class Workload:
    """One input a candidate is timed on."""

    name: str
    feeds: dict[str, np.ndarray]

    def describe(self) -> str:
        rows, width = next(iter(self.feeds.values())).shape
        return f"{self.name} ({rows} x {width} tokens)"


def workloads(tokenizer, input_names: list[str], pad_id: int, max_length: int, pairs: bool = False) -> list[Workload]:
    """The client batch (texts spread over the validation set's lengths) and the short query."""
    texts = validation_texts()
    if pairs:  # (query, document)-shaped, as validation pairs them
        texts = list(zip(texts, texts[1:] + texts[:1]))
    lengths = [len(e.ids) for e in tokenizer.encode_batch(texts)]
    by_length = [text for _, text in sorted(zip(lengths, texts), key=lambda pair: pair[0])]
    # every len/BATCH-th text by length: short queries and long paragraphs, as a real batch mixes them
    step = max(1, len(by_length) // BATCH)
    batch = by_length[::step][:BATCH]
    short = by_length[len(by_length) // 10]  # a short query, not the shortest oddity
    return [Workload(f"batch of {len(batch)}", encode(tokenizer, batch, input_names, pad_id, max_length)),
            Workload("one short text", encode(tokenizer, [short], input_names, pad_id, max_length))]


#: Untimed runs of each workload first (allocations, OpenVINO's and ORT's first-run work), then timed rounds.
WARMUP, ROUNDS = 2, 5


def run_ms(runner, feeds: dict[str, np.ndarray]) -> float:
    """Wall milliseconds of one ``runner.run`` on ``feeds``."""
    start = time.perf_counter()
    runner.run(None, feeds)
    return (time.perf_counter() - start) * 1000


def time_side_by_side(runners: list, loads: list[Workload], rounds: int = ROUNDS) -> list[dict[str, float]]:
    """Median milliseconds of one run of each workload, per runner, the runners taking turns."""
    for runner in runners:
        for load in loads:
            for _ in range(WARMUP):
                runner.run(None, load.feeds)
    times: list[dict[str, list[float]]] = [{load.name: [] for load in loads} for _ in runners]
    for _ in range(rounds):
        for runner, taken in zip(runners, times):
            for load in loads:
                taken[load.name].append(run_ms(runner, load.feeds))
    return [{name: statistics.median(values) for name, values in taken.items()} for taken in times]
