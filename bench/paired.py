"""Several paths' batches of 32 sent in turn, request by request, on the same texts.

Timed as blocks, one path's batches after another's, paths to one served model are not compared
fairly: whichever sends to the model first in a repetition pays more than the difference between
them (bench/data/tried.md, "A short query, layer by layer, and the gateway's HTTP stack").  Sent in
turn, every batch goes to every path one after the other, the order rotating from batch to batch
and from one run to the next, so whatever the model's state costs falls on all alike.  Each path's
figure is the sum of its own requests' times on the same texts, so the ratio of two is what the
same batches cost each.
"""

from __future__ import annotations

from time import perf_counter
from typing import Callable

import numpy as np

from .measure import Sample

BATCH_SIZE = 32

#: a path: one request of the texts given, their vectors back
Send = Callable[[list[str]], np.ndarray]


def turn_order(batches: int, sides: int, start: int) -> list[tuple[int, int]]:
    """``(batch, side)`` in the order they are sent: every batch to each of ``sides``, the order
    rotated by one side a batch, side ``start`` first in batch 0 (for two: A B, B A, A B, ...; for
    three: A B C, B C A, C A B, ...), so that over ``sides`` batches each side takes each place once."""
    return [(batch, (start + batch + place) % sides) for batch in range(batches) for place in range(sides)]


class TakingTurns:
    """Paths timed in turn on the same batches (:func:`turn_order`); each run starts with the side
    after the one the previous run started with.  :meth:`side` gives each path a measurement's run."""

    def __init__(self, *senders: Send, batch_size: int = BATCH_SIZE):
        self.senders, self.batch_size = senders, batch_size
        self.runs = 0
        self._waiting: dict[int, tuple[list[str], Sample]] = {}

    def run(self, texts: list[str]) -> tuple[Sample, ...]:
        """Every side's sample of one run over ``texts``: each side's time is its own requests' sum."""
        sides = len(self.senders)
        batches = [texts[i:i + self.batch_size] for i in range(0, len(texts), self.batch_size)]
        vectors: list[list] = [[None] * len(batches) for _ in range(sides)]
        latencies: list[list[float]] = [[] for _ in range(sides)]
        for batch, side in turn_order(len(batches), sides, self.runs % sides):
            started = perf_counter()
            vectors[side][batch] = np.asarray(self.senders[side](batches[batch]))
            latencies[side].append((perf_counter() - started) * 1e3)
        self.runs += 1
        return tuple(Sample(sum(ms) / 1e3, ms, np.concatenate(v)) for ms, v in zip(latencies, vectors))

    def side(self, which: int) -> Callable[[list[str]], Sample]:
        """Side ``which`` as a measurement's run: whichever side is timed first on a list of texts runs
        them all, and each other side's next call on the same texts takes its sample of that run."""
        def run(texts: list[str]) -> Sample:
            waiting = self._waiting.pop(which, None)
            if waiting is not None and waiting[0] == texts:
                return waiting[1]
            samples = self.run(texts)
            self._waiting.update({other: (list(texts), sample) for other, sample in enumerate(samples)
                                  if other != which})
            return samples[which]
        return run
