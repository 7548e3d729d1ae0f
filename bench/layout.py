"""Where one model's bench run keeps what it makes, derived in one place from ``--model``.

The packaged default (all-MiniLM-L6-v2) keeps the folders the bench always had:
``bench/.repo`` (its auto export beside it in ``bench/.repo-auto``), ``bench/results``
and ``BENCHMARKS.md``.  Any other model gets its own beside them, named by its short
name: for ``all-mpnet-base-v2`` (or ``sentence-transformers/all-mpnet-base-v2``)
``bench/.repo-all-mpnet-base-v2`` (and ``bench/.repo-all-mpnet-base-v2-auto``),
``bench/results/all-mpnet-base-v2/`` and ``BENCHMARKS-all-mpnet-base-v2.md``, so that
benchmarking it never touches the default's exports, results or page.  A quick run
writes into ``quick/`` under the model's results folder.

Nothing here fetches or loads a model: a name is read from ``--model`` as written.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from nexus_sli.exporter.export import packaged
from nexus_sli.exporter.export.source import DEFAULT_MODEL_ID

BENCH = Path("bench")
DEFAULT_PAGE = Path("BENCHMARKS.md")


@dataclass(frozen=True)
class BenchLayout:
    """One model's bench folders and page (paths relative to the repository root, as ``make`` runs)."""

    #: None: the packaged default
    short_name: str | None
    repository: Path
    results: Path
    page: Path

    @property
    def quick_results(self) -> Path:
        return self.results / "quick"

    def out(self, quick: bool) -> Path:
        """Where a run writes latest.json, latest.md and latest.png."""
        return self.quick_results if quick else self.results

    @property
    def make_command(self) -> str:
        """The ``make`` line that runs this model's full bench."""
        return "make bench" + (f" MODEL={self.short_name}" if self.short_name else "")

    def record(self, repository: Path | None = None, out: Path | None = None, page: Path | None = None) -> dict:
        """For ``latest.json`` and the page: the folders a run used (``--repo``, ``--out`` may differ)."""
        return {"short_name": self.short_name, "repository": str(repository or self.repository),
                "out": str(out or self.results), "quick_out": str(self.quick_results),
                "page": None if page is None else str(page), "make": self.make_command}


def short_name(model: str | None) -> str | None:
    """The name a model's artefacts carry (lowercase letters, digits, ``.``, ``_``, ``-``); None for
    the packaged default, by any of its names.  A model packaged on PyPI is named by its packaged
    name whether given by that name or its hub id; a local directory by its folder's name; a hub id
    by its last part."""
    if not model or not model.strip():
        return None
    shipped = packaged.find(model)
    if shipped is not None:
        if shipped.hub_id.lower() == DEFAULT_MODEL_ID.lower():
            return None
        raw = shipped.name
    else:
        path = Path(model).expanduser()
        raw = path.resolve().name if path.is_dir() else model.strip().rstrip("/").split("/")[-1]
    return re.sub(r"[^a-z0-9._-]+", "-", raw.lower()).strip("-.") or "model"


def layout(model: str | None) -> BenchLayout:
    """The folders and page of ``model``'s bench runs (module docstring)."""
    name = short_name(model)
    if name is None:
        return BenchLayout(None, BENCH / ".repo", BENCH / "results", DEFAULT_PAGE)
    return BenchLayout(name, BENCH / f".repo-{name}", BENCH / "results" / name,
                       DEFAULT_PAGE.with_name(f"{DEFAULT_PAGE.stem}-{name}{DEFAULT_PAGE.suffix}"))
