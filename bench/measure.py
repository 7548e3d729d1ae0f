"""Samples, repetitions and the summary of one measured configuration."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

#: modes: what a client does
BATCH32 = "batch32"              # client batches of 32 texts (in-process: encode(batch_size=32))
CONCURRENT16 = "concurrent16"    # 16 clients, one text per request
LATENCY1 = "latency1"            # sequential single short queries
SEQ_LEN = "seq_len"              # batches of 32 texts of one token length
SHORT32 = "short32"              # client batches of 32 short texts (16 tokens or fewer), in the set's order
PAIRED32 = "paired32"            # batches of 32 sent in turn with other paths, request by request (bench/paired.py)

def in_process_precision(label: str) -> str:
    """The precision column of a served configuration's in-process rows: its label (:func:`exports.variant_label`)
    less the backend, which the path column names (``openvino-int8``: ``int8``; ``int8-static`` stays)."""
    return label.removeprefix("openvino-")


#: the rows of the HTTP gateway, in front of the served default configuration: OpenAI's API over HTTP
#: through the ``openai`` SDK, and TEI's (its ``/embed``)
GATEWAY_PATH, GATEWAY_PROTOCOL, TEI_PROTOCOL = "gateway", "openai-http", "tei-http"
#: OpenAI's route again, the SDK's JSON body sent by a plain HTTP client: the route's own cost, without the SDK's
OPENAI_PLAIN_PROTOCOL = "openai-http-plain"


@dataclass
class Sample:
    """One timed run over a list of texts (the first ``count`` of them when time-boxed)."""

    seconds: float
    latencies_ms: list[float]
    embeddings: np.ndarray
    indices: list[int] = field(default_factory=list)  # positions of the texts run in the measurement's list
    tokens: int = 0                                   # real tokens of the texts run

    @property
    def count(self) -> int:
        return len(self.embeddings)


@dataclass
class Measurement:
    """One row of the results: a path at a precision, over a protocol, in a mode."""

    path: str
    precision: str
    protocol: str
    mode: str
    texts: list[str]
    token_counts: list[int]         # real tokens per text (after truncation), for tokens/s
    run: Callable[[list[str]], Sample]
    served: bool = False
    baseline: bool = False          # a baseline candidate (the fastest of a group is the reference)
    seq_len: int | None = None
    threads: int | None = None      # torch intra-op threads, for the torch paths
    sliced: bool = False            # each repetition runs its own slice of ``texts``
    peer: str | None = None         # a library or server users pick instead: "in-process" or "server"
    samples: list[Sample] = field(default_factory=list)

    @property
    def group(self) -> tuple[str, int | None]:
        """Rows of a group run on the same texts; the group's baseline row is their reference."""
        group = {LATENCY1: "latency", SEQ_LEN: "seq", SHORT32: "short"}.get(self.mode, "set")
        return (group, self.seq_len)

    def warm_up(self, texts: list[str]) -> None:
        self.run(texts)

    def time_once(self, repetition: int = 0, slices: int = 1) -> Sample:
        """Repetition ``repetition``: sliced measurements run slice ``repetition % slices`` (every
        ``slices``-th text from that offset), so any ``slices`` consecutive repetitions cover the
        whole list once, however many repetitions the run ends up adding."""
        start = repetition % slices
        indices = list(range(start, len(self.texts), slices) if self.sliced else range(len(self.texts)))
        sample = self.run([self.texts[i] for i in indices])
        sample.indices = indices[:sample.count]
        sample.tokens = sum(self.token_counts[i] for i in sample.indices)
        self.samples.append(sample)
        return sample

    def texts_per_s(self) -> float:
        return float(np.median([s.count / s.seconds for s in self.samples]))

    def tokens_per_s(self) -> float:
        return float(np.median([s.tokens / s.seconds for s in self.samples]))

    def rates(self) -> list[float]:
        """texts/s of each repetition, in repetition order (what paired ratios divide)."""
        return [s.count / s.seconds for s in self.samples]

    def percentiles_ms(self, q: float) -> list[float | None]:
        """The ``q``-th latency percentile of each repetition (None where it timed no request)."""
        return [float(np.percentile(s.latencies_ms, q)) if s.latencies_ms else None for s in self.samples]

    def texts_timed(self) -> int:
        return sum(s.count for s in self.samples)

    def percentile_ms(self, q: float) -> float | None:
        pooled = [x for s in self.samples for x in s.latencies_ms]
        return float(np.percentile(pooled, q)) if pooled else None

    def reached(self) -> np.ndarray:
        """Which of ``texts`` some repetition ran: a time-boxed run stops before the end of its list."""
        mask = np.zeros(len(self.texts), dtype=bool)
        for sample in self.samples:
            mask[sample.indices] = True
        return mask

    def embeddings(self) -> np.ndarray:
        """``[len(texts), hidden]``; NaN rows for texts no repetition reached (:meth:`reached`)."""
        first = self.samples[0].embeddings
        vectors = np.full((len(self.texts), first.shape[1]), np.nan, dtype=np.float64)
        for sample in reversed(self.samples):
            vectors[sample.indices] = sample.embeddings
        return vectors


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine of every row.  A vector that is not finite (a runtime's NaN or overflow) gives NaN,
    never a row left out: fidelity figures must not read a broken output as a missing one.  Callers that
    compare time-boxed runs pass only the rows both reached (:meth:`Measurement.reached`)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    with np.errstate(invalid="ignore"):  # an infinite vector's NaN is the answer, not a warning
        a = a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)
        b = b / np.maximum(np.linalg.norm(b, axis=1, keepdims=True), 1e-12)
        return np.sum(a * b, axis=1)


def timed(function: Callable[[list[str]], np.ndarray]) -> Callable[[list[str]], Sample]:
    """An in-process encoder as a measurement: one wall-clock time per call, no per-request latencies."""
    def run(texts: list[str]) -> Sample:
        start = time.perf_counter()
        vectors = function(texts)
        return Sample(time.perf_counter() - start, [], np.asarray(vectors))
    return run


def one_at_a_time(embed_one: Callable[[str], np.ndarray], texts: list[str], budget_s: float | None) -> Sample:
    """Each text alone, after the previous one returned; stops early once ``budget_s`` is spent
    (a path slowed down many times over by a loaded machine must not stall the whole bench)."""
    vectors, latencies = [], []
    start = time.perf_counter()
    for text in texts:
        t0 = time.perf_counter()
        vectors.append(np.asarray(embed_one(text)).reshape(-1))
        latencies.append((time.perf_counter() - t0) * 1e3)
        if budget_s is not None and time.perf_counter() - start > budget_s:
            break
    return Sample(time.perf_counter() - start, latencies, np.stack(vectors))


def one_by_one(function: Callable[[list[str]], np.ndarray], budget_s: float | None = None
               ) -> Callable[[list[str]], Sample]:
    """An in-process encoder called with one text at a time (batch-1 latency)."""
    return lambda texts: one_at_a_time(lambda text: function([text])[0], texts, budget_s)
