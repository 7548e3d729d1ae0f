"""One bench run: export what is missing, build every path, warm up, time the paths
interleaved repetition by repetition, and summarise.

Interleaving (every path once per repetition, then again) spreads the noise of a
shared machine over all paths alike, so the ratios in one run stay comparable.
The throughput rows on the text set are sliced: with S slices, repetition r times
every S-th text from offset r mod S, the same slice for every path, so any S
repetitions together cover the whole set once and the fidelity figures cover all
of it, however many repetitions the run adds to settle its targets
(:class:`Repetitions`).  The targets divide each path's figure in repetition r by
the reference's in the same repetition (bench/targets.py).
"""

from __future__ import annotations

import functools
import json
import logging
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from nexus_sli.exporter.export.source import ModelSource, check_name, resolve_model
from nexus_sli.exporter.export.static_int8 import STATIC_INT8_GRAPH

from . import machine, texts as text_set
from .compute_limit import EncoderShape, encoder_shape
from .layout import layout
from .measure import (
    BATCH32,
    CONCURRENT16,
    GATEWAY_PATH,
    GATEWAY_PROTOCOL,
    LATENCY1,
    SEQ_LEN,
    SHORT32,
    Measurement,
    cosines,
    in_process_precision,
    one_by_one,
    timed,
)

log = logging.getLogger("nexus_sli.bench")

SEQ_LENS = (16, 64, 128, 256, 512)
#: "short query": at most this many tokens
SHORT_QUERY_TOKENS = 16


@dataclass(frozen=True)
class Plan:
    """How much a run measures: :data:`FULL` and :data:`QUICK`, and for a model whose size
    would take the full plan past its time (:func:`choose_plan`), :data:`BASE` and :data:`BASE_QUICK`."""

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
    #: every served configuration (:func:`variants`); False: fp32 and the default only, the two the targets read
    every_variant: bool = True
    #: repetitions are added while a target's spread is 10% or more, up to this many (0: none added) ...
    max_repetitions: int = 0
    #: ... and while one more fits in this many seconds of repetitions
    repetition_budget_s: float = 0.0


FULL = Plan("full", None, 3, 100, 10.0, SEQ_LENS, 4096, ("grpc", "http"), True, 32, peers=True,
            max_repetitions=8, repetition_budget_s=330.0)  # make bench stays under ~10 minutes
QUICK = Plan("quick", 96, 1, 16, 3.0, (16, 64), 2048, ("grpc",), False, 32)
#: A base-size model (all-mpnet-base-v2: 12 layers x 768, 8x all-MiniLM-L6-v2's matmul FLOPs per token,
#: 10-15x its sentence-transformers time on the bench texts, which it truncates at 384 tokens, not 256)
#: would take the full plan past an hour on 2 cores: its exports alone (the auto export validates and
#: times every candidate graph, then one export per served configuration) take longer than the full
#: plan's whole run on all-MiniLM-L6-v2 (10 minutes).  This plan keeps the workloads, the targets table and the peers, and cuts
#: what no target reads (HTTP twins of the gRPC rows, every configuration besides fp32 and the default,
#: which is the auto export itself: :func:`auto_export`; the transformers AutoModel rows), then the text
#: set to half (spread over it, so the length mix stays; each repetition's slice still holds 3+ batches
#: of 32), the sweep to three lengths and the repetitions to what 15 minutes hold.
BASE = replace(FULL, name="base", texts=320, seq_lens=(16, 64, 256), seq_tokens=2048, protocols=("grpc",),
               torch_peers=False, every_variant=False, max_repetitions=5, repetition_budget_s=900.0)
BASE_QUICK = replace(QUICK, name="base quick", every_variant=False)

#: Matmul FLOPs per token (:meth:`EncoderShape.flops_per_token`) up to which a model gets the full plan:
#: all-MiniLM-L6-v2, which it was sized on, costs 21 M; 6 layers x 768 or 12 x 384 cost 42 M.
FULL_PLAN_MAX_FLOPS_PER_TOKEN = 50e6
#: The base plan was sized on all-mpnet-base-v2's 170 M; a larger model gets it too, with a warning
#: (on the page) that its run may take longer than the hour.
BASE_PLAN_SIZED_FOR_FLOPS_PER_TOKEN = 200e6


def small_model_plan(quick: bool) -> Plan:
    return QUICK if quick else FULL


def choose_plan(shape: EncoderShape, quick: bool) -> Plan:
    """The plan for a model of ``shape``: chosen from its size, never its name."""
    if shape.flops_per_token() <= FULL_PLAN_MAX_FLOPS_PER_TOKEN:
        return small_model_plan(quick)
    return BASE_QUICK if quick else BASE


