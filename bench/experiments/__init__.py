"""One-off measurements behind the "What was tried" section of BENCHMARKS.md.

Each runs on the bench repository (``make bench`` exports it first) and prints
its figures; none is part of ``make bench`` because each answers one question.
"""

from __future__ import annotations

from pathlib import Path

from ..harness import short_queries
from ..runners import ServedFacts, token_counts
from ..texts import bench_texts, repository_root

MODEL = "all_minilm_l6_v2"
QUERIES = 150


def bench_repository() -> Path:
    return repository_root() / "bench" / ".repo"


def steps_of(repo: Path, model: str) -> list[str]:
    """The models the ensemble ``model`` chains, in order (tokenizer, encoder, and a post-processing
    step except where the encoder graph pools)."""
    from nexus_sli.exporter.triton import config as triton_config

    ensemble = triton_config.read(repo / model / "config.pbtxt")
    return [step.model_name for step in ensemble.ensemble_scheduling.step]


def served_inputs() -> tuple[Path, list[str], list[str]]:
    """The bench repository, the bench texts, and the bench's short queries among them."""
    repo, texts = bench_repository(), bench_texts()
    return repo, texts, short_queries(texts, token_counts(ServedFacts.read(repo, MODEL), texts), QUERIES)
