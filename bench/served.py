"""The served path: the real Triton server on free loopback ports, and the three
ways clients use it (batches of 32, 16 concurrent single-text clients, sequential
single queries), through the project's own ``EncoderClient`` over gRPC / HTTP,
and through the HTTP gateway: OpenAI's API with the official ``openai`` SDK, and its
routes from a plain HTTP client."""

from __future__ import annotations

import abc
import base64
import http.client
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from nexus_sli.client import EncoderClient
from nexus_sli.exporter.serving import server as serve

from .machine import tree_rss_bytes
from .measure import GATEWAY_PROTOCOL, OPENAI_PLAIN_PROTOCOL, TEI_PROTOCOL, Sample, one_at_a_time

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


class Gateway:
    """``with Gateway(triton_grpc_url) as gateway:`` ``nexus-sli gateway`` on a free loopback
    port, as a user runs it, stopped on exit.  ``args``: more options of the command;
    ``log``: where its output goes (kept), else a temporary file removed on exit.
    The tests start their gateways with it too (tests/test_gateway.py)."""

    READY = "gateway is ready"

    def __init__(self, triton: str, *args: str, timeout_s: float = 60.0, log: Path | None = None):
        self.triton, self.args, self.timeout_s = triton, args, timeout_s
        self.port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "Gateway":
        return self.start()

    def start(self) -> "Gateway":
        """Started and ready (its ready line printed); RuntimeError with its output otherwise."""
        if self.log is None:
            with tempfile.NamedTemporaryFile(prefix="nexus-sli-bench-gateway-", suffix=".log", delete=False) as f:
                self.log, self._temporary = Path(f.name), True
        else:
            self._temporary = False
        with open(self.log, "w") as out:
            self.process = subprocess.Popen([sys.executable, "-m", "nexus_sli.cli.main", "gateway", "--triton",
                                             self.triton, "--port", str(self.port), *self.args], stdout=out,
                                            stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.timeout_s
        while self.READY not in self.output():
            if self.process.poll() is not None or time.monotonic() > deadline:
                text = self.output()
                code = self.process.poll()
                self.stop()
                raise RuntimeError(f"the gateway did not start (exit code {code}): {text}")
            time.sleep(0.1)
        return self

    def output(self) -> str:
        return self.log.read_text() if self.log else ""

    def stop(self) -> int | None:
        """Stopped as a process manager does (SIGTERM); its exit code."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(30)
        if self.log is not None and self._temporary:
            self.log.unlink(missing_ok=True)
        return None if self.process is None else self.process.returncode

    def __exit__(self, *exc) -> None:
        self.stop()


class ServedEmbedder:
    """One model over one protocol; keeps a client, as a user would, for batch and sequential calls."""

    def __init__(self, url: str, protocol: str, model: str):
        self.url, self.protocol, self.model = url, protocol, model
        self.client = self.connect()

    def connect(self):
        """A client of its own, the model config read once, outside any timing."""
        client = EncoderClient(self.url, protocol=self.protocol)
        client.info(self.model)
        return client

    def embed_with(self, client, texts: list[str]) -> np.ndarray:
        return client.embed(texts, model=self.model)

    def embed(self, texts: list[str]) -> np.ndarray:
        """One request of ``texts`` on the kept client."""
        return self.embed_with(self.client, texts)

    def close(self) -> None:
        self.client.close()

    def batches(self, texts: list[str], batch_size: int = BATCH_SIZE) -> Sample:
        """Client batches of ``batch_size``, in the order given; one request each."""
        vectors, latencies = [], []
        start = time.perf_counter()
        for i in range(0, len(texts), batch_size):
            t0 = time.perf_counter()
            vectors.append(self.embed(texts[i:i + batch_size]))
            latencies.append((time.perf_counter() - t0) * 1e3)
        return Sample(time.perf_counter() - start, latencies, np.concatenate(vectors))

    def sequential(self, texts: list[str], budget_s: float | None = None) -> Sample:
        """One text per request, each sent after the previous answer came back."""
        return one_at_a_time(lambda text: self.embed([text])[0], texts, budget_s)

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
            client = self.served.connect()
        except BaseException as exc:  # reported after the run; the barrier must still be reached
            self.errors.append(exc)
            client = None
        self.ready.wait()
        if client is None:
            return
        try:
            while (index := self._take()) is not None:
                t0 = time.perf_counter()
                self.vectors[index] = self.served.embed_with(client, [self.texts[index]])[0]
                self.latencies[slot].append((time.perf_counter() - t0) * 1e3)
        except BaseException as exc:
            self.errors.append(exc)
        finally:
            client.close()


class GatewayEmbedder(ServedEmbedder):
    """The same calls through the gateway's ``/v1/embeddings`` with the official ``openai`` SDK,
    as an application that embeds through OpenAI's API does (its default: base64 vectors)."""

    def connect(self):
        import openai

        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)
        client.models.list()  # connected, outside any timing
        return client

    def embed_with(self, client, texts: list[str]) -> np.ndarray:
        response = client.embeddings.create(model=self.model, input=texts)
        return np.array([item.embedding for item in response.data], dtype=np.float32)


