"""A short query through Triton with the encoder backends of another checkout beside this one's.

An experiment, not part of the product or of ``make bench``; its finding is in bench/data/tried.md,
"The encoder step's own work on a short query".  Two ``nexus-sli serve`` on the same repository, one
from this checkout and one from ``--before`` (another checkout with its own venv, e.g. a git worktree
at the earlier commit: ``nexus-sli serve`` installs the python-based backends of the checkout it runs
from).  This checkout's ``EncoderClient`` sends one short query at a time over gRPC to each server and
model in turn, the order rotated from query to query; per round the p50 of each::

    git worktree add /tmp/before 68ed46f   # with a venv: python -m venv /tmp/before/.venv && ... pip install -e
    .venv/bin/python bench/experiments/encoder_shim_served.py /tmp/h7 --before /tmp/before --rounds 8

The repository is the one ``ingraph_tokenizer.py served`` builds (``WORK/served``).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpc

from nexus_sli.client import EncoderClient

MODELS = ("all_minilm_l6_v2_ov_int8", "all_minilm_l6_v2")
QUERY = "how do I reset my password"


def _serve(checkout: Path, repository: Path, port: int) -> subprocess.Popen:
    return subprocess.Popen([str(checkout / ".venv" / "bin" / "nexus-sli"), "serve", "--model-repository",
                             str(repository), "--grpc-port", str(port), "--http-port", str(port + 1),
                             "--metrics-port", str(port + 2), "--gateway-port", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


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
    parser.add_argument("work")
    parser.add_argument("--before", type=Path, required=True, help="the other checkout, with its .venv")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--queries", type=int, default=200, help="queries per round and path")
    parser.add_argument("--port", type=int, default=48181)
    args = parser.parse_args()
    repository = Path(args.work) / "served"
    here = Path(__file__).resolve().parents[2]
    servers = {"before": _serve(args.before, repository, args.port), "now": _serve(here, repository, args.port + 10)}
    try:
        _ready(args.port)
        _ready(args.port + 10)
        clients = {"before": EncoderClient(f"127.0.0.1:{args.port}"),
                   "now": EncoderClient(f"127.0.0.1:{args.port + 10}")}
        paths = {f"{model} {tag}": (client, model) for model in MODELS for tag, client in clients.items()}
        for client, model in paths.values():
            for _ in range(100):
                client.embed([QUERY], model=model)
        p50s = {name: [] for name in paths}
        names = list(paths)
        for _ in range(args.rounds):
            times = {name: [] for name in paths}
            for index in range(args.queries):
                shift = index % len(names)
                for name in names[shift:] + names[:shift]:
                    client, model = paths[name]
                    started = time.perf_counter()
                    client.embed([QUERY], model=model)
                    times[name].append(time.perf_counter() - started)
            for name in paths:
                p50s[name].append(float(np.percentile(times[name], 50)) * 1e3)
    finally:
        for server in servers.values():
            server.terminate()
        for server in servers.values():
            server.wait(60)
    for name, values in p50s.items():
        print(f"{name}: p50 by round {', '.join(f'{v:.3f}' for v in values)} ms; "
              f"median {statistics.median(values):.3f}")
    for model in MODELS:
        saved = [a - b for a, b in zip(p50s[f"{model} before"], p50s[f"{model} now"])]
        print(f"{model}, before minus now, by round: {', '.join(f'{s:+.3f}' for s in saved)} ms; median "
              f"{statistics.median(saved):+.3f}; now lower in {sum(s > 0 for s in saved)}/{len(saved)}")


if __name__ == "__main__":
    main()
