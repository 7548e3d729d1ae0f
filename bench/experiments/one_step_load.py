"""Under concurrent load, does the separate tokenizer step pay for its hop?

An experiment, not part of the product or of ``make bench`` (no test runs it); its findings are in
bench/data/tried.md, "The tokenizer step under concurrent load".  A short query alone is about 1 ms
faster through one python model that tokenizes and runs the encoder graph than through the exported
ensemble (tokenizer step, then the encoder step: tried.md, "The tokenizer inside the graph").  The
ensemble's two steps are two processes, so under load the tokenizer step can tokenize the next
requests while the encoder computes; this measures whether that wins the hop back.

It serves the repository ``ingraph_tokenizer.py served`` builds (``WORK/served``: the two ensembles as
exported and the ``one_step_*`` models beside them) with ``nexus-sli serve``, and for each load (a
number of clients each sending one request at a time, back to back: single short queries, or batches
of 32 texts) runs every model in turn for ``--seconds``, the order rotated from round to round::

    .venv/bin/python bench/experiments/one_step_load.py /tmp/ingraph --rounds 4

It prints, per load and model, the median over rounds of the requests answered per second and of
each round's p50 and p99 latency, and each one-step model's throughput over its ensemble's, paired
round by round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpc

#: (label, clients, texts per request)
LOADS = (("single queries, 4 clients", 4, 1), ("single queries, 16 clients", 16, 1),
         ("batches of 32, 4 clients", 4, 32))
#: each one-step model and the ensemble it replaces
PAIRS = (("one_step_openvino", "all_minilm_l6_v2_ov_int8"), ("one_step_onnxruntime", "all_minilm_l6_v2"))


def _request(texts: list[str]):
    tensor = grpc.InferInput("TEXT", [len(texts), 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[t.encode("utf-8")] for t in texts], dtype=object))
    return [tensor]


def _load(url: str, model: str, clients: int, size: int, texts: list[str], seconds: float) -> dict:
    """``clients`` threads, each with its own connection, sending requests of ``size`` texts back to
    back for ``seconds``: requests answered per second, and the latencies' p50 and p99 (ms)."""
    times, lock, stop = [], threading.Lock(), time.perf_counter() + seconds
    wanted = [grpc.InferRequestedOutput("EMBEDDING")]

    def client(number: int) -> None:
        connection = grpc.InferenceServerClient(url)
        start = number * size
        while time.perf_counter() < stop:
            batch = [texts[(start + i) % len(texts)] for i in range(size)]
            start += size * clients
            began = time.perf_counter()
            connection.infer(model, _request(batch), outputs=wanted)
            with lock:
                times.append(time.perf_counter() - began)

    began = time.perf_counter()
    threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - began
    return {"per_s": len(times) / elapsed, "p50_ms": float(np.percentile(times, 50)) * 1e3,
            "p99_ms": float(np.percentile(times, 99)) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("work")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--port", type=int, default=48121)
    args = parser.parse_args()
    work = Path(args.work)
    setup = json.loads((work / "setup.json").read_text())
    texts = setup["short"]
    models = [m for pair in PAIRS for m in pair]
    server = subprocess.Popen([sys.executable, "-m", "nexus_sli.cli.main", "serve", "--model-repository",
                               str(work / "served"), "--grpc-port", str(args.port), "--http-port",
                               str(args.port + 1), "--metrics-port", str(args.port + 2), "--gateway-port", "0"])
    url = f"127.0.0.1:{args.port}"
    try:
        probe = grpc.InferenceServerClient(url)
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                if all(probe.is_model_ready(m) for m in models):
                    break
            except Exception:  # noqa: BLE001 - not up yet
                pass
            time.sleep(1)
        for model in models:  # warm: every model's shapes
            _load(url, model, 4, 32, texts, 2.0)
        found = {label: {m: [] for m in models} for label, _, _ in LOADS}
        for number in range(args.rounds):
            for label, clients, size in LOADS:
                shift = number % len(models)
                for model in models[shift:] + models[:shift]:
                    found[label][model].append(_load(url, model, clients, size, texts, args.seconds))
    finally:
        server.terminate()
        server.wait(60)
    report(setup, found, args)
    (work / "one_step_load.json").write_text(json.dumps(found, indent=1))


def report(setup: dict, found: dict, args) -> None:
    print(f"\n## {setup['model']} on {setup['cpu']} ({setup['cores']} cores; {setup['cpu_class']}), "
          f"{args.rounds} rounds of {args.seconds:.0f} s per model and load\n")
    print("| load | model | requests/s | p50 ms | p99 ms |\n|---|---|---:|---:|---:|")
    for label, models in found.items():
        for model, rounds in models.items():
            row = {key: statistics.median(r[key] for r in rounds) for key in ("per_s", "p50_ms", "p99_ms")}
            print(f"| {label} | {model} | {row['per_s']:.1f} | {row['p50_ms']:.2f} | {row['p99_ms']:.2f} |")
    print("\n| load | one step / its ensemble, requests/s | rounds | higher in |\n|---|---:|---|---:|")
    for label, models in found.items():
        for one, ensemble in PAIRS:
            ratios = [a["per_s"] / b["per_s"] for a, b in zip(models[one], models[ensemble])]
            print(f"| {label} | {one} / {ensemble}: {statistics.median(ratios):.3f}x | "
                  f"{', '.join(f'{r:.2f}' for r in ratios)} | {sum(r > 1 for r in ratios)}/{len(ratios)} |")


if __name__ == "__main__":
    main()