class PlainHttpEmbedder(ServedEmbedder, abc.ABC):
    """A gateway route called with JSON in and out over one kept connection, the standard library's,
    so that the figures are the gateway's more than a client library's.  A route's subclass says
    where it posts (``ROUTE``), its body and how its answer holds the vectors."""

    ROUTE = ""

    def connect(self):
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        client = http.client.HTTPConnection(host, int(port), timeout=60.0)
        client.request("GET", "/health")  # connected, outside any timing
        _answer(client)
        return client

    @abc.abstractmethod
    def body(self, texts: list[str]) -> dict:
        """The JSON the route takes for ``texts``."""

    @abc.abstractmethod
    def vectors(self, answer: bytes) -> np.ndarray:
        """The vectors ``[n, dim]`` in the route's answer."""

    def embed_with(self, client, texts: list[str]) -> np.ndarray:
        body = json.dumps(self.body(texts))
        try:
            client.request("POST", self.ROUTE, body, {"Content-Type": "application/json"})
            answer = _answer(client)
        except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
            # the server closes a connection left idle past its keep-alive (while the other paths ran):
            # sent again on a new one, as a pooling client does
            client.close()
            client.request("POST", self.ROUTE, body, {"Content-Type": "application/json"})
            answer = _answer(client)
        return self.vectors(answer)


class TeiEmbedder(PlainHttpEmbedder):
    """The same calls through the gateway's TEI route, ``POST /embed``; the request names the model,
    as the route allows."""

    ROUTE = "/embed"

    def body(self, texts: list[str]) -> dict:
        return {"inputs": texts, "model": self.model}

    def vectors(self, answer: bytes) -> np.ndarray:
        return np.array(json.loads(answer), dtype=np.float32)


class OpenAIPlainEmbedder(PlainHttpEmbedder):
    """The same calls through the gateway's ``/v1/embeddings`` with the JSON body the ``openai`` SDK
    sends (base64 vectors, its default), from a plain HTTP client: beside :class:`GatewayEmbedder`'s
    figures on the same route, what the SDK's own work in the caller costs."""

    ROUTE = "/v1/embeddings"

    def body(self, texts: list[str]) -> dict:
        return {"model": self.model, "input": texts, "encoding_format": "base64"}

    def vectors(self, answer: bytes) -> np.ndarray:
        data = sorted(json.loads(answer)["data"], key=lambda item: item["index"])
        return np.stack([np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4") for item in data])


def _answer(connection: http.client.HTTPConnection) -> bytes:
    """The body of the connection's answer; an error status raised with it."""
    response = connection.getresponse()
    body = response.read()
    if response.status != 200:
        raise RuntimeError(f"the gateway answered {response.status}: {body[:500]!r}")
    return body


#: the embedder of each gateway route the bench times, by its rows' protocol
GATEWAY_EMBEDDERS = {GATEWAY_PROTOCOL: GatewayEmbedder, TEI_PROTOCOL: TeiEmbedder,
                     OPENAI_PLAIN_PROTOCOL: OpenAIPlainEmbedder}