def plan_record(plan: Plan, shape: EncoderShape, quick: bool, texts_in_set: int) -> dict:
    """The plan for ``latest.json`` and the page: its name, the model's size it was chosen from,
    and what it measures less of than the plan for a small model, and why (empty for a small model)."""
    flops, small = shape.flops_per_token(), small_model_plan(quick)
    record = {"name": plan.name, "flops_per_token": round(flops), "layers": shape.layers, "hidden": shape.hidden,
              "full_plan_max_flops_per_token": FULL_PLAN_MAX_FLOPS_PER_TOKEN, "reduced": [], "why": "",
              "warning": ""}
    if plan == small:
        return record
    record["reduced"] = reductions(plan, small, texts_in_set)
    record["why"] = (f"the model costs {flops / 1e6:.0f} M matmul FLOPs per token ({shape.layers} layers x "
                     f"{shape.hidden} hidden), over the {FULL_PLAN_MAX_FLOPS_PER_TOKEN / 1e6:.0f} M up to which "
                     f"the {small.name} plan is used (all-MiniLM-L6-v2: 21 M)"
                     + ("" if quick else ": on 2 cores the full plan would take it well past an hour, "
                                         "exports included"))
    if flops > BASE_PLAN_SIZED_FOR_FLOPS_PER_TOKEN:
        record["warning"] = (f"the {plan.name} plan was sized on all-mpnet-base-v2 (170 M FLOPs per token); "
                             f"at {flops / 1e6:.0f} M this run may take longer than an hour")
    return record


def reductions(plan: Plan, small: Plan, texts_in_set: int) -> list[str]:
    """What ``plan`` measures less of than ``small``, in words, from their fields."""
    found = []
    if plan.texts != small.texts:
        mine, theirs = (min(n or texts_in_set, texts_in_set) for n in (plan.texts, small.texts))
        found.append(f"{mine} texts instead of {theirs}, spread evenly over the set so that its length mix stays")
    if (plan.max_repetitions, plan.repetition_budget_s) != (small.max_repetitions, small.repetition_budget_s):
        found.append(f"at least {plan.repetitions} repetitions, more only up to {plan.max_repetitions} and while one "
                     f"more fits in {plan.repetition_budget_s:.0f} s of repetitions (instead of up to "
                     f"{small.max_repetitions} within {small.repetition_budget_s:.0f} s)")
    if plan.seq_lens != small.seq_lens or plan.seq_tokens != small.seq_tokens:
        found.append(f"sequence lengths {', '.join(map(str, plan.seq_lens))} with {plan.seq_tokens} tokens each "
                     f"(instead of {', '.join(map(str, small.seq_lens))} with {small.seq_tokens})")
    if plan.protocols != small.protocols:
        found.append(f"served rows over {' and '.join(plan.protocols)} only (instead of "
                     f"{' and '.join(small.protocols)}); the targets take the best protocol measured")
    if plan.every_variant != small.every_variant:
        found.append("served and in-process rows of fp32 and the default configuration only, the two the targets "
                     "read, the default being the auto export itself (instead of every configuration, one export "
                     "each)")
    if plan.torch_peers != small.torch_peers:
        found.append("no transformers AutoModel rows in process (fp32, bf16 autocast): no target reads them")
    return found


def plan_for(options: "BenchOptions") -> tuple[Plan, EncoderShape]:
    """The plan of this run, from the size of the model it measures (:func:`choose_plan`)."""
    shape = encoder_shape(resolve_model(options.model).path)
    return choose_plan(shape, options.quick), shape


@dataclass
class BenchOptions:
    model: str | None = None
    repository: Path = Path("bench/.repo")
    out: Path = Path("bench/results")
    quick: bool = False
    repetitions: int | None = None
    reexport: bool = False
    benchmarks_md: Path | None = None
    command: str = ""


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
    #: what ``auto`` exports on this machine (:func:`default_configuration`); None: unknown
    default: dict | None = None


def variants(default: dict | None = None, every: bool = True) -> dict[str, tuple[str, str, str]]:
    """Each served configuration the bench measures: label -> (backend, precision, name suffix).
    OpenVINO bf16 only where the CPU has bf16 (elsewhere the exporter would make fp32).
    ``default`` (:func:`default_configuration`): what ``auto`` exports here, added when it is
    none of these, so that the targets are always judged on a served default.  ``every`` False
    (:attr:`Plan.every_variant`): fp32 and the default only, the two configurations the targets read."""
    ov_float = "bf16" if machine.supports_bf16() else "fp32"
    found = {"fp32": ("onnxruntime", "fp32", ""), "int8": ("onnxruntime", "int8", "_int8"),
             f"openvino-{ov_float}": ("openvino", ov_float, f"_ov_{ov_float}"),
             "openvino-int8": ("openvino", "int8", "_ov_int8")}
    if default is not None and default["label"] not in found:
        found[default["label"]] = (default["backend"], default["precision"], _suffix(default["label"]))
    if not every:
        kept = {"fp32", default["label"] if default is not None else "fp32"}
        found = {label: found[label] for label in found if label in kept}
    return found


