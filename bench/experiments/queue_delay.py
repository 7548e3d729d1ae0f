"""The served fp32 ensemble under other dynamic-batching queue delays.

``.venv/bin/python -m nexus_sli.bench.experiments.queue_delay`` copies the fp32
ensemble of ``bench/.repo`` into a scratch repository once per setting, rewrites
``max_queue_delay_microseconds`` of its tokenizer, encoder and post-processing
configs (through Triton's protobuf schema), serves it, and prints texts/s with 16
concurrent single-text clients and the p50/p99 of sequential single short
queries, gRPC, two rounds interleaved.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np

from nexus_sli.exporter.triton import config as triton_config

from ..served import Server, ServedEmbedder
from . import MODEL, served_inputs

DELAYS_US = (0, 500, 2000, 5000)
STEPS = ("_tokenizer", "_encoder", "_postprocess")


def _repository(source: Path, target: Path, delay_us: int) -> Path:
    for suffix in ("", *STEPS):
        shutil.copytree(source / f"{MODEL}{suffix}", target / f"{MODEL}{suffix}")
    for suffix in STEPS:
        config_path = target / f"{MODEL}{suffix}" / "config.pbtxt"
        config = triton_config.read(config_path)
        config.dynamic_batching.max_queue_delay_microseconds = delay_us
        triton_config.write(config, config_path.parent)
    return target


def main(rounds: int = 2) -> None:
    source, texts, short = served_inputs()
    for round_ in range(rounds):
        for delay in DELAYS_US:
            with tempfile.TemporaryDirectory() as work, Server(_repository(source, Path(work), delay)) as server:
                client = ServedEmbedder(server.url("grpc"), "grpc", MODEL)
                client.concurrent(texts[:64], 16)  # warm-up
                concurrent = client.concurrent(texts[64:384], 16)
                latencies = np.array(client.sequential(short).latencies_ms)
                client.close()
            print(f"round {round_}, queue delay {delay} us: 16 concurrent {320 / concurrent.seconds:.1f} texts/s; "
                  f"single p50 {np.percentile(latencies, 50):.2f} ms p99 {np.percentile(latencies, 99):.2f} ms",
                  flush=True)


if __name__ == "__main__":
    main()
