"""``nexus-sli``: the command line.  Thin: parse, call, print; heavy imports inside commands.

This is the only module that sees every package (exporter, bench, client);
nothing imports it.
"""

from __future__ import annotations

import argparse
import logging
import sys

from nexus_sli.exporter.errors import NexusError
from nexus_sli.tasks import TaskError

from . import (bench_command, build_plan_command, client_commands, export_command, fetch_command, gateway_command,
               publish_command, serve_command, validate_command)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nexus-sli", description="Export BERT-family encoders into a Triton model repository, "
                                     "serve it, and call it.")
    commands = parser.add_subparsers(dest="command", required=True)
    export_command.add_parser(commands)
    fetch_command.add_parser(commands)
    validate_command.add_parser(commands)
    build_plan_command.add_parser(commands)
    serve_command.add_parser(commands)
    publish_command.add_parser(commands)
    gateway_command.add_parser(commands)
    bench_command.add_parser(commands)
    client_commands.add_parsers(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Libraries (the ORT optimizer above all) log chattily at INFO; only ours speaks at INFO.
    logging.basicConfig(level=logging.WARNING, format="nexus-sli: %(message)s", stream=sys.stderr)
    logging.getLogger("nexus_sli").setLevel(logging.INFO)
    try:
        return args.run(args)
    except (NexusError, TaskError) as exc:
        print(f"nexus-sli: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
