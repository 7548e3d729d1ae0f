"""Everything one run's measurements need, built once: the exports, what each served model
says about tokenizing and pooling, and the texts of each group of rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from nexus_sli.exporter.export.source import resolve_model

from . import texts as text_set
from .exports import default_configuration, ensure_exported, export_skips, served_graph
from .options import BenchOptions
from .run_size import RunSize

#: "short query": at most this many tokens
SHORT_QUERY_TOKENS = 16


@dataclass
class Setup:
    """Everything the measurements need, built once."""

    model_id: str
    model_dir: Path
    repository: Path
    names: dict[str, str]
    facts: dict
    texts: list[str]
    tokens: list[int]
    queries: list[str]
    sweep: dict[int, list[str]]
    #: the set's texts of at most :data:`SHORT_QUERY_TOKENS` tokens, in the set's (arrival) order
    short: list[str] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    #: the peers' requirements, installed versions and settings (bench/peers.py), per peer
    peers: dict = field(default_factory=dict)
    #: what ``auto`` exports on this machine (:func:`exports.default_configuration`); None: unknown
    default: dict | None = None


def prepare(options: BenchOptions, run_size: RunSize) -> Setup:
    """Export what is missing, then read the served facts and pick the texts ``run_size`` measures."""
    from .runners import ServedFacts, token_counts

    names = ensure_exported(options, run_size)
    source = resolve_model(options.model)
    default = _default(options, run_size, names)
    facts = {p: ServedFacts.read(Path(options.repository), name) for p, name in names.items()}
    texts = text_set.subset(text_set.bench_texts(), run_size.texts or 10**9)
    tokens = token_counts(facts["fp32"], texts)
    setup = Setup(source.model_id, Path(source.path), Path(options.repository), names, facts, texts, tokens,
                  short_queries(texts, tokens, run_size.latency_queries), {}, default=default)
    setup.skipped.extend(export_skips(options.repository))
    setup.sweep = _sweep(facts["fp32"], texts, run_size, setup.skipped)
    setup.short = [t for t, k in zip(texts, tokens) if k <= SHORT_QUERY_TOKENS]
    return setup


def _default(options: BenchOptions, run_size: RunSize, names: dict[str, str]) -> dict | None:
    """What ``auto`` exports here (:func:`exports.ensure_exported` made it), and which graph the bench's
    own export of that configuration serves: that export picks its graph by timing too."""
    default = default_configuration(options, run_size, export=False)
    if default is not None and default["label"] in names:
        default["served_graph"] = served_graph(Path(options.repository), names[default["label"]])
    return default


def short_queries(texts: list[str], tokens: list[int], n: int) -> list[str]:
    """Short queries from the set: the first ``n`` of at most 16 tokens, topped up with the shortest."""
    short = [t for t, k in zip(texts, tokens) if k <= SHORT_QUERY_TOKENS]
    if len(short) < n:
        short += [t for _, t in sorted(zip(tokens, texts)) if t not in short]
    return short[:n]


def _sweep(facts, texts: list[str], run_size: RunSize, skipped: list[dict]) -> dict[int, list[str]]:
    """The sequence-length sweep: texts of each length ``run_size`` measures that the model takes."""
    tokenizer = facts.tokenizer()
    tokenizer.no_truncation()
    sweep = {}
    for n in run_size.seq_lens:
        if n > facts.max_length:
            skipped.append({"path": "every path", "mode": f"{n} tokens",
                            "reason": f"the model takes at most {facts.max_length} tokens"})
            continue
        count = max(32, run_size.seq_tokens // n // 32 * 32)
        sweep[n] = text_set.texts_of_length(tokenizer, texts, n, count)
    return sweep
