"""Pooling inside the encoder graph against the python post-processing step, served side by side.

``.venv/bin/python -m nexus_sli.bench.experiments.pooling_in_graph [--rounds N] [--work DIR]``
exports the packaged all-MiniLM-L6-v2 twice with ONNX Runtime fp32 (the
exporter's internal ``ExportOptions.pool_in_graph`` switch): ``in_graph``,
tokenizer -> encoder whose graph ends in the pooling and normalisation, and
``python_step``, the earlier tokenizer -> encoder -> python post-processing
ensemble.  One Triton server serves both; each round measures both, in
alternating order, over gRPC with ``EncoderClient``: sequential single short
queries (p50, p99), client batches of 32, and 16 concurrent single-text clients.
It prints each variant's medians over the rounds and the paired ratios (each
round's in-graph figure against the same round's python-step figure; median
and range), and the largest difference between the two variants' embeddings.
With ``--work DIR`` the exports are kept there and reused by the next run.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from pathlib import Path

import numpy as np

from nexus_sli.exporter.export.pipeline import ExportOptions, run_export

from ..harness import short_queries
from ..runners import ServedFacts, token_counts
from ..served import Server, ServedEmbedder
from ..texts import bench_texts
from . import QUERIES

#: variant name -> pooling in the graph
VARIANTS = {"in_graph": True, "python_step": False}
BATCH_TEXTS = 320
CONCURRENT_TEXTS = 320


def _export(repo: Path) -> None:
    """Both variants into ``repo`` (skipped where an earlier run left them), on the same graph."""
    graphs = {}
    for name, pooled in VARIANTS.items():
        report = repo / f"{name}_encoder" / "validation.json"
        if not report.is_file():
            run_export(ExportOptions(name=name, out=repo, backend="onnxruntime", precision="fp32",
                                     pool_in_graph=pooled))
        exported = json.loads(report.read_text())
        graphs[name] = exported["graph"]
        print(f"{name}: {exported['precision']} {exported['graph']} graph, pooled in the graph: "
              f"{exported.get('pooled_in_graph', False)}, cosine min {exported['cosine_min']:.6f}, "
              f"max abs diff {exported['max_abs_diff']:.2e}", flush=True)
    if len(set(graphs.values())) != 1:  # the export times plain against fused: both must serve the same
        raise SystemExit(f"the exports chose different graphs ({graphs}); remove {repo} and run again")


def _round(client: ServedEmbedder, texts: list[str], short: list[str]) -> dict:
    latencies = np.array(client.sequential(short).latencies_ms)
    batches = client.batches(texts[:BATCH_TEXTS])
    concurrent = client.concurrent(texts[BATCH_TEXTS:BATCH_TEXTS + CONCURRENT_TEXTS])
    return {"p50_ms": float(np.percentile(latencies, 50)), "p99_ms": float(np.percentile(latencies, 99)),
            "batch32_texts_s": batches.count / batches.seconds,
            "concurrent16_texts_s": concurrent.count / concurrent.seconds, "vectors": batches.embeddings}


def _table(results: dict[str, list[dict]]) -> None:
    metrics = ("p50_ms", "p99_ms", "batch32_texts_s", "concurrent16_texts_s")
    print("| metric | " + " | ".join(f"{v} (median)" for v in VARIANTS) + " | in_graph / python_step per round |")
    print("|---|" + "---:|" * (len(VARIANTS) + 1))
    for metric in metrics:
        medians = [float(np.median([r[metric] for r in results[v]])) for v in VARIANTS]
        ratios = [a[metric] / b[metric] for a, b in zip(results["in_graph"], results["python_step"])]
        print(f"| {metric} | " + " | ".join(f"{m:.2f}" for m in medians)
              + f" | {np.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--work", type=Path, help="keep the exports here (and reuse them); default: a temporary folder")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="nexus-sli-pooling-") as scratch:
        repo = (args.work or Path(scratch)) / "repo"
        _export(repo)
        _measure(repo, args.rounds)


def _measure(repo: Path, rounds: int) -> None:
    texts = bench_texts()
    short = short_queries(texts, token_counts(ServedFacts.read(repo, "in_graph"), texts), QUERIES)
    results: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    with Server(repo) as server:
        clients = {name: ServedEmbedder(server.url("grpc"), "grpc", name) for name in VARIANTS}
        for client in clients.values():  # warm-up
            client.sequential(short[:20])
            client.batches(texts[:64])
            client.concurrent(texts[:64])
        for round_ in range(rounds):
            order = list(VARIANTS) if round_ % 2 == 0 else list(VARIANTS)[::-1]
            for name in order:
                results[name].append(_round(clients[name], texts, short))
            print(f"round {round_}: " + "; ".join(
                f"{name} p50 {results[name][-1]['p50_ms']:.2f} ms, batch32 {results[name][-1]['batch32_texts_s']:.0f}"
                f"/s, concurrent16 {results[name][-1]['concurrent16_texts_s']:.0f}/s" for name in order), flush=True)
        for client in clients.values():
            client.close()
    a, b = results["in_graph"][0]["vectors"], results["python_step"][0]["vectors"]
    print(f"{rounds} rounds, {len(short)} short queries, {BATCH_TEXTS} texts in batches of 32, "
          f"{CONCURRENT_TEXTS} texts from 16 concurrent clients; gRPC")
    print(f"largest |in_graph - python_step| over {len(a)} embeddings: {np.abs(a - b).max():.2e}")
    _table(results)


if __name__ == "__main__":
    main()