def variant_label(backend: str, precision: str, graph: str = "") -> str:
    """The label of the served rows of ``backend`` at ``precision`` (the rows' precision column); ONNX Runtime's
    static int8 ``graph`` is ``int8-static``, apart from the dynamic int8 a named ``int8`` export keeps."""
    if backend == "onnxruntime":
        return f"{precision}-static" if graph == STATIC_INT8_GRAPH else precision
    return f"{'openvino' if backend == 'openvino' else backend}-{precision}"


def _suffix(label: str) -> str:
    """The repository-name suffix of a label outside the fixed variants (``openvino-fp32`` -> ``_ov_fp32``)."""
    backend, _, precision = label.rpartition("-")
    short = {"openvino": "ov", "": ""}.get(backend, backend.replace("-", "_"))
    return "_".join(["", *filter(None, (short, precision))])


#: the name suffix of the auto export a plan of fp32 and the default only serves as the default (:func:`auto_export`)
AUTO_SUFFIX = "_auto"


def model_names(model: str | None, default: dict | None = None,
                every: bool = True) -> tuple[ModelSource, dict[str, str]]:
    """The model source, and the repository name of its export in each configuration (``every``
    False: fp32 and the default, which is the auto export itself, :func:`auto_export`)."""
    source = resolve_model(model)
    base = check_name(source.default_name)
    names = {label: f"{base}{suffix}" for label, (_, _, suffix) in variants(default, every).items()}
    if not every and default is not None:
        names[default["label"]] = f"{base}{AUTO_SUFFIX}"
    return source, names


def auto_folder(repository: Path) -> Path:
    """Where the bench's ``auto`` export goes when it is not served: beside the served repository,
    not in it (Triton loads every folder of its repository)."""
    repository = Path(repository)
    return repository.parent / f"{repository.name}-auto"


def auto_export(options: "BenchOptions", plan: Plan) -> tuple[Path, str]:
    """Where the bench's ``auto`` export goes, and its name.  A plan that serves every configuration
    exports the default's again among them, so the auto export only says which it is, from
    :func:`auto_folder`.  A plan that serves fp32 and the default only (:attr:`Plan.every_variant`)
    exports it into the served repository as ``<name>_auto`` and serves it as the default: one export
    fewer, and of a base-size model each export takes minutes (OpenVINO int8's candidate graphs most)."""
    name = check_name(resolve_model(options.model).default_name)
    if plan.every_variant:
        return auto_folder(options.repository), name
    return Path(options.repository), f"{name}{AUTO_SUFFIX}"


def default_configuration(options: "BenchOptions", plan: Plan | None = None, export: bool = True) -> dict | None:
    """The configuration ``auto`` (what ``make export`` runs) exports on this machine, read from
    an auto export's validation.json: its ``measured`` table and the row it kept.  The export is
    made where :func:`auto_export` says unless one of this model is there (``reexport``: always);
    the choice is measured by the exporter, never inferred from CPU flags here.  None when the
    auto export fails (the targets then say the default is unknown).  ``plan``: None, the plan of
    the model's size."""
    from nexus_sli.exporter.errors import NexusError
    from nexus_sli.exporter.export.pipeline import ExportOptions, run_export

    source = resolve_model(options.model)
    folder, name = auto_export(options, plan or plan_for(options)[0])
    report = folder / f"{name}_encoder" / "validation.json"
    fresh = report.is_file() and json.loads(report.read_text()).get("model") == source.model_id
    if export and (options.reexport or not fresh):
        log.info("exporting %s with backend and precision auto into %s: the configuration the targets judge",
                 source.model_id, folder)
        try:
            run_export(ExportOptions(model=options.model, precision="auto", backend="auto", name=name, out=folder))
        except NexusError as exc:
            log.warning("the auto export failed, so the default configuration is unknown: %s", exc)
            return None
    if not report.is_file():
        return None
    return chosen_configuration(json.loads(report.read_text()), report)


def chosen_configuration(report: dict, path: Path | None = None) -> dict:
    """The row an auto export kept, as the bench's label, with the export's measured table."""
    chosen = next(row for row in report["measured"] if row["chosen"])
    return {"label": variant_label(chosen["backend"], chosen["precision"], chosen["graph"]),
            "backend": chosen["backend"],
            "precision": chosen["precision"], "graph": chosen["graph"], "source": None if path is None else str(path),
            "optimize": report.get("timing", {}).get("optimize", "balanced"),
            "measured": [{k: row.get(k) for k in ("backend", "precision", "graph", "passed", "cosine_min",
                                                  "cosine_mean", "timings_ms", "score", "chosen")}
                         for row in report["measured"]]}


