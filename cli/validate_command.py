"""``nexus-sli validate``: check an exported model against its stored PyTorch reference, here."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(commands) -> None:
    validate = commands.add_parser("validate", help="validate an exported model again on this machine's runtime")
    validate.add_argument("--repository", default="model_repository", help="the model repository")
    validate.add_argument("--model", required=True, help="the model's name in the repository")
    validate.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from nexus_sli.exporter.export.revalidate import revalidate

    record = revalidate(Path(args.repository), args.model)
    shown = ("backend", "precision", "providers", "max_abs_diff", "cosine_min", "agreement", "passed")
    print(json.dumps({"model": args.model, **{k: record[k] for k in shown}}))
    return 0
