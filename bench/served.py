"""The served path: the real Triton server on free loopback ports, and the three
ways clients use it (batches of 32, 16 concurrent single-text clients, sequential
single queries), all through the project's own ``EncoderClient``."""

from __future__ import annotations

import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from nexus_sli.client import EncoderClient
from nexus_sli.exporter.serving import server as serve

from .machine import tree_rss_bytes
from .measure import Sample, one_at_a_time

BATCH_SIZE = 32
CONCURRENT_CLIENTS = 16
PROTOCOLS = ("grpc", "http")


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


class Server:
    """``with Server(repo) as server:`` Triton on loopback, stopped on exit.  Its log goes
    to a temporary file that is kept (and named in the error) only when start-up fails."""

    def __init__(self, repository: Path):
        self.repository = Path(repository)
        self.process: subprocess.Popen | None = None
        self.ports: dict[str, int] = {}

    def __enter__(self) -> "Server":
        http, grpc, metrics = free_ports(3)
        self.ports = {"http": http, "grpc": grpc}
        self._log = tempfile.NamedTemporaryFile(prefix="nexus-sli-bench-triton-", suffix=".log", delete=False)
        try:
            self.process = serve.start(self.repository, http, grpc, metrics, stdout=self._log,
                                       stderr=subprocess.STDOUT)
        except serve.ServerError as exc:
            self._log.close()
            raise serve.ServerError(f"{exc} (server log: {self._log.name})") from exc
        return self

    def __exit__(self, *exc) -> None:
        if self.process is not None:
            serve.stop(self.process)
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)

    def url(self, protocol: str) -> str:
        return f"127.0.0.1:{self.ports[protocol]}"

    def rss_bytes(self) -> int:
        return tree_rss_bytes(self.process.pid) if self.process else 0


class RssSampler:
    """Samples the server's process-tree RSS in the background while :meth:`active` is on."""

    def __init__(self, server: Server, interval_s: float = 0.25):
        self.server, self.interval_s = server, interval_s
        self.samples: list[int] = []
        self._on, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self._on.wait(0.1):
                self.samples.append(self.server.rss_bytes())
                time.sleep(self.interval_s)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._on.set()
        self._thread.join()

    def active(self, on: bool) -> None:
        (self._on.set if on else self._on.clear)()


class ServedEmbedder:
    """One model over one protocol; keeps a client, as a user would, for batch and sequential calls."""

    def __init__(self, url: str, protocol: str, model: str):
        self.url, self.protocol, self.model = url, protocol, model
        self.client = EncoderClient(url, protocol=protocol)
        self.client.info(model)  # reads the model config once, outside any timing

    def close(self) -> None:
        self.client.close()

    def batches(self, texts: list[str], batch_size: int = BATCH_SIZE) -> Sample:
        """Client batches of ``batch_size``, in the order given; one request each."""
        vectors, latencies = [], []
        start = time.perf_counter()
        for i in range(0, len(texts), batch_size):
            t0 = time.perf_counter()
            vectors.append(self.client.embed(texts[i:i + batch_size], model=self.model))
            latencies.append((time.perf_counter() - t0) * 1e3)
        return Sample(time.perf_counter() - start, latencies, np.concatenate(vectors))

    def sequential(self, texts: list[str], budget_s: float | None = None) -> Sample:
        """One text per request, each sent after the previous answer came back."""
        return one_at_a_time(lambda text: self.client.embed([text], model=self.model)[0], texts, budget_s)

    def concurrent(self, texts: list[str], clients: int = CONCURRENT_CLIENTS) -> Sample:
        """``clients`` threads, each with its own client, sending one text per request
        until all texts are done.  Clients connect before the clock starts."""
        run = _ConcurrentRun(self, texts, clients)
        threads = [threading.Thread(target=run.worker, args=(slot,), daemon=True) for slot in range(clients)]
        for thread in threads:
            thread.start()
        run.ready.wait()
        start = time.perf_counter()
        for thread in threads:
            thread.join()
        seconds = time.perf_counter() - start
        if run.errors:
            raise run.errors[0]
        return Sample(seconds, [x for per_client in run.latencies for x in per_client], np.stack(run.vectors))


class _ConcurrentRun:
    """Shared state of one concurrent run: the next text to send, and what came back."""

    def __init__(self, served: ServedEmbedder, texts: list[str], clients: int):
        self.served, self.texts = served, texts
        self.vectors: list[np.ndarray | None] = [None] * len(texts)
        self.latencies: list[list[float]] = [[] for _ in range(clients)]
        self.errors: list[BaseException] = []
        self.ready = threading.Barrier(clients + 1)
        self._next = iter(range(len(texts)))
        self._lock = threading.Lock()

    def _take(self) -> int | None:
        with self._lock:
            return next(self._next, None)

    def worker(self, slot: int) -> None:
        try:
            client = EncoderClient(self.served.url, protocol=self.served.protocol)
            client.info(self.served.model)
        except BaseException as exc:  # reported after the run; the barrier must still be reached
            self.errors.append(exc)
            client = None
        self.ready.wait()
        if client is None:
            return
        try:
            while (index := self._take()) is not None:
                t0 = time.perf_counter()
                self.vectors[index] = client.embed([self.texts[index]], model=self.served.model)[0]
                self.latencies[slot].append((time.perf_counter() - t0) * 1e3)
        except BaseException as exc:
            self.errors.append(exc)
        finally:
            client.close()
