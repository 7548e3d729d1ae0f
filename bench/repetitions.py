"""The timed repetitions of one run: every path once per repetition, then again.

Interleaving spreads the noise of a shared machine over all paths alike, so the ratios in
one run stay comparable.  The throughput rows on the text set are sliced: with S slices,
repetition r times every S-th text from offset r mod S, the same slice for every path, so
any S repetitions together cover the whole set once and the fidelity figures cover all of
it, however many repetitions the run adds to settle its targets (:class:`Repetitions`).
The targets divide each path's figure in repetition r by the reference's in the same
repetition (bench/targets.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from .measure import Measurement
from .results import rows
from .run_size import RunSize
from .targets import evaluate, unsettled

log = logging.getLogger("nexus_sli.bench")


@dataclass
class Repetitions:
    """How many timed repetitions a run makes, and a record of the ones it made.

    At least ``minimum``; after that one more while a target's paired ratios spread by
    :data:`targets.SPREAD_LIMIT` or more, up to ``maximum`` and while one more repetition
    (at the mean duration so far) still fits in ``budget_s``.  Sliced rows time slice
    ``r % slices`` in repetition r (:meth:`Measurement.time_once`)."""

    minimum: int
    maximum: int
    slices: int
    budget_s: float
    default: dict | None = None
    seconds: list[float] = field(default_factory=list)
    stopped: str = ""

    @classmethod
    def for_run_size(cls, run_size: RunSize, asked: int | None, default: dict | None) -> "Repetitions":
        minimum = asked or run_size.repetitions
        # slices: the run size's repetition count, so its minimum covers the set once (fewer when fewer are asked)
        return cls(minimum, max(minimum, run_size.max_repetitions), min(run_size.repetitions, minimum),
                   run_size.repetition_budget_s, default)

    @property
    def done(self) -> int:
        return len(self.seconds)

    def another(self, measurements: list[Measurement]) -> bool:
        """Whether to time one more repetition (and why not, in ``stopped``)."""
        if self.done < self.minimum:
            return True
        spread = unsettled(evaluate(rows(measurements), self.default))
        if not spread:
            self.stopped = "every measured target's spread is under the limit" if self.done > 1 else "one repetition"
        elif self.done >= self.maximum:
            self.stopped = f"the cap of {self.maximum} repetitions, {len(spread)} comparison(s) still spread"
        elif sum(self.seconds) + float(np.mean(self.seconds)) > self.budget_s:
            self.stopped = f"the {self.budget_s:.0f} s budget, {len(spread)} comparison(s) still spread"
        else:
            log.info("%d comparison(s) spread by %s or more: one more repetition", len(spread),
                     ", ".join(f"{t['spread']:.0%}" for t in spread))
            return True
        return False

    def record(self) -> dict:
        return {"repetitions": self.done, "minimum": self.minimum, "maximum": self.maximum, "slices": self.slices,
                "budget_s": self.budget_s, "repetition_s": [round(x, 1) for x in self.seconds],
                "stopped": self.stopped}


def _served_first(measurements: list[Measurement]) -> dict[str, int]:
    """Where each served configuration's block of rows starts, by precision."""
    first = {}
    for index, m in enumerate(measurements):
        if m.served and m.path == "triton":
            first.setdefault(m.precision, index)
    return first


def protocol_turns(measurements: list[Measurement], repetition: int) -> list[Measurement]:
    """``measurements`` in the order repetition ``repetition`` times them: the served rows over each
    client protocol take turns going first (gRPC in even repetitions, HTTP in odd ones), so a cost
    the first protocol pays for the server (a runtime compiling for a new input shape) does not
    always fall on the same protocol.  Everything else keeps its place."""
    served = sorted({m.protocol for m in measurements if m.served and m.path == "triton"})
    if repetition % 2 == 0 or len(served) < 2:
        return list(measurements)
    first = _served_first(measurements)
    flipped = {protocol: rank for rank, protocol in enumerate(reversed(sorted(served, key=("grpc", "http").index)))}

    def key(item: tuple[int, Measurement]):
        index, m = item
        if m.served and m.path == "triton":
            return (first[m.precision], flipped[m.protocol], index)
        return (index, 0, index)
    return [m for _, m in sorted(enumerate(measurements), key=key)]


def run_repetitions(measurements: list[Measurement], repetitions: Repetitions, sampler) -> None:
    """Every measurement once per repetition, interleaved, for as many repetitions as
    ``repetitions`` asks (:class:`Repetitions`)."""
    while repetitions.another(measurements):
        started = time.perf_counter()
        for m in protocol_turns(measurements, repetitions.done):
            sampler.active(m.served)
            m.time_once(repetitions.done, repetitions.slices)
        sampler.active(False)
        repetitions.seconds.append(time.perf_counter() - started)
        log.info("repetition %d (at least %d, at most %d): %.1f s", repetitions.done, repetitions.minimum,
                 repetitions.maximum, repetitions.seconds[-1])
