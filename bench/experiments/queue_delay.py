"""The served ensemble under other dynamic-batching queue delays, per step.

``.venv/bin/python -m nexus_sli.bench.experiments.queue_delay [REPO] [MODEL]``
(default: ``bench/.repo`` and the bench's fp32 model) copies the ensemble into a
scratch repository once per setting, rewrites ``max_queue_delay_microseconds``
of its tokenizer, encoder and post-processing configs (through Triton's
protobuf schema), serves it, and prints texts/s with 16 concurrent single-text
clients and the p50/p99 of sequential single short queries, gRPC, two rounds
interleaved.  A lone query waits out every step's delay (Triton holds a
request that long for others to join it), so the settings include delays on
the encoder only, where merging requests pays.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from nexus_sli.exporter.triton import config as triton_config

from ..harness import short_queries
from ..runners import ServedFacts, token_counts
from ..served import Server, ServedEmbedder
from ..texts import bench_texts
from . import MODEL, QUERIES, bench_repository, steps_of

#: (tokenizer, encoder, post-processing) delays in microseconds; an ensemble without a
#: post-processing step (embeddings pool in the encoder graph) uses the first two
SETTINGS = ((0, 0, 0), (500, 500, 500), (0, 500, 0), (0, 2000, 0), (2000, 2000, 2000))


def _repository(source: Path, model: str, target: Path, delays_us: tuple[int, int, int]) -> Path:
    steps = steps_of(source, model)
    for name in (model, *steps):
        shutil.copytree(source / name, target / name)
    for name, delay in zip(steps, delays_us):
        config_path = target / name / "config.pbtxt"
        config = triton_config.read(config_path)
        config.dynamic_batching.max_queue_delay_microseconds = delay
        triton_config.write(config, config_path.parent)
    return target


def main(argv: list[str] | None = None, rounds: int = 2) -> None:
    argv = sys.argv[1:] if argv is None else argv
    source = Path(argv[0]) if argv else bench_repository()
    model = argv[1] if len(argv) > 1 else MODEL
    texts = bench_texts()
    short = short_queries(texts, token_counts(ServedFacts.read(source, model), texts), QUERIES)
    for round_ in range(rounds):
        for delays in SETTINGS:
            with tempfile.TemporaryDirectory() as work, \
                    Server(_repository(source, model, Path(work), delays)) as server:
                client = ServedEmbedder(server.url("grpc"), "grpc", model)
                client.concurrent(texts[:64], 16)  # warm-up
                concurrent = client.concurrent(texts[64:384], 16)
                latencies = np.array(client.sequential(short).latencies_ms)
                client.close()
            print(f"round {round_}, queue delays (tokenizer, encoder, post) {delays} us: 16 concurrent "
                  f"{320 / concurrent.seconds:.1f} texts/s; single p50 {np.percentile(latencies, 50):.2f} ms "
                  f"p99 {np.percentile(latencies, 99):.2f} ms", flush=True)


if __name__ == "__main__":
    main()
