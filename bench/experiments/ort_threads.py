"""The served fp32 ensemble under ONNX Runtime's thread settings.

``.venv/bin/python -m nexus_sli.bench.experiments.ort_threads`` starts the
server on ``bench/.repo`` once per setting (the encoder backend reads
``NEXUS_ORT_THREADS`` and ``NEXUS_ORT_SPINNING`` from the server's
environment), two rounds interleaved, and prints for each: p50/p99 of 150
sequential single short queries, texts/s with client batches of 32, and texts/s
with 16 concurrent single-text clients, all over gRPC.
"""

from __future__ import annotations

import os

import numpy as np

from ..served import Server, ServedEmbedder
from . import MODEL, served_inputs

SETTINGS = {
    "threads: one per core, idle threads spin": {"NEXUS_ORT_SPINNING": "1"},
    "threads: one per core, idle threads sleep (the default)": {"NEXUS_ORT_SPINNING": "0"},
    "one thread": {"NEXUS_ORT_THREADS": "1"},
}
KNOBS = ("NEXUS_ORT_THREADS", "NEXUS_ORT_SPINNING")


def main(rounds: int = 2) -> None:
    repo, texts, short = served_inputs()
    for round_ in range(rounds):
        for name, env in SETTINGS.items():
            for knob in KNOBS:
                os.environ.pop(knob, None)
            os.environ.update(env)
            with Server(repo) as server:
                client = ServedEmbedder(server.url("grpc"), "grpc", MODEL)
                client.sequential(short[:20])  # warm-up
                client.batches(texts[:64])
                latencies = np.array(client.sequential(short).latencies_ms)
                batches = client.batches(texts[:320])
                concurrent = client.concurrent(texts[320:], 16)
                client.close()
            print(f"round {round_}, {name}: single p50 {np.percentile(latencies, 50):.2f} ms "
                  f"p99 {np.percentile(latencies, 99):.2f} ms; batches of 32 {320 / batches.seconds:.1f} texts/s; "
                  f"16 concurrent {len(texts[320:]) / concurrent.seconds:.1f} texts/s", flush=True)


if __name__ == "__main__":
    main()
