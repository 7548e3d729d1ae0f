"""Load: many concurrent gRPC clients against the served default model.

Marked ``load`` and skipped by ``make test``; run it with ``make test-load``
(``pytest -m load tests/test_load.py``).  64 clients, each its own
``EncoderClient`` (its own gRPC channel), send 1-4 texts per request for 60 s.
Every answer is compared with sentence-transformers' embedding of the request's
own texts, so an answer that went to the wrong request (cross-talk between
batched requests) fails the test.  The server's RSS (tritonserver and its
python-backend processes) is sampled throughout.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
from sentence_transformers import SentenceTransformer

from nexus_sli.client import EncoderClient
from nexus_sli.exporter.serving import server as serve
from nexus_sli.exporter.export.pipeline import ExportOptions, run_export
from nexus_sli.exporter.export.source import resolve_model
from nexus_sli.exporter.export.validate import validation_texts
from nexus_sli.bench.served import free_ports

pytestmark = [pytest.mark.load, pytest.mark.timeout(1200)]

NAME = "all_minilm_l6_v2"
CLIENTS = 64
DURATION_S = 60.0
WINDOW_S = 20.0  # RSS is compared between the first and the last this many seconds
MIN_COSINE = 0.9999  # as the serving tests: served fp32 against sentence-transformers


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("load-repo")
    run_export(ExportOptions(out=repo))
    http, grpc, metrics = free_ports(3)
    with open(repo.parent / "server.log", "w") as log:  # the server's own output, kept out of the report
        process = serve.start(repo, http, grpc, metrics, stdout=log, stderr=subprocess.STDOUT)
    yield {"process": process, "grpc": f"127.0.0.1:{grpc}"}
    serve.stop(process)


@pytest.fixture(scope="module")
def expected():
    """sentence-transformers' embedding of every text the clients send."""
    texts = validation_texts()
    reference = SentenceTransformer(str(resolve_model(None).path), device="cpu")
    return dict(zip(texts, reference.encode(texts, normalize_embeddings=True, batch_size=64)))


def _server_rss(pid: int) -> int:
    process = psutil.Process(pid)
    total = process.memory_info().rss
    for child in process.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


class _Client(threading.Thread):
    """One client: requests of 1-4 texts until told to stop; checks every answer."""

    def __init__(self, number: int, url: str, expected: dict, stop: threading.Event):
        super().__init__(daemon=True)
        self.rng, self.url, self.expected, self.stop = random.Random(number), url, expected, stop
        self.texts = list(expected)
        self.latencies: list[float] = []
        self.texts_sent = 0
        self.failures: list[str] = []
        self.mismatches: list[str] = []

    def run(self):
        with EncoderClient(self.url, protocol="grpc") as client:
            while not self.stop.is_set():
                batch = self.rng.sample(self.texts, self.rng.randint(1, 4))
                started = time.perf_counter()
                try:
                    vectors = client.embed(batch, model=NAME)
                except Exception as exc:  # noqa: BLE001 - every failure is counted and shown
                    self.failures.append(f"{type(exc).__name__}: {exc}")
                    continue
                self.latencies.append(time.perf_counter() - started)
                self.texts_sent += len(batch)
                for text, vector in zip(batch, vectors):
                    cosine = float(np.dot(vector, self.expected[text]) / np.linalg.norm(vector))
                    if cosine < MIN_COSINE:
                        self.mismatches.append(f"{text[:40]!r}: cosine {cosine:.6f} to its own embedding")


def _sample_rss(pid: int, stop: threading.Event, samples: list, interval: float = 0.5):
    start = time.monotonic()
    while not stop.wait(interval):
        samples.append((time.monotonic() - start, _server_rss(pid)))


def _encoder_counts(url: str) -> tuple[int, int]:
    """(requests, executions) of the encoder so far, from Triton's statistics API."""
    with grpcclient.InferenceServerClient(url) as client:
        stats = client.get_inference_statistics(f"{NAME}_encoder", as_json=True)["model_stats"][0]
    return int(stats.get("inference_count", 0)), int(stats.get("execution_count", 0))


def test_64_grpc_clients_for_60_seconds(server, expected, tmp_path):
    pid = server["process"].pid
    with EncoderClient(server["grpc"]) as warm:  # every text once: the shapes the load will see
        warm.embed(list(expected), model=NAME)
    stop, rss_stop, samples = threading.Event(), threading.Event(), []
    clients = [_Client(i, server["grpc"], expected, stop) for i in range(CLIENTS)]
    sampler = threading.Thread(target=_sample_rss, args=(pid, rss_stop, samples), daemon=True)
    sampler.start()
    counts_before = _encoder_counts(server["grpc"])
    started = time.monotonic()
    for client in clients:
        client.start()
    time.sleep(DURATION_S)
    stop.set()
    for client in clients:
        client.join(120)
    elapsed = time.monotonic() - started
    rss_stop.set()
    sampler.join()
    requests, executions = (a - b for a, b in zip(_encoder_counts(server["grpc"]), counts_before))

    latencies = np.array([t for c in clients for t in c.latencies])
    failures = [f for c in clients for f in c.failures]
    mismatches = [m for c in clients for m in c.mismatches]
    first = np.mean([rss for t, rss in samples if t <= WINDOW_S])
    last = np.mean([rss for t, rss in samples if t >= samples[-1][0] - WINDOW_S])
    report = {
        "clients": CLIENTS, "seconds": round(elapsed, 1), "requests": int(latencies.size),
        "texts": sum(c.texts_sent for c in clients), "failed_requests": len(failures),
        "mismatched_answers": len(mismatches),
        "requests_per_s": round(latencies.size / elapsed, 1),
        "texts_per_s": round(sum(c.texts_sent for c in clients) / elapsed, 1),
        "latency_ms": {"p50": round(float(np.percentile(latencies, 50)) * 1e3, 1),
                       "p99": round(float(np.percentile(latencies, 99)) * 1e3, 1),
                       "max": round(float(latencies.max()) * 1e3, 1)},
        "encoder_requests_per_execution": round(requests / max(executions, 1), 1),
        "server_rss_mb": {"first_20s": round(first / 2**20, 1), "last_20s": round(last / 2**20, 1),
                          "growth": round(float(last / first - 1), 4)},
        "cpus": os.cpu_count(),
    }
    path = Path(os.environ.get("NEXUS_SLI_LOAD_REPORT") or tmp_path / "load.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nload report ({path}):\n{json.dumps(report, indent=2)}")

    assert not [c for c in clients if c.is_alive()], "a client still waits on its request 120 s after the stop"
    assert not failures, f"{len(failures)} failed requests, e.g. {failures[:3]}"
    assert not mismatches, f"{len(mismatches)} answers are not their own text's embedding, e.g. {mismatches[:3]}"
    assert all(c.latencies for c in clients), "every client got answers"
    assert last < first * 1.10, f"server RSS grew {last / first - 1:.1%} from the first to the last {WINDOW_S:.0f} s"
