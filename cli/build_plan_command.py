"""``nexus-sli build-plan``: a GPU export's encoder compiled into a TensorRT plan, on the GPU host."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .arguments import positive_number


def add_parser(commands) -> None:
    build = commands.add_parser(
        "build-plan", help="build, validate and switch a GPU export's encoder to a TensorRT plan (run on the GPU host)")
    build.add_argument("--repository", default="model_repository", help="the model repository")
    build.add_argument("--model", required=True, help="the model's name in the repository (exported with --target gpu)")
    build.add_argument("--workspace-gib", type=positive_number, default=1.0,
                       help="TensorRT builder workspace in GiB (default 1)")
    build.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from nexus_sli.exporter.export.build_plan import build_plan

    record = build_plan(Path(args.repository), args.model, int(args.workspace_gib * (1 << 30)))
    shown = ("file", "gpu", "compute_capability", "tensorrt", "cosine_min", "agreement", "passed")
    values = record.to_dict()
    print(json.dumps({"model": args.model, **{k: values.get(k) for k in shown}}))
    return 0