#: Configurations whose export failed validation, with the reason (kept beside the exports).
SKIPPED_FILE = ".skipped.json"


def ensure_exported(options: BenchOptions, plan: Plan | None = None) -> dict[str, str]:
    """Export the model in every configuration the plan serves (None: the plan of its size) into
    the bench repository unless it already holds exports of this model (or ``reexport`` asks for
    fresh ones).  A configuration whose export fails validation is left out, and the reason recorded."""
    from nexus_sli.exporter.errors import ValidationError
    from nexus_sli.exporter.export.pipeline import ExportOptions, run_export

    plan = plan or plan_for(options)[0]
    default = default_configuration(options, plan)
    source, names = model_names(options.model, default, plan.every_variant)
    skipped_file = Path(options.repository) / SKIPPED_FILE
    skipped = json.loads(skipped_file.read_text()) if skipped_file.is_file() and not options.reexport else {}
    for label, name in names.items():
        if not plan.every_variant and default is not None and label == default["label"]:
            continue  # the auto export, made above into the repository (auto_export)
        backend, precision, _ = variants(default)[label]
        only_auto = default is not None and label == default["label"] and default.get("graph") == STATIC_INT8_GRAPH
        if only_auto:  # ONNX Runtime's static int8: only an export held to the auto bar makes it
            precision = "auto"
        report = Path(options.repository) / f"{name}_encoder" / "validation.json"
        if label in skipped or (not options.reexport and report.is_file()
                                and json.loads(report.read_text()).get("model") == source.model_id):
            continue
        log.info("exporting %s (%s) into %s as %s", source.model_id, label, options.repository, name)
        try:
            run_export(ExportOptions(model=options.model, precision=precision, backend=backend, name=name,
                                     out=Path(options.repository)))
        except ValidationError as exc:
            log.warning("%s is left out of the bench: %s", label, exc)
            skipped[label] = str(exc)
            continue
        kept = chosen_configuration(json.loads(report.read_text()))["label"] if only_auto else label
        if kept != label:  # auto's choice is a timing: this export of it may have kept another graph
            log.warning("%s is left out of the bench: its export kept %s instead", label, kept)
            skipped[label] = f"the bench's ONNX Runtime auto export kept {kept}, not {label}"
    Path(options.repository).mkdir(parents=True, exist_ok=True)
    skipped_file.write_text(json.dumps(skipped, indent=2) + "\n")
    return {label: name for label, name in names.items() if label not in skipped}


def export_skips(repository: Path) -> list[dict]:
    path = Path(repository) / SKIPPED_FILE
    found = json.loads(path.read_text()) if path.is_file() else {}
    return [{"path": f"triton / in-process {label}", "mode": "all", "reason": f"export failed validation: {reason}"}
            for label, reason in found.items()]


def short_queries(texts: list[str], tokens: list[int], n: int) -> list[str]:
    """Short queries from the set: the first ``n`` of at most 16 tokens, topped up with the shortest."""
    short = [t for t, k in zip(texts, tokens) if k <= SHORT_QUERY_TOKENS]
    if len(short) < n:
        short += [t for _, t in sorted(zip(tokens, texts)) if t not in short]
    return short[:n]


