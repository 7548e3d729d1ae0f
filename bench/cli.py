"""``nexus-sli bench``: its arguments, and the command (heavy imports inside)."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="",
                        help="hub id or local directory (default: packaged all-MiniLM-L6-v2)")
    parser.add_argument("--repo", default="bench/.repo",
                        help="model repository the bench exports into and serves (default: bench/.repo)")
    parser.add_argument("--out", default="bench/results",
                        help="folder for latest.json, latest.md, latest.png (default: bench/results)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer texts, one repetition, gRPC only, no PyTorch peers (a smoke run)")
    parser.add_argument("--repetitions", type=int, default=0,
                        help="at least this many timed repetitions (default: 3, quick: 1); the full run adds "
                             "more while a target's paired ratios spread by 10%% or more, within its cap")
    parser.add_argument("--reexport", action="store_true",
                        help="export again even when the repository already holds this model")
    parser.add_argument("--export-only", action="store_true", help="export what the bench serves, measure nothing")
    parser.add_argument("--benchmarks-md", default="", help="also write this BENCHMARKS.md page")


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run (defaults left out)."""
    words = ["nexus-sli", "bench"]
    for flag, value in (("--model", args.model), ("--repo", args.repo), ("--out", args.out),
                        ("--repetitions", args.repetitions), ("--benchmarks-md", args.benchmarks_md)):
        if value:
            words += [flag, str(value)]
    words += [flag for flag, on in (("--quick", args.quick), ("--reexport", args.reexport)) if on]
    return shlex.join(words)


def run(args: argparse.Namespace) -> int:
    import json

    from .harness import BenchOptions, ensure_exported, run_bench

    options = BenchOptions(
        model=args.model or None, repository=Path(args.repo), out=Path(args.out), quick=args.quick,
        repetitions=args.repetitions or None, reexport=args.reexport,
        benchmarks_md=Path(args.benchmarks_md) if args.benchmarks_md else None,
        command=_command(args),
    )
    if args.export_only:
        print(json.dumps({"repository": str(options.repository), "models": ensure_exported(options)}))
        return 0
    results = run_bench(options)
    statuses = [t["status"] for t in results["targets"]]
    print(json.dumps({"out": str(options.out), "duration_s": results["duration_s"],
                      "repetitions": results["settings"]["repetitions"],
                      "targets_met": sum(t["met"] for t in results["targets"]),
                      "targets": len(results["targets"]),
                      "statuses": {s: statuses.count(s) for s in dict.fromkeys(statuses)}}))
    return 0
