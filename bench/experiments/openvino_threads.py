"""Does a thread setting of the OpenVINO encoder shorten a single query's tail?

``.venv/bin/python -m nexus_sli.bench.experiments.openvino_threads [REPO] [MODEL] [ROUNDS]``
(default: ``bench/.repo``, the bench's OpenVINO bf16 model, 6 rounds) compiles the
exported encoder once per setting below, with the properties the served backend
uses (``openvino_properties.compile_properties``) plus the setting, and runs the
bench's 150 short queries twice per round through each, settings in alternating
order per round.  It prints each setting's p50 and p99 (medians over the rounds)
and every round's p99 / p50: the single-query target asks p99 <= 1.5x p50, and
this is the graph with no server in the way.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from nexus_sli.exporter.serving.backends.openvino_properties import compile_properties
from nexus_sli.exporter.triton import config as triton_config

from ..harness import short_queries
from ..runners import ServedFacts, _feeds, token_counts
from ..texts import bench_texts
from . import MODEL, QUERIES, bench_repository

#: what each setting adds to the served properties (the served backend compiles with the first)
SETTINGS = {
    "as served (latency hint)": {},
    "one inference thread": {"INFERENCE_NUM_THREADS": 1},
    "threads pinned to cores": {"ENABLE_CPU_PINNING": True},
    "threads not pinned": {"ENABLE_CPU_PINNING": False},
}


def main(argv: list[str] | None = None) -> None:
    import openvino as ov

    argv = sys.argv[1:] if argv is None else argv
    repo = Path(argv[0]) if argv else bench_repository()
    model = argv[1] if len(argv) > 1 else f"{MODEL}_ov_bf16"
    rounds = int(argv[2]) if len(argv) > 2 else 6
    facts = ServedFacts.read(repo, model)
    texts = bench_texts()
    queries = short_queries(texts, token_counts(facts, texts), QUERIES)
    config = triton_config.read(repo / f"{model}_encoder" / "config.pbtxt")
    params = {k: v.string_value for k, v in config.parameters.items()}
    graph = repo / f"{model}_encoder" / "1" / (config.default_model_filename or "model.onnx")
    core = ov.Core()
    network = core.read_model(str(graph))
    inputs = [port.get_any_name() for port in network.inputs]
    tokenizer = facts.tokenizer()
    feeds = [_feeds([tokenizer.encode(text)], inputs, facts.pad_id)[0] for text in queries]
    requests = {name: core.compile_model(network, "CPU", {**compile_properties(params), **extra}).create_infer_request()
                for name, extra in SETTINGS.items()}
    for request in requests.values():  # warm-up: every shape once
        for feed in feeds:
            request.infer(feed)
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in requests}
    for r in range(rounds):
        for name in (list(requests) if r % 2 == 0 else list(requests)[::-1]):
            times = []
            for feed in feeds * 2:
                start = time.perf_counter()
                requests[name].infer(feed)
                times.append((time.perf_counter() - start) * 1e3)
            figures[name].append((float(np.percentile(times, 50)), float(np.percentile(times, 99))))
    print(f"{len(queries)} short queries x 2 per round, {rounds} rounds, in process ({graph}):")
    for name, rows in figures.items():
        p50s, p99s = [p50 for p50, _ in rows], [p99 for _, p99 in rows]
        tails = ", ".join(f"{p99 / p50:.2f}" for p50, p99 in rows)
        print(f"  {name:26} p50 {np.median(p50s):.2f} ms, p99 {np.median(p99s):.2f} ms; p99 / p50 per round {tails}")


if __name__ == "__main__":
    main()
