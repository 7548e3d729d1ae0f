"""``nexus-sli bench``: the served model against in-process peers (``make bench``)."""

from __future__ import annotations

import argparse


def add_parser(commands) -> None:
    from nexus_sli.bench.cli import add_arguments  # argparse only; cheap

    bench = commands.add_parser("bench", help="benchmark the served model against in-process peers")
    add_arguments(bench)
    bench.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from nexus_sli.bench.cli import run as run_bench

    return run_bench(args)
