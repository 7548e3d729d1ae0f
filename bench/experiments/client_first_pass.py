"""What the client's first pass paid for ``time.sleep(0)``: one short query at a time, with and without it.

An experiment, not part of the product or of ``make bench``; its finding is in bench/data/tried.md,
"The client's first pass".  ``EncoderClient`` used to call ``time.sleep(pause)`` before every pass over
the replicas, the first one included, with a pause of 0.  It serves the repository
``ingraph_tokenizer.py served`` builds (``WORK/served``) and times ``EncoderClient.embed`` on one short
query over gRPC as the client now sends it, and with a ``time.sleep(0)`` in front of each call (what
the first pass did), the two in turn query by query, the order reversed every other query::

    .venv/bin/python bench/experiments/client_first_pass.py /tmp/ingraph --rounds 8
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpc

from nexus_sli.client import EncoderClient

MODEL = "all_minilm_l6_v2_ov_int8"
QUERY = "how do I reset my password"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("work")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--queries", type=int, default=300, help="queries per round and path")
    parser.add_argument("--port", type=int, default=48171)
    args = parser.parse_args()
    server = subprocess.Popen([sys.executable, "-m", "nexus_sli.cli.main", "serve", "--model-repository",
                               str(Path(args.work) / "served"), "--grpc-port", str(args.port), "--http-port",
                               str(args.port + 1), "--metrics-port", str(args.port + 2), "--gateway-port", "0"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        probe = grpc.InferenceServerClient(f"127.0.0.1:{args.port}")
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                if probe.is_model_ready(MODEL):
                    break
            except Exception:  # noqa: BLE001, S110 - not up yet
                pass
            time.sleep(1)
        client = EncoderClient(f"127.0.0.1:{args.port}", protocol="grpc")

        def at_once():
            return client.embed([QUERY], model=MODEL)

        def sleep_first():
            time.sleep(0)
            return client.embed([QUERY], model=MODEL)

        paths = {"at once": at_once, "sleep(0) first": sleep_first}
        for _ in range(200):
            at_once()
        p50s = {name: [] for name in paths}
        for _ in range(args.rounds):
            times = {name: [] for name in paths}
            for index in range(args.queries):
                order = list(paths.items())
                for name, send in order[::-1] if index % 2 else order:
                    started = time.perf_counter()
                    send()
                    times[name].append(time.perf_counter() - started)
            for name in paths:
                p50s[name].append(float(np.percentile(times[name], 50)) * 1e3)
    finally:
        server.terminate()
        server.wait(60)
    for name, values in p50s.items():
        print(f"{name}: p50 by round {', '.join(f'{v:.3f}' for v in values)} ms; "
              f"median {statistics.median(values):.3f}")
    differences = [a - b for a, b in zip(p50s["sleep(0) first"], p50s["at once"])]
    print(f"sleep(0) first minus at once, by round: {', '.join(f'{d:+.3f}' for d in differences)} ms; median "
          f"{statistics.median(differences):+.3f}; at once lower in "
          f"{sum(d > 0 for d in differences)}/{len(differences)}")


if __name__ == "__main__":
    main()
