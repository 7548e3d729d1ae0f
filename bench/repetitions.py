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

from .measure import GATEWAY_PATH, Measurement
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


#: The ways a served configuration is reached, in the order of a repetition that does not rotate them.
SERVED_GROUPS = ("grpc", "http", GATEWAY_PATH)


def _served_group(m: Measurement) -> str | None:
    """Which way ``m`` reaches a served configuration: a client protocol, or the gateway (its routes
    together); None for what is not served."""
    if not m.served:
        return None
    if m.path == GATEWAY_PATH:
        return GATEWAY_PATH
    return m.protocol if m.path == "triton" and m.protocol in SERVED_GROUPS else None


def protocol_turns(measurements: list[Measurement], repetition: int) -> list[Measurement]:
    """``measurements`` in the order repetition ``repetition`` times them.  The ways each served
    configuration is reached (gRPC, HTTP, the gateway) take turns going first, one more step each
    repetition, inside the block where that configuration's rows start: whichever reaches the model
    first in a repetition pays costs the others then find paid (a runtime compiling for a new input
    shape), so no path always pays them and the paths compared side by side are paired fairly.
    Everything else keeps its place."""
    start, groups = {}, {}
    for index, m in enumerate(measurements):
        group = _served_group(m)
        if group is not None:
            start.setdefault(m.precision, index)
            groups.setdefault(m.precision, set()).add(group)

    def key(item: tuple[int, Measurement]):
        index, m = item
        group = _served_group(m)
        if group is None:
            return (index, 0, index)
        present = [g for g in SERVED_GROUPS if g in groups[m.precision]]
        turn = (present.index(group) - repetition) % len(present)
        return (start[m.precision], turn, index)
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
