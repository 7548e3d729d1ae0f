"""How much a bench run measures, chosen from the size of the model it measures, never its name.

A small model gets :data:`FULL` (or :data:`QUICK`); a model whose size would take the full
run far past its time gets :data:`BASE` (or :data:`BASE_QUICK`), which measures less of
what no target reads.  The page and ``latest.json`` call the chosen size the run's plan
(``settings.plan``, :func:`run_size_record`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from nexus_sli.exporter.export.source import resolve_model

from .compute_limit import EncoderShape, encoder_shape
from .options import BenchOptions

SEQ_LENS = (16, 64, 128, 256, 512)


@dataclass(frozen=True)
class RunSize:
    """How much a run measures: :data:`FULL` and :data:`QUICK`, and for a model whose size would
    take the full run past its time (:func:`choose_run_size`), :data:`BASE` and :data:`BASE_QUICK`."""

    name: str
    texts: int | None           # None: the whole bench text set
    repetitions: int            # at least this many (the full run adds more to settle targets); also the slices
    latency_queries: int
    latency_budget_s: float     # per path and repetition: single queries stop once it is spent
    seq_lens: tuple[int, ...]
    seq_tokens: int             # tokens per sequence-length measurement (at least one batch of 32)
    protocols: tuple[str, ...]
    torch_peers: bool           # transformers' AutoModel in process, fp32 and bf16 autocast (no target reads them)
    warmup_texts: int
    peers: bool = False         # fastembed and infinity-emb, each in its own venv (bench/peers.py)
    #: every served configuration (:func:`exports.variants`); False: fp32 and the default only, the two the
    #: targets read
    every_variant: bool = True
    #: repetitions are added while a target's spread is 10% or more, up to this many (0: none added) ...
    max_repetitions: int = 0
    #: ... and while one more fits in this many seconds of repetitions
    repetition_budget_s: float = 0.0


#: The repetition budget keeps ``make bench`` on the packaged model a run of about ten minutes
#: (bench/data/tried.md, "Sizing the bench runs").
FULL = RunSize("full", None, 3, 100, 10.0, SEQ_LENS, 4096, ("grpc", "http"), True, 32, peers=True,
               max_repetitions=8, repetition_budget_s=330.0)
QUICK = RunSize("quick", 96, 1, 16, 3.0, (16, 64), 2048, ("grpc",), False, 32)
#: A base-size model costs several times a small model's matmul FLOPs per token and is truncated later
#: (all-mpnet-base-v2 at 384 tokens, not 256), and each of its exports (the auto export validates and
#: times every candidate graph, then one export per served configuration) takes minutes: the full size
#: would take its run far past the full run's time (bench/data/tried.md, "Sizing the bench runs").  This
#: size keeps the workloads, the targets table and the peers, and cuts what no target reads (HTTP twins
#: of the gRPC rows, every configuration besides fp32 and the default, which is the auto export itself:
#: :func:`exports.auto_export`; the transformers AutoModel rows), then the text set to half (spread over
#: it, so the length mix stays; each repetition's slice still holds 3+ batches of 32), the sweep to three
#: lengths and the repetitions to what its budget holds.
BASE = replace(FULL, name="base", texts=320, seq_lens=(16, 64, 256), seq_tokens=2048, protocols=("grpc",),
               torch_peers=False, every_variant=False, max_repetitions=5, repetition_budget_s=900.0)
BASE_QUICK = replace(QUICK, name="base quick", every_variant=False)

#: Matmul FLOPs per token (:meth:`EncoderShape.flops_per_token`) up to which a model gets the full size:
#: all-MiniLM-L6-v2, which it was sized on, costs 21 M; 6 layers x 768 or 12 x 384 cost 42 M.
FULL_MAX_FLOPS_PER_TOKEN = 50e6
#: The base size was sized on all-mpnet-base-v2's 170 M; a larger model gets it too, with a warning
#: (on the page) that its run may take longer than the hour.
BASE_SIZED_FOR_FLOPS_PER_TOKEN = 200e6


def small_model_size(quick: bool) -> RunSize:
    return QUICK if quick else FULL


def choose_run_size(shape: EncoderShape, quick: bool) -> RunSize:
    """The run size for a model of ``shape``: chosen from its size, never its name."""
    if shape.flops_per_token() <= FULL_MAX_FLOPS_PER_TOKEN:
        return small_model_size(quick)
    return BASE_QUICK if quick else BASE


def run_size_for(options: BenchOptions) -> tuple[RunSize, EncoderShape]:
    """The size of this run, from the size of the model it measures (:func:`choose_run_size`)."""
    shape = encoder_shape(resolve_model(options.model).path)
    return choose_run_size(shape, options.quick), shape


def run_size_record(run_size: RunSize, shape: EncoderShape, quick: bool, texts_in_set: int) -> dict:
    """The run size for ``latest.json`` and the page (its "plan"): its name, the model's size it was
    chosen from, and what it measures less of than a small model's, and why (empty for a small model)."""
    flops, small = shape.flops_per_token(), small_model_size(quick)
    record = {"name": run_size.name, "flops_per_token": round(flops), "layers": shape.layers, "hidden": shape.hidden,
              "full_plan_max_flops_per_token": FULL_MAX_FLOPS_PER_TOKEN, "reduced": [], "why": "",
              "warning": ""}
    if run_size == small:
        return record
    record["reduced"] = reductions(run_size, small, texts_in_set)
    record["why"] = _why(shape, small, quick)
    if flops > BASE_SIZED_FOR_FLOPS_PER_TOKEN:
        record["warning"] = (f"the {run_size.name} plan was sized on all-mpnet-base-v2 (170 M FLOPs per token); "
                             f"at {flops / 1e6:.0f} M this run may take longer than an hour")
    return record


