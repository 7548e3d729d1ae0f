"""A short query through Triton, each ensemble's steps joined in one process or separate, side by side.

An experiment, not part of the product or of ``make bench``; its finding is in bench/data/tried.md,
"The ensemble's steps joined in one process".  Two ``nexus-sli serve`` of this checkout on the same
repository at once, one with ``--separate-steps`` (the ensembles as exported), one as by default (each
CPU ensemble's steps in one process).  ``EncoderClient`` sends one short query at a time over gRPC to
each server and model in turn, the order rotated from query to query; per round the p50 of each.  Then,
per round, 16 clients at once send single queries to each server in turn for ``--seconds``: the requests
answered per second::

    .venv/bin/python bench/experiments/joined_steps_served.py REPOSITORY --rounds 8

REPOSITORY: the bench's (bench/.exported/repository), or any holding the two ``MODELS``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpc

from nexus_sli.client import EncoderClient

MODELS = ("all_minilm_l6_v2_ov_int8", "all_minilm_l6_v2")
QUERY = "how do I reset my password"
#: a query answered slower than this waited on something (Triton's batcher idles 500 ms)
STALL_S = 0.1


def _serve(repository: Path, port: int, *flags: str) -> subprocess.Popen:
    checkout = Path(__file__).resolve().parents[2]
    return subprocess.Popen([str(checkout / ".venv" / "bin" / "nexus-sli"), "serve", "--model-repository",
                             str(repository), "--grpc-port", str(port), "--http-port", str(port + 1),
                             "--metrics-port", str(port + 2), "--gateway-port", "0", *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _load(url: str, model: str, seconds: float, clients: int = 16) -> float:
    """Requests answered per second, ``clients`` each sending one short query at a time for ``seconds``."""
    answered, stop = [], time.perf_counter() + seconds

    def client() -> None:
        with EncoderClient(url) as connection:
            count = 0
            while time.perf_counter() < stop:
                connection.embed([QUERY], model=model)
                count += 1
            answered.append(count)

    began = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(answered) / (time.perf_counter() - began)


def _ready(port: int) -> None:
    probe, deadline = grpc.InferenceServerClient(f"127.0.0.1:{port}"), time.time() + 300
    while time.time() < deadline:
        try:
            if all(probe.is_model_ready(m) for m in MODELS):
                return
        except Exception:  # noqa: BLE001, S110 - not up yet
            pass
        time.sleep(1)
    raise TimeoutError(f"the server on port {port} did not get ready")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("repository", type=Path)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=5.0, help="of load per round, server and model")
    parser.add_argument("--queries", type=int, default=200, help="queries per round and path")
    parser.add_argument("--port", type=int, default=48181)
    args = parser.parse_args()
    servers = {"before": _serve(args.repository, args.port, "--separate-steps"),
               "now": _serve(args.repository, args.port + 10)}
    try:
        _ready(args.port)
        _ready(args.port + 10)
        urls = {"before": f"127.0.0.1:{args.port}", "now": f"127.0.0.1:{args.port + 10}"}
        paths = {f"{model} {tag}": (EncoderClient(url), model, url) for model in MODELS for tag, url in urls.items()}
        for client, model, _ in paths.values():
            for _ in range(100):
                client.embed([QUERY], model=model)
        p50s = {name: [] for name in paths}
        rates = {name: [] for name in paths}
        stalls = dict.fromkeys(paths, 0)
        names = list(paths)
        for number in range(args.rounds):
            times = {name: [] for name in paths}
            for index in range(args.queries):
                shift = index % len(names)
                for name in names[shift:] + names[:shift]:
                    client, model, _ = paths[name]
                    started = time.perf_counter()
                    client.embed([QUERY], model=model)
                    times[name].append(time.perf_counter() - started)
            for name in paths:
                p50s[name].append(float(np.percentile(times[name], 50)) * 1e3)
                stalls[name] += sum(t > STALL_S for t in times[name])
            shift = number % len(names)
            for name in names[shift:] + names[:shift]:
                rates[name].append(_load(paths[name][2], paths[name][1], args.seconds))
    finally:
        for server in servers.values():
            server.terminate()
        for server in servers.values():
            server.wait(60)
    for name, values in p50s.items():  # "before": separate steps, "now": joined
        print(f"{name}: p50 by round {', '.join(f'{v:.3f}' for v in values)} ms; "
              f"median {statistics.median(values):.3f}; {stalls[name]} of {args.rounds * args.queries} over "
              f"{STALL_S * 1e3:.0f} ms")
    for model in MODELS:
        saved = [a - b for a, b in zip(p50s[f"{model} before"], p50s[f"{model} now"])]
        print(f"{model}, separate minus joined, by round: {', '.join(f'{s:+.3f}' for s in saved)} ms; median "
              f"{statistics.median(saved):+.3f}; joined lower in {sum(s > 0 for s in saved)}/{len(saved)}")
        ratios = [b / a for a, b in zip(rates[f"{model} before"], rates[f"{model} now"])]
        print(f"{model}, 16 clients: requests/s separate {statistics.median(rates[f'{model} before']):.1f}, "
              f"joined {statistics.median(rates[f'{model} now']):.1f}; joined over separate by round "
              f"{', '.join(f'{r:.2f}' for r in ratios)}; median {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
