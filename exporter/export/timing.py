"""Timing the candidate graphs side by side, so that ``auto`` keeps the fastest.

A candidate is timed on what clients send (the bench's workloads): one client
batch of :data:`BATCH` validation texts of mixed lengths, and one short query
alone.  Its score weighs the two as the user asked (:data:`OBJECTIVES`,
``--optimize``): each workload's median as a ratio to the best candidate's on
that workload, combined by a weighted geometric mean, so that 1% on a long
batch and 1% on a short query count alike; ``balanced`` (the default) weighs
both equally, ``throughput`` only the batch, ``latency`` only the lone query.
A sum of milliseconds would let the batch decide alone, keeping a graph a
little faster on the batch over one far faster on a single query
(bench/data/tried.md, "Exporter constants").  Texts are tokenised as the served
tokenizer does (padded to the batch's longest text; CPU graphs cut that padding
themselves).

The candidates take turns, one run each per round, rather than one after the
other: a machine whose speed drifts (other jobs, turbo, a noisy neighbour)
then slows every candidate alike instead of the one that happened to be timed
during the slow spell.

Taking turns needs every graph open at once.  Where the graphs would not fit
in memory together (a model past 2 GB has about ten candidates of 1-2 GB each
on the CPU), they are timed in heats (:func:`time_in_heats`): as many as fit
in :func:`memory_budget` side by side, then the fastest of that heat side by
side with the next ones, and so on, so every graph is compared with the
leader in one heat; where all fit, that is one heat, as before.  Where one
round takes longer than :data:`LONG_ROUND_S` (a large model's batch of 32 on a
small CPU) each run is long enough to measure on its own: one warm-up run and
:data:`LONG_ROUNDS` rounds instead of two and five.

A graph far behind stops being timed (:func:`left_behind`): once, at its
fastest run so far, it is :data:`LEFT_BEHIND` times slower than another graph
at that graph's slowest, as the objective weighs the workloads, its medians
cannot make it the fastest, so the rounds left are spent on the graphs still
in the race, and they stop where one is left (bench/data/tried.md, "Five
minutes reached").
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from nexus_sli.exporter.triton.python_models.encoding import encode

from .validate import validation_texts

log = logging.getLogger(__name__)

#: Texts in the client batch the bench sends (``make bench``: batches of 32).
BATCH = 32


#: What ``auto`` optimises for: each workload kind's weight in the score (:func:`scores`).
OBJECTIVES: dict[str, dict[str, float]] = {
    "balanced": {"batch": 0.5, "single": 0.5},
    "throughput": {"batch": 1.0},
    "latency": {"single": 1.0},
}
DEFAULT_OBJECTIVE = "balanced"


@dataclass(frozen=True)
class Workload:
    """One input a candidate is timed on; ``kind`` (a key of an :data:`OBJECTIVES` entry) says what it stands for."""

    name: str
    feeds: dict[str, np.ndarray]
    kind: str = "batch"

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
    return [Workload(f"batch of {len(batch)}", encode(tokenizer, batch, input_names, pad_id, max_length), "batch"),
            Workload("one short text", encode(tokenizer, [short], input_names, pad_id, max_length), "single")]


#: Untimed runs of each workload first (allocations, OpenVINO's and ORT's first-run work), then timed rounds.
WARMUP, ROUNDS = 2, 5


def run_ms(runner, feeds: dict[str, np.ndarray]) -> float:
    """Wall milliseconds of one ``runner.run`` on ``feeds``."""
    start = time.perf_counter()
    runner.run(None, feeds)
    return (time.perf_counter() - start) * 1000


#: How many times slower than another graph a graph must be, at its fastest run against that graph's slowest,
#: to stop being timed (:func:`left_behind`): past what a busy machine's run-to-run noise does to one graph, and
#: short of the gap between a reduced precision and fp32 where the reduced one wins outright.
LEFT_BEHIND = 1.5
#: Timed rounds every graph runs before one can be left behind: one slow run alone never leaves a graph behind.
ROUNDS_BEFORE_LEAVING = 2


@dataclass
class SideBySide:
    """What :func:`time_side_by_side` measured: per runner, its median milliseconds on each workload and the timed
    rounds it ran (fewer than asked where it was left behind, or where it was the last one in the race)."""

    medians: list[dict[str, float]]
    rounds: list[int]


def time_side_by_side(runners: list, loads: list[Workload], rounds: int = ROUNDS, warmup: int = WARMUP,
                      objective: str = DEFAULT_OBJECTIVE) -> SideBySide:
    """Median milliseconds of one run of each workload, per runner, the runners taking turns; a runner
    :func:`left_behind` by another stops running, and the rounds stop where one runner is left."""
    for runner in runners:
        for load in loads:
            for _ in range(warmup):
                runner.run(None, load.feeds)
    times: list[dict[str, list[float]]] = [{load.name: [] for load in loads} for _ in runners]
    racing = set(range(len(runners)))
    for done in range(1, rounds + 1):
        for index in sorted(racing):
            for load in loads:
                times[index][load.name].append(run_ms(runners[index], load.feeds))
        if done >= ROUNDS_BEFORE_LEAVING:
            racing -= left_behind({i: times[i] for i in racing}, loads, objective)
        if len(racing) == 1:
            break
    return SideBySide([{name: statistics.median(values) for name, values in taken.items()} for taken in times],
                      [len(next(iter(taken.values()))) for taken in times])


def left_behind(times: dict[int, dict[str, list[float]]], loads: list[Workload], objective: str) -> set[int]:
    """The graphs of ``times`` (graph -> workload name -> the milliseconds of each run so far) that, at their
    fastest on each workload, are :data:`LEFT_BEHIND` times slower than another graph at its slowest, the
    workloads weighed as :func:`scores` weighs them: whatever their next runs take, their medians stay behind
    that graph's unless its runs turn that much slower than every run it has made so far."""
    counted = _counted(loads, objective)
    total = sum(counted.values())

    def behind(slow: int, fast: int) -> float:
        return float(np.exp(sum(w * np.log(min(times[slow][name]) / max(times[fast][name]))
                                for name, w in counted.items()) / total))

    return {i for i in times if any(behind(i, j) >= LEFT_BEHIND for j in times if j != i)}


