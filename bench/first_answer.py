"""How long a new user waits: ``nexus-sli serve`` on a folder with no model and an empty layer cache, from the
command's start to its first OpenAI answer; then the background search under load from both APIs (the
official ``openai`` SDK through the gateway, and gRPC), the calls that failed while its winner was swapped
in, and the server's memory before and during the swap (``make bench FIRST_ANSWER=1``).

    python -m nexus_sli.bench.first_answer [--out bench/results/first_answer.json] [serve's options ...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .cpu_classes import cpu_class
from .machine import checkout, machine_info, tree_rss_bytes
from .served import free_ports

#: What serve's log says when the search has ended, whichever way (exporter/serving/search.py).
SEARCH_ENDED = re.compile(r"nexus-sli: (now serving .+, the search's winner|the search kept|the background search)")


class Load:
    """Clients of both APIs calling in a loop, each call counted as answered or failed."""

    def __init__(self, gateway: str, grpc: str, model: str, clients: int = 2):
        self.gateway, self.grpc, self.model = gateway, grpc, model
        self.answered, self.failed, self.errors = {"openai": 0, "grpc": 0}, {"openai": 0, "grpc": 0}, []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=loop, daemon=True)
                         for loop in (self._openai, self._grpc) for _ in range(clients)]

    def _count(self, api: str, call) -> None:
        while not self._stop.is_set():
            try:
                call()
                self.answered[api] += 1
            except Exception as exc:  # noqa: BLE001 - a failed call is what this counts
                self.failed[api] += 1
                self.errors.append(f"{api}: {exc!r}"[:300])

    def _openai(self) -> None:
        import openai

        client = openai.OpenAI(base_url=self.gateway, api_key="unused", max_retries=0, timeout=60)
        self._count("openai", lambda: client.embeddings.create(model=self.model, input=["a query", "a document"]))

    def _grpc(self) -> None:
        from nexus_sli.client import EncoderClient

        with EncoderClient(self.grpc, model=self.model) as client:
            self._count("grpc", lambda: client.embed(["a query", "a document"]))

    def __enter__(self) -> "Load":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)


def first_answer(gateway: str, process: subprocess.Popen, timeout: float) -> tuple[float, str]:
    """When the gateway gave its first embedding (``time.monotonic()``), and the model's name (the first the
    gateway lists, as a new user would find it)."""
    import openai

    client = openai.OpenAI(base_url=gateway, api_key="unused", max_retries=0, timeout=10)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"serve exited with code {process.returncode} before answering")
        try:
            model = client.models.list().data[0].id
            client.embeddings.create(model=model, input=["hello"])
            return time.monotonic(), model
        except (openai.OpenAIError, IndexError):
            time.sleep(0.1)
    raise RuntimeError(f"no answer within {timeout:.0f} s")


def run(serve_options: list[str], search_timeout: float) -> dict:
    http, grpc, metrics, port = free_ports(4)
    gateway = f"http://127.0.0.1:{port}/v1"
    with tempfile.TemporaryDirectory(prefix="nexus-sli-first-") as scratch:
        repository, log = Path(scratch) / "repo", Path(scratch) / "serve.log"
        env = {**os.environ, "NEXUS_SLI_CACHE_DIR": str(Path(scratch) / "empty-cache")}
        command = [sys.executable, "-m", "nexus_sli.cli.main", "serve", "--model-repository", str(repository),
                   "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
                   "--gateway-port", str(port), *serve_options]
        started = time.monotonic()
        with open(log, "w") as out:
            process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        try:
            answered_at, model_name = first_answer(gateway, process, timeout=600)
            rss, swap_rss = [], []
            with Load(gateway, f"127.0.0.1:{grpc}", model_name) as load:
                while time.monotonic() - started < search_timeout and not SEARCH_ENDED.search(log.read_text()):
                    sample = tree_rss_bytes(_server_pid(process.pid))
                    (swap_rss if "swapping in" in log.read_text() else rss).append(sample)
                    time.sleep(0.25)
                time.sleep(3)  # calls after the swap count too
            ended = SEARCH_ENDED.search(log.read_text())
            searched_s = time.monotonic() - answered_at
        finally:  # Ctrl-C to its group, as a terminal sends it: serve, Triton, the gateway, the search
            os.killpg(process.pid, signal.SIGINT)
            process.wait(90)
        text = log.read_text()
    return {"model": model_name, "first_answer_s": round(answered_at - started, 1), "search_ended": ended.group(1) if ended else None,
            "search_s_after_first_answer": round(searched_s, 1), "answered": load.answered, "failed": load.failed,
            "errors": load.errors[:5], "swapped": "swapping in" in text,
            "server_rss_mb_before_swap": round(max(rss, default=0) / 2**20),
            "server_rss_mb_peak_during_swap": round(max(swap_rss, default=0) / 2**20),
            "served_after": re.findall(r"nexus-sli: now serving (.+), the search's winner", text)[-1:]}


def _server_pid(serve_pid: int) -> int:
    """The ``tritonserver`` child of ``nexus-sli serve`` (its own pid until it has started one)."""
    import psutil

    try:
        children = psutil.Process(serve_pid).children()
    except psutil.Error:
        return serve_pid
    return next((c.pid for c in children if "tritonserver" in c.name()), serve_pid)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results/first_answer.json")
    parser.add_argument("--search-timeout", type=float, default=1800)
    args, serve_options = parser.parse_known_args(argv)
    machine = machine_info()
    result = {"command": " ".join(["python -m nexus_sli.bench.first_answer", *serve_options]),
              "machine": {**machine, "cpu_class": cpu_class(machine["flags"])}, "checkout": checkout(),
              "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              **run(serve_options, args.search_timeout)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("machine", "checkout")}, indent=1))
    return 0 if not sum(result["failed"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
