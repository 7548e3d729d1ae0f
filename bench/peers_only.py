"""The peers alone beside the baseline: fastembed and infinity-emb against sentence-transformers.

``.venv/bin/python -m nexus_sli.bench.peers_only [--texts N] [--repetitions R]``
(default: the whole bench text set, 1 repetition) makes the peers' venvs where missing
(``bench/peers.py``; minutes the first time), starts them, and times them and the
baseline interleaved in the three workloads exactly as the full bench does (the same
measurements, texts and rows), without the served paths.  It prints one line per row
and the peers' versions and settings.  A check of the peer machinery on its own; the
full bench (``make bench``) measures the peers together with everything else.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging

from .options import BenchOptions
from .paths import baselines, groups, in_process_measurements, warm_up
from .peers import Peers
from .prepare import prepare
from .results import rows
from .run_size import QUICK
from .texts import repository_root

COLUMNS = ("path", "protocol", "mode", "texts", "texts_per_s", "p50_ms", "p99_ms", "cosine_min", "cosine_mean",
           "ratio_vs_baseline", "peer")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=0, help="the first N bench texts (default: all)")
    parser.add_argument("--repetitions", type=int, default=1)
    args = parser.parse_args(argv)
    # as nexus-sli's CLI does: only ours at INFO (the openai SDK's client logs every request at INFO)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    logging.getLogger("nexus_sli").setLevel(logging.INFO)
    repetitions = args.repetitions
    run_size = dataclasses.replace(QUICK, texts=args.texts or None, latency_queries=100, latency_budget_s=10.0,
                                   seq_lens=(), peers=True)
    setup = prepare(BenchOptions(repository=repository_root() / "bench" / ".repo", quick=True), run_size)
    measurements = in_process_measurements(setup, run_size, baselines(setup))
    with Peers(setup.model_id, setup.model_dir, setup.facts["fp32"], setup.skipped) as peers:
        measurements += peers.measurements(groups(setup), run_size.latency_budget_s)
        warm_up(measurements, run_size)
        for repetition in range(repetitions):
            for m in measurements:
                m.time_once(repetition, repetitions)
    print(" | ".join(COLUMNS))
    for row in rows(measurements):
        print(" | ".join(str(row.get(column)) for column in COLUMNS))
    print(json.dumps({"peers": peers.info, "skipped": setup.skipped}, indent=1))


if __name__ == "__main__":
    main()