#: Seconds of one round (every graph of a heat once on every workload) past which runs are measured
#: with :data:`LONG_ROUNDS` rounds after one warm-up: for a model past 2 GB on a small CPU, two warm-ups
#: and five rounds of its ten graphs would outlast the rest of the export (bench/data/tried.md, "Exporter
#: constants").
LONG_ROUND_S = 20.0
LONG_ROUNDS = 3
#: A graph open in its runtime, after the timing workloads, takes up to this many times the size of its
#: files: ONNX Runtime maps the external data and touches only the embedding rows it reads, OpenVINO
#: takes more than its files (bench/data/tried.md, "Exporter constants").
RUNNER_MEMORY_FACTOR = 2.0
#: The share of the memory available when timing starts that the graphs of one heat may take: the rest
#: stays for the exporter itself and for whatever else runs on the machine.
MEMORY_SHARE = 0.5


def memory_available() -> int:
    """Bytes the kernel could give without swapping (``MemAvailable``); unknown: a terabyte, one heat."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 40


def memory_budget() -> int:
    """Bytes the graphs of one heat may take (:data:`MEMORY_SHARE` of what is available now)."""
    return int(memory_available() * MEMORY_SHARE)


def footprint(files: list[Path]) -> int:
    """The memory a graph is expected to take open in its runtime (:data:`RUNNER_MEMORY_FACTOR` x its files)."""
    return int(sum(Path(f).stat().st_size for f in files) * RUNNER_MEMORY_FACTOR)


@dataclass
class Heats:
    """What :func:`time_in_heats` measured: each graph's medians (from the last heat it ran in), the fastest,
    and how: each heat's graphs with their scores there (graph index -> :func:`scores`, 1.0 the best
    possible), rounds, and the graphs that ran fewer rounds (graph index -> the timed rounds it ran: left
    behind, :func:`left_behind`)."""

    timings: list[dict[str, float]]
    fastest: int
    heats: list[dict[int, float]] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)
    left: list[dict[int, int]] = field(default_factory=list)


def check_objective(objective: str) -> str:
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; known: {', '.join(OBJECTIVES)}")
    return objective


def scores(timings: dict[int, dict[str, float]], loads: list[Workload], objective: str) -> dict[int, float]:
    """Each graph's score among ``timings`` (graph -> workload name -> median ms): the geometric mean of its
    medians over the best graph's, workload by workload, weighted by ``objective``'s weight of the workload's
    kind (workloads of a kind the objective does not weigh do not count).  1.0: the best on every workload
    that counts; 1.2: 20% slower than the best, on the weighted average."""
    counted = _counted(loads, objective)
    total = sum(counted.values())
    best = {name: min(t[name] for t in timings.values()) for name in counted}
    return {i: float(np.exp(sum(w * np.log(t[name] / best[name]) for name, w in counted.items()) / total))
            for i, t in timings.items()}


def _counted(loads: list[Workload], objective: str) -> dict[str, float]:
    """Workload name -> its weight under ``objective``, for the workloads that count (:func:`scores`)."""
    weights = {load.name: OBJECTIVES[check_objective(objective)].get(load.kind, 0.0) for load in loads}
    counted = {name: w for name, w in weights.items() if w > 0}
    # no workload of a kind this objective weighs: every workload counts alike
    return counted or {name: 1.0 for name in weights}


def _next_heat(leader: int | None, rest: list[int], sizes: list[int], budget: int) -> list[int]:
    """The leader and as many of ``rest`` (taken from its front) as fit in ``budget``: at least two graphs."""
    heat = [] if leader is None else [leader]
    used = 0 if leader is None else sizes[leader]
    while rest and (len(heat) < 2 or used + sizes[rest[0]] <= budget):
        used += sizes[rest[0]]
        heat.append(rest.pop(0))
    return heat


def _rounds(runners: list, loads: list[Workload]) -> tuple[int, int]:
    """One warm-up run of each runner on each workload; then (warm-up runs still to do, rounds)."""
    seconds = sum(run_ms(runner, load.feeds) for runner in runners for load in loads) / 1000
    return (0, LONG_ROUNDS) if seconds > LONG_ROUND_S else (WARMUP - 1, ROUNDS)


def time_in_heats(open_graph: Callable[[int], Any], sizes: list[int], loads: list[Workload], budget: int,
                  name: Callable[[int], str] = str, objective: str = DEFAULT_OBJECTIVE) -> Heats:
    """Time graphs ``0 .. len(sizes) - 1`` side by side in heats whose ``sizes`` (:func:`footprint`) fit
    ``budget``, the best of each heat by ``objective`` (:func:`scores`) carried into the next (see the module
    docstring).  ``open_graph(i)`` opens graph ``i`` for running; only the graphs of one heat are open at a time."""
    check_objective(objective)
    timings: list[dict[str, float]] = [{} for _ in sizes]
    result = Heats(timings, fastest=0)
    rest, leader, kept = list(range(len(sizes))), None, None
    while rest:
        heat = _next_heat(leader, rest, sizes, budget)
        log.info("timing heat %d: %s (about %.1f GB open of a %.1f GB budget)", len(result.heats) + 1,
                 ", ".join(name(i) for i in heat), sum(sizes[i] for i in heat) / 1e9, budget / 1e9)
        runners = [kept if i == leader else open_graph(i) for i in heat]
        warmup, rounds = _rounds(runners, loads)
        if rounds != ROUNDS:
            log.info("one round takes more than %.0f s: one warm-up run and %d rounds", LONG_ROUND_S, rounds)
        measured = time_side_by_side(runners, loads, rounds, warmup, objective)
        for index, medians in zip(heat, measured.medians):
            timings[index] = medians
        scored = scores({i: timings[i] for i in heat}, loads, objective)
        leader = min(heat, key=scored.get)
        # the leader may have run fewer rounds too: the last graph in the race needs no more
        left = {i: ran for i, ran in zip(heat, measured.rounds) if ran < rounds and i != leader}
        if left:
            log.info("left behind (%s): %s", objective, ", ".join(
                f"{name(i)} after {ran} rounds ({scored[i]:.2f})" for i, ran in left.items()))
        kept = runners[heat.index(leader)]
        del runners  # the heat's other graphs are closed before the next heat opens its own
        if len(sizes) > len(heat) or result.heats:  # in heats: say who goes on (one heat: the table says it all)
            log.info("heat %d (%s): %s; best %s", len(result.heats) + 1, objective,
                     ", ".join(f"{name(i)} {scored[i]:.3f}" for i in heat), name(leader))
        result.heats.append(scored)
        result.rounds.append(rounds)
        result.left.append(left)
    result.fastest = leader
    return result
