"""``nexus-sli bench``: its arguments, and the command (heavy imports inside)."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

#: ``--benchmarks-md`` given without a value: the model's own page (bench/layout.py)
MODEL_PAGE = "<model's page>"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="",
                        help="hub id, local directory, or a model packaged on PyPI such as all-mpnet-base-v2 "
                             "(default: packaged all-MiniLM-L6-v2); a model of base size or larger gets a "
                             "smaller plan, stated on its page (bench/run_size.py, choose_run_size)")
    parser.add_argument("--repo", default="",
                        help="model repository the bench exports into and serves (default: bench/.repo for the "
                             "packaged model, bench/.repo-<model> for another: bench/layout.py)")
    parser.add_argument("--out", default="",
                        help="folder for latest.json, latest.md, latest.png (default: bench/results, "
                             "bench/results/<model> for another model; quick/ under it for --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer texts, one repetition, gRPC only, no PyTorch peers (a smoke run)")
    parser.add_argument("--repetitions", type=int, default=0,
                        help="at least this many timed repetitions (default: 3, quick: 1); the full run adds "
                             "more while a target's paired ratios spread by 10%% or more, within its cap")
    parser.add_argument("--reexport", action="store_true",
                        help="export again even when the repository already holds this model")
    parser.add_argument("--export-only", action="store_true", help="export what the bench serves, measure nothing")
    parser.add_argument("--stack-only", action="store_true",
                        help="measure only the served stack's ceiling (bench/stack_ceiling.py) and write it into the "
                             "last run's latest.json and page, beside that run's other figures")
    parser.add_argument("--benchmarks-md", nargs="?", const=MODEL_PAGE, default="", metavar="PAGE",
                        help="also write this page; without a value, the model's own: BENCHMARKS.md for the "
                             "packaged model, BENCHMARKS-<model>.md beside it for another")


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run (defaults left out)."""
    words = ["nexus-sli", "bench"]
    for flag, value in (("--model", args.model), ("--repo", args.repo), ("--out", args.out),
                        ("--repetitions", args.repetitions)):
        if value:
            words += [flag, str(value)]
    if args.benchmarks_md:
        words += ["--benchmarks-md"] if args.benchmarks_md == MODEL_PAGE else ["--benchmarks-md", args.benchmarks_md]
    words += [flag for flag, on in (("--quick", args.quick), ("--reexport", args.reexport),
                                    ("--stack-only", args.stack_only)) if on]
    return shlex.join(words)


def bench_options(args: argparse.Namespace):
    """The run's options: the repository, results folder and page not given derived from ``--model``
    (bench/layout.py), so that a model other than the packaged one never touches its artefacts."""
    from .layout import layout
    from .options import BenchOptions

    where = layout(args.model)
    page = where.page if args.benchmarks_md == MODEL_PAGE else Path(args.benchmarks_md) if args.benchmarks_md else None
    return BenchOptions(
        model=args.model or None, repository=Path(args.repo or where.repository),
        out=Path(args.out or where.out(args.quick)), quick=args.quick,
        repetitions=args.repetitions or None, reexport=args.reexport, benchmarks_md=page,
        command=_command(args), stack_only=args.stack_only,
    )


def run(args: argparse.Namespace) -> int:
    import json

    from .exports import ensure_exported
    from .harness import run_bench, run_stack_only

    options = bench_options(args)
    if args.export_only:
        print(json.dumps({"repository": str(options.repository), "models": ensure_exported(options)}))
        return 0
    if options.stack_only:
        print(json.dumps(run_stack_only(options)["summary"], indent=2))
        return 0
    results = run_bench(options)
    statuses = [t["status"] for t in results["targets"]]
    print(json.dumps({"out": str(options.out), "duration_s": results["duration_s"],
                      "repetitions": results["settings"]["repetitions"],
                      "targets_met": sum(t["met"] for t in results["targets"]),
                      "targets": len(results["targets"]),
                      "statuses": {s: statuses.count(s) for s in dict.fromkeys(statuses)}}))
    return 0
