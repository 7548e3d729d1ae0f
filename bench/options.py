"""What one bench run is asked for: ``nexus-sli bench``'s options (bench/cli.py), read by each step."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class BenchOptions:
    #: hub id, local folder or packaged model; None: the packaged default
    model: str | None = None
    #: the model repository the bench exports into and serves (bench/layout.py)
    repository: Path = Path("bench/.repo")
    #: the folder of latest.json, latest.md and latest.png
    out: Path = Path("bench/results")
    quick: bool = False
    #: at least this many timed repetitions; None: the run size's own (bench/run_size.py)
    repetitions: int | None = None
    #: export again even where the repository already holds this model
    reexport: bool = False
    #: also write this page (BENCHMARKS.md or a model's own)
    benchmarks_md: Path | None = None
    #: the command line that reproduces the run, for the page
    command: str = ""
    #: measure only the served stack's ceiling (bench/stack_ceiling.py) into the last run's results and page
    stack_only: bool = False