def _why(shape: EncoderShape, small: RunSize, quick: bool) -> str:
    """Why a model of ``shape`` measures less than ``small``, for the page."""
    flops = shape.flops_per_token()
    return (f"the model costs {flops / 1e6:.0f} M matmul FLOPs per token ({shape.layers} layers x "
            f"{shape.hidden} hidden), over the {FULL_MAX_FLOPS_PER_TOKEN / 1e6:.0f} M up to which "
            f"the {small.name} plan is used (all-MiniLM-L6-v2: 21 M)"
            + ("" if quick else ": on 2 cores the full plan would take it well past an hour, "
                                "exports included"))


def reductions(run_size: RunSize, small: RunSize, texts_in_set: int) -> list[str]:
    """What ``run_size`` measures less of than ``small``, in words, from their fields."""
    found = []
    if run_size.texts != small.texts:
        mine, theirs = (min(n or texts_in_set, texts_in_set) for n in (run_size.texts, small.texts))
        found.append(f"{mine} texts instead of {theirs}, spread evenly over the set so that its length mix stays")
    if (run_size.max_repetitions, run_size.repetition_budget_s) != (small.max_repetitions, small.repetition_budget_s):
        found.append(f"at least {run_size.repetitions} repetitions, more only up to {run_size.max_repetitions} and "
                     f"while one more fits in {run_size.repetition_budget_s:.0f} s of repetitions (instead of up to "
                     f"{small.max_repetitions} within {small.repetition_budget_s:.0f} s)")
    if run_size.seq_lens != small.seq_lens or run_size.seq_tokens != small.seq_tokens:
        found.append(f"sequence lengths {', '.join(map(str, run_size.seq_lens))} with {run_size.seq_tokens} tokens "
                     f"each (instead of {', '.join(map(str, small.seq_lens))} with {small.seq_tokens})")
    if run_size.protocols != small.protocols:
        found.append(f"served rows over {' and '.join(run_size.protocols)} only (instead of "
                     f"{' and '.join(small.protocols)}); the targets take the best protocol measured")
    if run_size.every_variant != small.every_variant:
        found.append("served and in-process rows of fp32 and the default configuration only, the two the targets "
                     "read, the default being the auto export itself (instead of every configuration, one export "
                     "each)")
    if run_size.torch_peers != small.torch_peers:
        found.append("no transformers AutoModel rows in process (fp32, bf16 autocast): no target reads them")
    return found
