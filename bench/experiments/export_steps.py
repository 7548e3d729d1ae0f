"""Where an export's time goes: the tests' shared exports of the packaged model, one after another, in process,
each step's log line stamped with the milliseconds since the start.

An experiment, not part of the product or of ``make bench``; its findings are in bench/data/tried.md,
"Exports: one graph that passes alone, and candidates that miss a bar"::

    NEXUS_SLI_CACHE_DIR=/tmp/nexus-cache-x .venv/bin/python bench/experiments/export_steps.py /tmp/export-steps.log
"""

from __future__ import annotations

import logging
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from helpers.exports import PACKAGED  # noqa: E402

from nexus_sli.exporter.export.pipeline import ExportOptions, run_export  # noqa: E402


def main() -> None:
    log = open(sys.argv[1], "w") if len(sys.argv) > 1 else sys.stderr
    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)8.0f %(message)s", stream=log)
    for name, options in PACKAGED.items():
        started = time.perf_counter()
        run_export(ExportOptions(name=name, out=Path(tempfile.mkdtemp()), **options))
        print(f"{name:24s} {time.perf_counter() - started:6.1f} s", flush=True)


if __name__ == "__main__":
    main()
