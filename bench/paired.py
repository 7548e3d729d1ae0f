"""Two paths' batches of 32 sent in turn, request by request, on the same texts.

Timed as blocks, one path's batches after the other's, two paths to one served model are not
compared fairly: whichever sends to the model first in a repetition pays more than the difference
between them (bench/data/tried.md, "A short query, layer by layer, and the gateway's HTTP stack").
Sent in turn, every batch goes to both paths one after the other, the path that goes first
changing from batch to batch and from one run to the next, so whatever the model's state costs
falls on both alike.  Each path's figure is the sum of its own requests' times on the same texts,
so the ratio of the two is what the same batches cost each.
"""

from __future__ import annotations

from time import perf_counter
from typing import Callable

import numpy as np

from .measure import Sample

BATCH_SIZE = 32

#: a path: one request of the texts given, their vectors back
Send = Callable[[list[str]], np.ndarray]


def turn_order(batches: int, start: int) -> list[tuple[int, int]]:
    """``(batch, side)`` in the order they are sent: every batch to both sides, side ``start`` first
    in the even batches and the other side first in the odd ones (A B, B A, A B, ...)."""
    order = []
    for batch in range(batches):
        first = (start + batch) % 2
        order += [(batch, first), (batch, 1 - first)]
    return order


class TakingTurns:
    """Two paths timed in turn on the same batches (:func:`turn_order`); each run starts with the
    side the previous run did not start with.  :meth:`side` gives each path a measurement's run."""

    def __init__(self, first: Send, second: Send, batch_size: int = BATCH_SIZE):
        self.senders, self.batch_size = (first, second), batch_size
        self.runs = 0
        self._waiting: dict[int, tuple[list[str], Sample]] = {}

    def run(self, texts: list[str]) -> tuple[Sample, Sample]:
        """Both sides' samples of one run over ``texts``: each side's time is its own requests' sum."""
        batches = [texts[i:i + self.batch_size] for i in range(0, len(texts), self.batch_size)]
        vectors: list[list] = [[None] * len(batches), [None] * len(batches)]
        latencies: list[list[float]] = [[], []]
        for batch, side in turn_order(len(batches), self.runs % 2):
            started = perf_counter()
            vectors[side][batch] = np.asarray(self.senders[side](batches[batch]))
            latencies[side].append((perf_counter() - started) * 1e3)
        self.runs += 1
        first, second = (Sample(sum(ms) / 1e3, ms, np.concatenate(v)) for ms, v in zip(latencies, vectors))
        return first, second

    def side(self, which: int) -> Callable[[list[str]], Sample]:
        """Side ``which`` (0 or 1) as a measurement's run: whichever side is timed first on a list of
        texts runs both, and the other side's next call on the same texts takes its sample of that run."""
        def run(texts: list[str]) -> Sample:
            waiting = self._waiting.pop(which, None)
            if waiting is not None and waiting[0] == texts:
                return waiting[1]
            samples = self.run(texts)
            self._waiting[1 - which] = (list(texts), samples[1 - which])
            return samples[which]
        return run