def _sweep(facts, texts: list[str], plan: Plan, skipped: list[dict]) -> dict[int, list[str]]:
    tokenizer = facts.tokenizer()
    tokenizer.no_truncation()
    sweep = {}
    for n in plan.seq_lens:
        if n > facts.max_length:
            skipped.append({"path": "every path", "mode": f"{n} tokens",
                            "reason": f"the model takes at most {facts.max_length} tokens"})
            continue
        count = max(32, plan.seq_tokens // n // 32 * 32)
        sweep[n] = text_set.texts_of_length(tokenizer, texts, n, count)
    return sweep


def prepare(options: BenchOptions, plan: Plan) -> Setup:
    from .runners import ServedFacts, token_counts

    names = ensure_exported(options, plan)
    source = resolve_model(options.model)
    default = default_configuration(options, plan, export=False)  # ensure_exported made it
    if default is not None and default["label"] in names:
        # the bench's own export of that configuration picks its graph by timing too: say which it serves
        served = Path(options.repository) / f"{names[default['label']]}_encoder" / "validation.json"
        default["served_graph"] = json.loads(served.read_text()).get("graph")
    facts = {p: ServedFacts.read(Path(options.repository), name) for p, name in names.items()}
    texts = text_set.subset(text_set.bench_texts(), plan.texts or 10**9)
    tokens = token_counts(facts["fp32"], texts)
    setup = Setup(source.model_id, Path(source.path), Path(options.repository), names, facts, texts, tokens,
                  short_queries(texts, tokens, plan.latency_queries), {}, default=default)
    setup.skipped.extend(export_skips(options.repository))
    setup.sweep = _sweep(facts["fp32"], texts, plan, setup.skipped)
    setup.short = [t for t, k in zip(texts, tokens) if k <= SHORT_QUERY_TOKENS]
    return setup


@dataclass
class InProcess:
    path: str
    precision: str
    encoder: object
    baseline: bool = False      # a baseline candidate: the fastest candidate of each mode is the reference
    threads: int | None = None  # torch intra-op threads (None: not a torch path)
    torch: bool = False
    latency: bool = False       # also timed on single queries (the default graph: target (c)'s overhead)


def _baselines(setup: Setup) -> list[InProcess]:
    from .runners import SentenceTransformersEncoder, TorchEncoder, has_sentence_transformers_config, torch_thread_counts

    threads = torch_thread_counts()
    if has_sentence_transformers_config(setup.model_dir):
        model = SentenceTransformersEncoder.load(setup.model_dir)
        return [InProcess("sentence-transformers", "fp32", SentenceTransformersEncoder(model, n), True, n, True)
                for n in threads]
    # No sentence-transformers folder (a bare checkpoint): the baseline is PyTorch fp32 with the
    # model's pooling, the reference the exporter itself validates against.
    fp32 = setup.facts["fp32"]
    log.warning("%s has no sentence-transformers config: the baseline falls back to PyTorch fp32 "
                "with %s pooling", setup.model_id, fp32.pooling)
    model = TorchEncoder.load(setup.model_dir)
    return [InProcess("pytorch (baseline fallback)", "fp32", TorchEncoder(model, fp32, threads=n), True, n, True)
            for n in threads]


def _peers(setup: Setup, plan: Plan) -> list[InProcess]:
    from .runners import GraphEncoder, TorchEncoder

    fp32, peers = setup.facts["fp32"], []
    if plan.torch_peers:
        model = TorchEncoder.load(setup.model_dir)
        peers.append(InProcess("pytorch", "fp32", TorchEncoder(model, fp32), torch=True))
        if machine.supports_bf16():
            peers.append(InProcess("pytorch", "bf16 autocast", TorchEncoder(model, fp32, bf16=True), torch=True))
        else:
            setup.skipped.append({"path": "pytorch bf16", "mode": "all", "reason": "the CPU has no bf16 support"})
    default = setup.default["label"] if setup.default else None
    for label in setup.names:
        encoder = GraphEncoder.for_model(setup.repository, setup.facts[label])
        peers.append(InProcess(encoder.path, in_process_precision(label), encoder, latency=label == default))
    return peers


def calibrate_torch_threads(baselines: list[InProcess], peers: list[InProcess], texts: list[str]) -> dict:
    """The PyTorch peers run at the thread count the baseline was fastest with on ``texts``
    (which also warms the baseline up); the baseline itself keeps both, measured side by side."""
    seconds = {}
    for candidate in baselines:
        timings = []
        for _ in range(2):
            started = time.perf_counter()
            candidate.encoder(texts)
            timings.append(time.perf_counter() - started)
        seconds[candidate.threads] = min(timings)
    best = min(seconds, key=seconds.get)
    for peer in peers:
        if peer.torch:
            peer.threads = peer.encoder.threads = best
    return {"peers": best, "calibration_s": {str(k): round(v, 3) for k, v in seconds.items()},
            "calibration_texts": len(texts)}


def _groups(setup: Setup) -> dict:
    """The texts of each group of rows, with their token counts."""
    from .runners import token_counts

    fp32 = setup.facts["fp32"]
    return {
        "set": dict(texts=setup.texts, token_counts=setup.tokens, sliced=True),
        "latency": dict(texts=setup.queries, token_counts=token_counts(fp32, setup.queries)),
        # every short text in each repetition, unsliced: a slice would hold two batches of 32
        "short": dict(texts=setup.short, token_counts=token_counts(fp32, setup.short)),
        "seq": {n: dict(texts=texts, token_counts=token_counts(fp32, texts), seq_len=n)
                for n, texts in setup.sweep.items()},
    }


def in_process_measurements(setup: Setup, plan: Plan, encoders: list[InProcess]) -> list[Measurement]:
    groups, measurements = _groups(setup), []
    for p in encoders:
        common = dict(path=p.path, precision=p.precision, protocol="in-process", baseline=p.baseline,
                      threads=p.threads)
        measurements.append(Measurement(mode=BATCH32, run=timed(p.encoder), **groups["set"], **common))
        if p.baseline and setup.short:
            measurements.append(Measurement(mode=SHORT32, run=timed(p.encoder), **groups["short"], **common))
        if p.baseline or p.latency:
            measurements.append(Measurement(mode=LATENCY1, run=one_by_one(p.encoder, plan.latency_budget_s),
                                            **groups["latency"], **common))
        if p.baseline:
            measurements += [Measurement(mode=SEQ_LEN, run=timed(p.encoder), **group, **common)
                             for group in groups["seq"].values()]
    return measurements


def gateway_measurements(setup: Setup, plan: Plan, gateway, clients: list) -> list[Measurement]:
    """The fp32 model through the HTTP gateway (OpenAI's API, the ``openai`` SDK): beside the
    direct gRPC rows, its overhead is measured, not guessed."""
    from .served import GatewayEmbedder

    groups = _groups(setup)
    embedder = GatewayEmbedder(gateway.url, GATEWAY_PROTOCOL, setup.names["fp32"])
    clients.append(embedder)
    common = dict(path=GATEWAY_PATH, precision="fp32", protocol=GATEWAY_PROTOCOL, served=True)
    single = functools.partial(embedder.sequential, budget_s=plan.latency_budget_s)
    return [Measurement(mode=BATCH32, run=embedder.batches, **groups["set"], **common),
            Measurement(mode=CONCURRENT16, run=embedder.concurrent, **groups["set"], **common),
            Measurement(mode=LATENCY1, run=single, **groups["latency"], **common)]


def served_measurements(setup: Setup, plan: Plan, server, clients: list) -> list[Measurement]:
    from .served import ServedEmbedder

    groups, measurements = _groups(setup), []
    for precision, name in setup.names.items():
        for protocol in plan.protocols:
            embedder = ServedEmbedder(server.url(protocol), protocol, name)
            clients.append(embedder)
            common = dict(path="triton", precision=precision, protocol=protocol, served=True)
            single = functools.partial(embedder.sequential, budget_s=plan.latency_budget_s)
            measurements += [
                Measurement(mode=BATCH32, run=embedder.batches, **groups["set"], **common),
                Measurement(mode=CONCURRENT16, run=embedder.concurrent, **groups["set"], **common),
                Measurement(mode=LATENCY1, run=single, **groups["latency"], **common),
            ]
            if setup.short:
                measurements.append(Measurement(mode=SHORT32, run=embedder.batches, **groups["short"], **common))
            if protocol == plan.protocols[0]:
                measurements += [Measurement(mode=SEQ_LEN, run=embedder.batches, **group, **common)
                                 for group in groups["seq"].values()]
    return measurements


def _warm_up(measurements: list[Measurement], plan: Plan) -> None:
    for m in measurements:
        count = 4 if m.mode == LATENCY1 else plan.warmup_texts if m.mode != SEQ_LEN else 32
        m.warm_up(m.texts[:count])


def _idle_rss(server, samples: int = 5) -> list[int]:
    values = []
    for _ in range(samples):
        time.sleep(0.2)
        values.append(server.rss_bytes())
    return values


@dataclass
class Repetitions:
    """How many timed repetitions a run makes, and a record of the ones it made.

    At least ``minimum``; after that one more while a target's paired ratios spread by
    :data:`targets.SPREAD_LIMIT` or more, up to ``maximum`` and while one more repetition
    (at the mean duration so far) still fits in ``budget_s``.  Sliced rows time slice
    ``r % slices`` in repetition r (:meth:`Measurement.time_once`)."""

    minimum: int
    maximum: int
    slices: int
    budget_s: float
    default: dict | None = None
    seconds: list[float] = field(default_factory=list)
    stopped: str = ""

    @classmethod
    def for_plan(cls, plan: "Plan", asked: int | None, default: dict | None) -> "Repetitions":
        minimum = asked or plan.repetitions
        # slices: the plan's repetition count, so its minimum covers the set once (fewer when fewer are asked)
        return cls(minimum, max(minimum, plan.max_repetitions), min(plan.repetitions, minimum),
                   plan.repetition_budget_s, default)

    @property
    def done(self) -> int:
        return len(self.seconds)

    def another(self, measurements: list[Measurement]) -> bool:
        """Whether to time one more repetition (and why not, in ``stopped``)."""
        from .targets import evaluate, unsettled

        if self.done < self.minimum:
            return True
        spread = unsettled(evaluate(rows(measurements), self.default))
        if not spread:
            self.stopped = "every measured target's spread is under the limit" if self.done > 1 else "one repetition"
        elif self.done >= self.maximum:
            self.stopped = f"the cap of {self.maximum} repetitions, {len(spread)} comparison(s) still spread"
        elif sum(self.seconds) + float(np.mean(self.seconds)) > self.budget_s:
            self.stopped = f"the {self.budget_s:.0f} s budget, {len(spread)} comparison(s) still spread"
        else:
            log.info("%d comparison(s) spread by %s or more: one more repetition", len(spread),
                     ", ".join(f"{t['spread']:.0%}" for t in spread))
            return True
        return False

    def record(self) -> dict:
        return {"repetitions": self.done, "minimum": self.minimum, "maximum": self.maximum, "slices": self.slices,
                "budget_s": self.budget_s, "repetition_s": [round(x, 1) for x in self.seconds],
                "stopped": self.stopped}


def protocol_turns(measurements: list[Measurement], repetition: int) -> list[Measurement]:
    """``measurements`` in the order repetition ``repetition`` times them: the served rows over each
    client protocol take turns going first (gRPC in even repetitions, HTTP in odd ones), so a cost
    the first protocol pays for the server (a runtime compiling for a new input shape) does not
    always fall on the same protocol.  Everything else keeps its place."""
    served = sorted({m.protocol for m in measurements if m.served and m.path == "triton"})
    if repetition % 2 == 0 or len(served) < 2:
        return list(measurements)
    first = {}  # precision -> where its served block starts
    for index, m in enumerate(measurements):
        if m.served and m.path == "triton":
            first.setdefault(m.precision, index)
    flipped = {protocol: rank for rank, protocol in enumerate(reversed(sorted(served, key=("grpc", "http").index)))}

    def key(item: tuple[int, Measurement]):
        index, m = item
        if m.served and m.path == "triton":
            return (first[m.precision], flipped[m.protocol], index)
        return (index, 0, index)
    return [m for _, m in sorted(enumerate(measurements), key=key)]


def run_repetitions(measurements: list[Measurement], repetitions: Repetitions, sampler) -> None:
    """Every measurement once per repetition, interleaved, for as many repetitions as
    ``repetitions`` asks (:class:`Repetitions`)."""
    while repetitions.another(measurements):
        started = time.perf_counter()
        for m in protocol_turns(measurements, repetitions.done):
            sampler.active(m.served)
            m.time_once(repetitions.done, repetitions.slices)
        sampler.active(False)
        repetitions.seconds.append(time.perf_counter() - started)
        log.info("repetition %d (at least %d, at most %d): %.1f s", repetitions.done, repetitions.minimum,
                 repetitions.maximum, repetitions.seconds[-1])


def _row(m: Measurement, reference: Measurement, baseline_batch: Measurement) -> dict:
    cos = cosines(m.embeddings(), reference.embeddings())
    p50, p99 = m.percentile_ms(50), m.percentile_ms(99)
    if m.mode == LATENCY1:
        ratio = reference.percentile_ms(50) / p50 if p50 else None  # speed-up: > 1 is faster
    else:
        against = baseline_batch if m.mode == CONCURRENT16 else reference
        ratio = m.texts_per_s() / against.texts_per_s()
    return {
        "path": m.path, "precision": m.precision, "protocol": m.protocol, "mode": m.mode,
        "seq_len": m.seq_len, "threads": m.threads, "texts": len(m.texts), "texts_timed": m.texts_timed(),
        "repetitions": len(m.samples),
        "texts_per_s": round(m.texts_per_s(), 2), "tokens_per_s": round(m.tokens_per_s(), 1),
        "p50_ms": None if p50 is None else round(p50, 3), "p99_ms": None if p99 is None else round(p99, 3),
        "cosine_mean": round(float(cos.mean()), 7), "cosine_min": round(float(cos.min()), 7),
        "ratio_vs_baseline": None if ratio is None else round(ratio, 3), "baseline": m is reference,
        "peer": m.peer,
        # repetition by repetition, for the targets' paired ratios (bench/targets.py)
        "texts_per_s_reps": [round(x, 3) for x in m.rates()],
        "p50_ms_reps": [None if x is None else round(x, 4) for x in m.percentiles_ms(50)],
        "p99_ms_reps": [None if x is None else round(x, 4) for x in m.percentiles_ms(99)],
    }


def references(measurements: list[Measurement]) -> dict[tuple, Measurement]:
    """Per group of rows, the fastest baseline candidate (highest texts/s; lowest p50 for single queries)."""
    found: dict[tuple, Measurement] = {}
    for m in measurements:
        if not m.baseline:
            continue
        best = found.get(m.group)
        if best is None:
            found[m.group] = m
        elif m.mode == LATENCY1 and m.percentile_ms(50) < best.percentile_ms(50):
            found[m.group] = m
        elif m.mode != LATENCY1 and m.texts_per_s() > best.texts_per_s():
            found[m.group] = m
    return found


def rows(measurements: list[Measurement]) -> list[dict]:
    chosen = references(measurements)
    return [_row(m, chosen[m.group], chosen[("set", None)]) for m in measurements]


def _memory(idle: list[int], load: list[int], processes: int) -> dict:
    mb = 2**20
    return {"idle_mb": round(float(np.median(idle)) / mb, 1),
            "load_median_mb": round(float(np.median(load)) / mb, 1) if load else None,
            "load_peak_mb": round(max(load) / mb, 1) if load else None,
            "samples_under_load": len(load), "processes": processes}


def _peer_processes(setup: Setup, plan: Plan):
    """fastembed and infinity-emb, installed and started (or skipped with the reason), stopped on exit."""
    from .peers import NoPeers, Peers

    if not plan.peers:
        setup.skipped.append({"path": "fastembed, infinity-emb (peers)", "mode": "all",
                              "reason": "a quick run leaves the peers out: the full bench (make bench) runs them"})
        return NoPeers()
    fp32 = setup.facts["fp32"]
    peers = Peers(setup.model_id, setup.model_dir, fp32, setup.skipped)
    setup.peers = peers.info
    return peers


def measure(setup: Setup, plan: Plan, repetitions: "Repetitions") -> tuple[list[Measurement], dict, dict]:
    from .served import Gateway, RssSampler, Server

    baselines, peers = _baselines(setup), _peers(setup, plan)
    threads = calibrate_torch_threads(baselines, peers, setup.texts[:plan.warmup_texts])
    measurements = in_process_measurements(setup, plan, [*baselines, *peers])
    clients: list = []
    with _peer_processes(setup, plan) as peer_processes, Server(setup.repository) as server, \
            Gateway(server.url("grpc")) as gateway:
        try:
            measurements += peer_processes.measurements(_groups(setup), plan.latency_budget_s)
            measurements += served_measurements(setup, plan, server, clients)
            measurements += gateway_measurements(setup, plan, gateway, clients)
            log.info("warming up %d measurements", len(measurements))
            _warm_up(measurements, plan)
            idle = _idle_rss(server)
            processes = len(machine.process_tree(server.process.pid))
            with RssSampler(server) as sampler:
                run_repetitions(measurements, repetitions, sampler)
        finally:
            for client in clients:
                client.close()
    return measurements, _memory(idle, sampler.samples, processes), threads


def _padding(setup: Setup, facts) -> dict:
    """Real tokens over the tokens the encoder computes when a client sends the set in
    batches of 32 (each batch planned into length groups, as the served encoder does)."""
    import numpy as np

    from nexus_sli.exporter.serving.backends.batching import length_groups as group_rows

    real = computed = 0
    for i in range(0, len(setup.tokens), 32):
        lengths = np.minimum(np.array(setup.tokens[i:i + 32]), facts.max_length)
        real += int(lengths.sum())
        computed += sum(len(rows) * int(lengths[rows].max()) for rows in group_rows(lengths))
    return {"served_batch32_real_token_share": round(real / computed, 3)}


def run_bench(options: BenchOptions) -> dict:
    """Measure, write ``latest.json``, ``latest.md`` and ``latest.png`` under ``options.out``."""
    from . import compute_limit, report
    from .runners import token_counts
    from .targets import evaluate

    started = time.perf_counter()
    plan, shape = plan_for(options)
    log.info("plan: %s (%s: %.0f M matmul FLOPs per token)", plan.name, resolve_model(options.model).model_id,
             shape.flops_per_token() / 1e6)
    info, checkout = machine.machine_info(), machine.checkout()  # the checkout before the run writes results
    setup = prepare(options, plan)
    repetitions = Repetitions.for_plan(plan, options.repetitions, setup.default)
    measurements, memory, threads = measure(setup, plan, repetitions)
    table = rows(measurements)
    stats = text_set.length_stats(token_counts(setup.facts["fp32"], setup.texts, truncate=False),
                                  setup.facts["fp32"].max_length)
    limit = compute_limit.summary(setup.model_dir, setup.tokens, table, (BATCH32, CONCURRENT16))
    results = {
        "schema": 1,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": options.command,
        "quick": options.quick,
        "layout": layout(options.model).record(options.repository, options.out, options.benchmarks_md),
        "model": setup.model_id,
        "served_models": setup.names,
        "machine": info,
        "libraries": machine.library_versions(),
        "checkout": checkout,
        "default_configuration": setup.default,
        "settings": {"plan": plan_record(plan, shape, options.quick, len(text_set.bench_texts())),
                     "repetitions": repetitions.done, "repetition_plan": repetitions.record(),
                     "batch_size": 32, "concurrent_clients": 16,
                     "latency_queries": len(setup.queries), "protocols": list(plan.protocols),
                     "latency_budget_s": plan.latency_budget_s, "seq_lens": sorted(setup.sweep),
                     "warmup_texts": plan.warmup_texts, "torch_threads": threads},
        "text_set": {**stats, **_padding(setup, setup.facts["fp32"])},
        "server_memory": memory,
        "rows": table,
        "skipped": setup.skipped,
        "peers": setup.peers,
        "targets": evaluate(table, setup.default, limit),
        "compute_limit": limit,
        "duration_s": round(time.perf_counter() - started, 1),
    }
    report.write_all(results, Path(options.out), options.benchmarks_md)
    return results
