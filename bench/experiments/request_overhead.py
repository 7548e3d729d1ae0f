"""Where a single short query's time goes on the served path.

``.venv/bin/python -m nexus_sli.bench.experiments.request_overhead [REPO] [MODEL]``
(default: ``bench/.repo`` and the bench's fp32 model) serves the repository,
sends the bench's short queries one at a time over gRPC with ``EncoderClient``,
and reads Triton's own statistics before and after: per model of the ensemble,
the mean time a request spent queued and computing (input, inference, output),
and the ensemble's whole time inside the server.  The client's p50 minus the
ensemble's time is the client and gRPC; the ensemble's time minus its steps'
is Triton's scheduling between steps.  The same graph run in process on the
same texts (tokenize, encoder, pool: :class:`runners.GraphEncoder`) gives the
serving overhead the speed issue bounds (served p50 minus in-process p50).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from nexus_sli.client import EncoderClient

from ..harness import short_queries
from ..runners import GraphEncoder, ServedFacts, token_counts
from ..served import Server
from ..texts import bench_texts
from . import MODEL, QUERIES, bench_repository, steps_of

PARTS = ("queue", "compute_input", "compute_infer", "compute_output")


def _stats(url: str, names: list[str]) -> dict[str, dict[str, int]]:
    """Cumulative nanoseconds per part, and the success count, per model."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    found = {}
    for name in names:
        stats = client.get_inference_statistics(name, as_json=True)["model_stats"][0]["inference_stats"]
        found[name] = {part: int(stats.get(part, {}).get("ns", 0)) for part in (*PARTS, "success")}
        found[name]["count"] = int(stats.get("success", {}).get("count", 0))
    client.close()
    return found


def _per_request_ms(before: dict, after: dict, name: str, part: str) -> float:
    count = after[name]["count"] - before[name]["count"]
    return (after[name][part] - before[name][part]) / max(count, 1) / 1e6


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    repo = Path(argv[0]) if argv else bench_repository()
    model = argv[1] if len(argv) > 1 else MODEL
    facts = ServedFacts.read(repo, model)
    texts = bench_texts()
    queries = short_queries(texts, token_counts(facts, texts), QUERIES)
    names = [model, *steps_of(repo, model)]
    in_process = GraphEncoder.for_model(repo, facts)
    with Server(repo) as server, EncoderClient(server.url("grpc"), model=model) as client:
        for text in queries[:20]:  # warm-up
            client.embed(text)
            in_process([text])
        before = _stats(server.url("grpc"), names)
        served, local = [], []
        for text in queries:  # interleaved: both see the same moments of the machine
            start = time.perf_counter()
            client.embed(text)
            served.append((time.perf_counter() - start) * 1e3)
            start = time.perf_counter()
            in_process([text])
            local.append((time.perf_counter() - start) * 1e3)
        after = _stats(server.url("grpc"), names)
    served_p50, local_p50 = float(np.percentile(served, 50)), float(np.percentile(local, 50))
    ensemble = _per_request_ms(before, after, model, "success")
    steps = {name: {part: _per_request_ms(before, after, name, part) for part in PARTS} for name in names[1:]}
    inside_steps = sum(sum(parts.values()) for parts in steps.values())
    print(f"{len(queries)} short queries, one at a time, gRPC ({repo}, {model}); means per request, ms:")
    print(f"  client p50 {served_p50:.2f} (p99 {np.percentile(served, 99):.2f}); "
          f"same graph in process p50 {local_p50:.2f}: serving overhead {served_p50 - local_p50:.2f}")
    print(f"  inside Triton (the ensemble): {ensemble:.2f}; client + gRPC: {served_p50 - ensemble:.2f} (against p50)")
    for name, parts in steps.items():
        print(f"  {name}: " + ", ".join(f"{part} {ms:.3f}" for part, ms in parts.items()))
    print(f"  between steps (Triton's ensemble scheduling, tensor copies): {ensemble - inside_steps:.2f}")


if __name__ == "__main__":
    main()
