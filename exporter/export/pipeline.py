"""The export pipeline, the only orchestrator of an export.

    model source -> layer walk -> plain ONNX -> PyTorch reference (once)
      -> for every configuration of :func:`targets.configurations_for`: the target's candidate
         graphs (embeddings: ending in the pooling), each validated and closed again
      -> every graph that passed, reopened and timed side by side on the bench's
         workload (in heats that fit in memory: :func:`timing.time_in_heats`)
      -> the fastest passing graph of all -> the Triton repository (staged, then published)

Every other module does one step and knows nothing of the others.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from google.protobuf.text_format import ParseError
from tokenizers import Tokenizer

from nexus_sli.exporter.errors import ExportError, NexusError, ValidationError
from nexus_sli.exporter.targets import Candidate, Configuration, ExportedGraph, configurations_for
from nexus_sli.exporter.triton.config import MAX_ROWS_ASKED
from nexus_sli.exporter.triton.config import read as read_config
from nexus_sli.exporter.triton.folders import check_free
from nexus_sli.exporter.triton.models import ServingFacts, write_models, write_readme
from nexus_sli.exporter.triton.python_models.encoding import load_tokenizer
from nexus_sli.exporter.triton.python_models.sides import SCORE_MASK, SIDE_NAMES, Sides, row_width
from nexus_sli.exporter.triton.staging import Staging
from nexus_sli.tasks import get_task, infer_task
from nexus_sli.tasks.model_parameters import MATRYOSHKA_DIMS, TASK, Prompts, message_strings, write
from nexus_sli.tasks.spec import TOKEN_MODEL_SUFFIX

from . import export_report, onnx_files, stored_reference
from .candidate_cache import open_candidate_cache
from .checkpoint import Checkpoint
from .embedders import ModelFolder, poolers
from .export_report import AttemptRecord, CandidateRecord, ExportReport, Heat, MeasuredRow, Timing, WalkRecord
from .handler import get_registry
from .m3_heads import M3Embedder, check_heads, is_bge_m3
from .multi_vector import add_markers, is_multi_vector
from .onnx_export import export_onnx, model_input_names
from .optimize import free_cycles
from .quantize import scales_per_batch
from .report import ValidationReport
from .source import check_name, load_config, max_sequence_length, resolve_model, tokenizer_file
from .st_folder import is_sparse_encoder, matryoshka_dims, prompts
from .timing import DEFAULT_OBJECTIVE, Heats, Workload, check_objective, footprint, memory_budget, time_in_heats, workloads
from .validate import (Embedder, MultiVectorEmbedder, Reference, SparseEmbedder, build_reference, compare,
                       parity_cases, sided_text_batches, text_batches, with_auto_bar, with_score_masks)
from .validate import thresholds as validate_thresholds
from .walk import open_layer_cache, walk

log = logging.getLogger("nexus_sli.export")


@dataclass
class ExportOptions:
    model: str | None = None
    task: str = "auto"
    #: fp32, bf16 (openvino), int8, or auto; the API's default is fixed, the CLI's is auto
    precision: str = "fp32"
    #: the runtime target serving the encoder (:data:`targets.TARGETS`: onnxruntime, openvino, ...), or auto
    backend: str = "onnxruntime"
    #: where the encoder will run (cpu, gpu): ``auto`` chooses among that device's targets
    device: str = "cpu"
    name: str | None = None
    out: Path = Path("model_repository")
    allow_pickle: bool = False
    allow_degraded: bool = False
    truncate: bool = True
    #: reuse layers and derived (quantized) candidate graphs cached by an earlier export of the same checkpoint
    #: (and cache this one's): :mod:`layer_cache`, :mod:`candidate_cache`
    cache: bool = True
    #: None: $NEXUS_SLI_CACHE_DIR, else ~/.cache/nexus-sli/layers (the LayerCache default)
    cache_dir: Path | None = None
    #: embeddings (dense and sparse): pooling (and normalisation) at the end of the encoder graph, the
    #: ensemble tokenizer -> encoder (:mod:`pooling`); False writes the earlier tokenizer -> encoder ->
    #: python post-processing ensemble.  Internal: kept to measure both layouts (bench/data/tried.md,
    #: "Pooling inside the encoder graph").
    pool_in_graph: bool = True
    #: what ``auto`` keeps the fastest graph for (:data:`timing.OBJECTIVES`): balanced, throughput or latency
    optimize: str = DEFAULT_OBJECTIVE
    #: False: the first configuration's first candidate graph only, validated as every candidate is, nothing
    #: else made or timed (ONNX Runtime fp32: the plain graph; what ``nexus-sli serve`` answers with first)
    search: bool = True
    #: rows one execution of each step may merge, and the most texts one request carries; None: the device's
    #: default (:data:`triton.config.MAX_BATCH_SIZE`, ``GPU_MAX_BATCH_SIZE``).  Larger carries large calls
    #: faster and makes a lone query wait longer behind them (bench/data/tried.md, "A CPU repository's rows
    #: an execution")
    max_batch_size: int | None = None


@dataclass
class ExportResult:
    name: str
    models: list[Path]
    #: what was written to the encoder's validation.json
    report: ExportReport


@dataclass
class Prepared:
    """What every configuration shares, made once per export."""

    source: Any
    config: Any
    task: Any
    family: Any
    tokenizer_path: Path
    graph: ExportedGraph
    reference: Reference
    #: how the graph's output becomes the served answer where the task pools (:mod:`embedders`)
    embedder: Embedder | SparseEmbedder | MultiVectorEmbedder | None
    walk: WalkRecord
    #: what every passing candidate is timed on
    workloads: list[Workload]


@dataclass
class Attempt:
    """One configuration's candidates after validation and timing."""

    configuration: Configuration
    candidates: list[Candidate]
    #: what the target left out for a large graph, and why (:meth:`Target.left_out`)
    left_out: str | None = None

    @property
    def passed(self) -> list[Candidate]:
        return [c for c in self.candidates if c.report.passed]

    def summary(self) -> str:
        return "; ".join(f"{c.graph}: {c.report.summary()}" for c in self.candidates)

    def record(self) -> AttemptRecord:
        return AttemptRecord(backend=self.configuration.target.name, precision=self.configuration.precision,
                             reason=self.configuration.reason, passed=bool(self.passed),
                             failures=[] if self.passed else [self.summary()], left_out=self.left_out or None)

    def rows(self, chosen: Candidate) -> list[MeasuredRow]:
        """The measurement table's rows: every candidate, its fidelity and its timings."""
        report_fields = ("passed", "cosine_min", "cosine_mean", "agreement", "max_abs_diff", "score_error",
                         "rank_agreement", "terms_kept")
        return [MeasuredRow(backend=self.configuration.target.name, precision=self.configuration.precision,
                            graph=c.graph, **{f: getattr(c.report, f) for f in report_fields},
                            timings_ms={k: round(v, 3) for k, v in (c.timings or {}).items()},
                            score=_rounded(c.score, 4), chosen=c is chosen)
                for c in self.candidates]


def run_export(options: ExportOptions) -> ExportResult:
    """Export, validate and publish one model; see the module docstring for the steps."""
    configurations = configurations_for(options.backend, options.precision, device=options.device)
    configurations = configurations if options.search else configurations[:1]
    check_objective(options.optimize)
    check_max_batch_size(options.max_batch_size)
    if options.task != "auto":
        get_task(options.task)  # an unknown task fails before any download
    source = resolve_model(options.model, options.allow_pickle)
    name = _name(options, source)
    with Staging(Path(options.out)) as stage:
        prepared = prepare(options, source, stage.work)
        log.info("exporting %s (%s, %d layers) as %s, task %s; trying %s", source.model_id,
                 prepared.family.model_type, prepared.family.num_layers(prepared.config), name,
                 prepared.task.name, ", then ".join(c.describe() for c in configurations))
        # a candidate that misses a bar stops there, unless the closest of failing ones may be kept: that
        # choice reads every text's figures
        attempts, tried = _attempts(configurations, prepared, stop_early=not options.allow_degraded,
                                    first_only=not options.search)
        fastest, timing = _time(attempts, prepared.workloads, options.optimize)
        attempt, chosen = _choose(attempts, fastest, options.allow_degraded)
        _log_table(attempts, chosen)
        report = _report(options, prepared, attempts, attempt, chosen, timing, tried)
        if report.kept_because:
            log.info("kept %s", report.kept_because)
        ensembles = _write(stage.root, name, prepared, attempt, chosen, report, options.max_batch_size)
        # an earlier export of this name may have had a post-processing step, or a token ensemble, the new lacks
        retire = ((f"{name}_postprocess",) if prepared.graph.pooled else ()) + (
            () if name + TOKEN_MODEL_SUFFIX in ensembles else (name + TOKEN_MODEL_SUFFIX,))
        models = stage.publish(retire=retire)
        write_readme(Path(options.out))
    log.info("wrote %s", ", ".join(str(m) for m in models))
    return ExportResult(name, models, report)


def _name(options: ExportOptions, source) -> str:
    """The model's name in the repository: the one asked for, else the model id's; refused where another model
    of the repository uses one of the folders it writes."""
    name = check_name(options.name or source.default_name)
    check_free(Path(options.out), name)
    return name


def _say_replaced(out: Path, name: str, task: str) -> None:
    """Warn where the repository serves ``name`` for another task (its ensemble's task parameter, as clients read
    it): the export replaces it once it passes, and clients calling it for the other task's outputs will fail."""
    ensemble = out / name / "config.pbtxt"
    try:
        served = TASK.read(message_strings(read_config(ensemble).parameters), "") if ensemble.is_file() else ""
    except (ParseError, ValueError):  # a config no export wrote: replaced as before, nothing to say of its task
        return
    if served and served != task:
        log.warning("%s serves %s for the task %s; this export will replace it with one for the task %s once it "
                    "passes (pass --name to keep both)", out, name, served, task)


def prepare(options: ExportOptions, source, work: Path) -> Prepared:
    """Walk the checkpoint into a PyTorch model, export the plain graph and compute the reference (into ``work``;
    public for experiments and tests that validate graphs of their own against an export's reference)."""
    config = load_config(source.path)
    task = _task(options, source, config)
    refused = task.refusal(config)
    if refused:  # before the walk: the export would pass, and every request to it fail
        raise NexusError(f"{source.path} cannot be served as task {task.name!r}: {refused}")
    _say_replaced(Path(options.out), _name(options, source), task.name)
    handler = get_registry().detect_family(config)
    family = handler.family
    max_length = max_sequence_length(source.path, family, config)
    tokenizer_path = tokenizer_file(source.path, work)
    # what the folder says about pooling is read first: a model the export cannot reproduce fails before the walk
    embedder, pooling = poolers(ModelFolder(source.path, task, family.hidden_size(config), family.vocab_size(config),
                                            load_tokenizer(tokenizer_path, max_length), family.max_positions(config),
                                            options.allow_pickle, max_length))
    in_graph = pooling if options.pool_in_graph else None  # each target appends it to its candidates
    if in_graph is None and getattr(embedder, "graph_only", None):
        raise ExportError(f"the python post-processing step does not apply {' or '.join(embedder.graph_only)}: "
                          "export this model with the pooling in the graph (the default)")
    tokenizer_path = _served_tokenizer(tokenizer_path, embedder, work)
    max_length = _served_length(max_length, getattr(embedder, "sides", None))
    model, walked = _walk(options, source, config, task, handler)
    tokenizer = load_tokenizer(tokenizer_path, max_length)
    pad_id = _pad_id(config, tokenizer)
    log.info("exporting the plain ONNX graph")
    input_names = export_onnx(model, task, model_input_names(model, config), family.vocab_size(config),
                              work / "plain.onnx")
    data = onnx_files.data_files(work / "plain.onnx")
    log.info("plain ONNX graph: %s", f"{sum(f.stat().st_size for f in data) / 1e9:.2f} GB of weights in "
             f"{data[0].name}, beside the graph (past ONNX's 2 GB protobuf limit)" if data else "one file")
    graph = ExportedGraph(work / "plain.onnx", work, family, config, task, input_names, tokenizer, pad_id,
                          max_length, in_graph, large=bool(data),
                          cache=open_candidate_cache(options.cache_dir) if options.cache else None)
    reference = _reference(model, graph, tokenizer_path, embedder)
    loads = [replace(load, feeds=graph.complete(load.feeds))
             for load in workloads(tokenizer, input_names, pad_id, max_length, pairs=task.pair)]
    return Prepared(source, config, task, family, tokenizer_path, graph, reference, embedder, walked, loads)


def _reference(model, graph: ExportedGraph, tokenizer_path: Path, embedder) -> Reference:
    """PyTorch's outputs on the parity cases and the validation texts, fed as the candidates are: a
    late-interaction graph's cases carry a scoring mask, and its texts are tokenized on each side."""
    inputs, family, config, pad_id = graph.served_inputs, graph.family, graph.config, graph.pad_id
    cases = parity_cases(graph.input_names, family.vocab_size(config), pad_id, family.max_positions(config))
    if SCORE_MASK in inputs:
        cases = with_score_masks(cases)
    if graph.task.tokenizer_mode == "sided":
        texts = sided_text_batches(tokenizer_path, embedder.sides, inputs, pad_id)
    else:
        texts = text_batches(graph.tokenizer, inputs, pad_id, graph.max_length, pairs=graph.task.pair)
    log.info("computing the PyTorch fp32 reference: %d parity cases, %d text batches", len(cases), len(texts))
    return build_reference(model, graph.task, inputs, cases, texts)


def _served_tokenizer(path: Path, embedder, work: Path) -> Path:
    """The tokenizer.json the repository serves: the model's, with the markers a late-interaction model's
    legacy save has sentence-transformers register as special tokens (:func:`multi_vector.add_markers`)."""
    read = getattr(embedder, "config", None)  # the late-interaction folder as read (multi_vector.MultiVectorConfig)
    if read is None or not read.added_special_tokens:
        return path
    served = work / "served-tokenizer.json"
    add_markers(Tokenizer.from_file(str(path)), read).save(str(served))
    log.info("markers registered as special tokens in the served tokenizer: %s", ", ".join(read.added_special_tokens))
    return served


def _served_length(max_length: int, sides: Sides | None) -> int:
    """The longest row the tokenizer step sends: the model's length, or a late-interaction model's widest side
    (a side's own length, which the folder may set past the model's, or its query expansion), every row of
    which the step pads within it."""
    if sides is None:
        return max_length
    return max(max_length, *(row_width(sides.side(name).max_length, sides.side(name)) for name in SIDE_NAMES))


def _task(options: ExportOptions, source, config):
    """The task asked for; for ``auto``, BGE-M3's three outputs where the folder has its two heads, sparse
    embeddings where it is a SparseEncoder's, late interaction where it is a MultiVectorEncoder's (PyLate's,
    Stanford ColBERT's), else the task the config's architectures say (a ``*ForMaskedLM`` architecture alone
    says dense embeddings).  A folder with some of BGE-M3's heads but not all is refused (:func:`check_heads`)."""
    check_heads(source.path, options.task)
    if options.task != "auto":
        return get_task(options.task)
    if is_bge_m3(source.path):
        return get_task("bge-m3")
    if is_sparse_encoder(source.path):
        return get_task("sparse-embedding")
    if is_multi_vector(source.path):
        return get_task("multi-vector")
    return infer_task(config)


def _walk(options: ExportOptions, source, config, task, handler):
    """The task model rebuilt layer by layer (from the layer cache where it has them)."""
    cache = open_layer_cache(options.cache_dir) if options.cache else None
    with Checkpoint(source.path, allow_pickle=options.allow_pickle) as checkpoint:
        model, handler, report = walk(config, checkpoint, task, handler, cache=cache)
    if cache is not None:
        log.info("reused %d of %d layers from the layer cache at %s",
                 report.layers_from_cache, report.layers_loaded, cache.cache_dir)
    return model, WalkRecord(layers=report.layers_loaded, from_cache=report.layers_from_cache,
                             tensors=report.tensors_loaded, skipped=report.skipped,
                             absent_optional=report.absent_optional)


def _pad_id(config, tokenizer) -> int:
    if getattr(config, "pad_token_id", None) is not None:
        return int(config.pad_token_id)
    for token in ("[PAD]", "<pad>"):
        if tokenizer.token_to_id(token) is not None:
            return tokenizer.token_to_id(token)
    return 0


def _attempts(configurations: list[Configuration], prepared: Prepared, stop_early: bool,
              first_only: bool) -> tuple[list[Attempt], list[AttemptRecord]]:
    """Each configuration tried in turn: the attempts, and every configuration's record in the order tried.  Where
    several are (``auto``), one whose graphs cannot be made or run (a quantizer or a runtime that fails on this
    graph) is logged with its traceback and recorded as failed with its error, so that the others, ONNX Runtime
    fp32 among them, still answer; one asked for alone fails the export with its error."""
    attempts, tried = [], []
    for configuration in configurations:
        try:
            attempts.append(try_configuration(configuration, prepared, stop_early, first_only))
            tried.append(attempts[-1].record())
        except Exception as exc:
            if len(configurations) == 1:
                raise
            log.exception("%s: its graphs could not be made or validated; left out, the other configurations "
                          "go on", configuration.describe())
            tried.append(AttemptRecord(backend=configuration.target.name, precision=configuration.precision,
                                       reason=configuration.reason, passed=False,
                                       failures=[f"its graphs could not be made or validated: "
                                                 f"{type(exc).__name__}: {exc}"]))
    if not attempts:
        raise ExportError("no configuration's graphs could be made or validated (each one's error is logged above)")
    return attempts, tried


def try_configuration(configuration: Configuration, prepared: Prepared, stop_early: bool = True,
                      first_only: bool = False) -> Attempt:
    """The configuration's candidate graphs, each validated against the reference and closed again:
    a large model's candidates do not fit in memory together (timing reopens those that passed).
    ``stop_early``: a candidate's validation stops once it has missed a bar for good (:func:`validate.compare`).
    ``first_only``: the target's first candidate only (:attr:`ExportedGraph.first_only`)."""
    target, precision = configuration.target, configuration.precision
    work = prepared.graph.work / f"{target.name}-{precision}"
    work.mkdir(exist_ok=True)
    graph = replace(prepared.graph, work=work, auto=configuration.auto, first_only=first_only)
    limits = target.thresholds(prepared.task, precision) or validate_thresholds(prepared.task, precision)
    if configuration.auto:
        limits = with_auto_bar(limits, prepared.task)
    left_out = target.left_out(graph, precision)
    log.info("%s %s: making the candidate graphs%s", target.name, precision, f" ({left_out})" if left_out else "")
    candidates = target.candidates(graph, precision)
    attempt = Attempt(configuration, candidates[:1] if first_only else candidates, left_out)
    free_cycles(graph.plain, graph.large)  # what the graph tools left in reference cycles goes before validation
    for number, candidate in enumerate(attempt.candidates, 1):
        log.info("%s %s, %s graph (%d of %d): validating against PyTorch", target.name, precision, candidate.graph,
                 number, len(attempt.candidates))
        # a pooled graph answers the pooled output first, then the token states where it keeps them
        pooled, tokens = (*graph.pooling.outputs, None)[:2] if graph.pooled else (None, None)
        candidate.report = compare(target.runner(candidate, precision), prepared.reference, precision,
                                   prepared.embedder, prepared.task, target.name, limits, target.trims_padding,
                                   pooled=pooled, tokens=tokens, per_batch=scales_per_batch(candidate.path),
                                   stop_early=stop_early)
        stopped = candidate.report.texts < prepared.reference.texts
        log.info("%s %s, %s graph: %s%s", target.name, precision, candidate.graph, candidate.report.summary(),
                 f" (stopped after {candidate.report.texts} of {prepared.reference.texts} texts)" if stopped else "")
    return attempt


def _time(attempts: list[Attempt], loads: list[Workload],
          objective: str) -> tuple[Candidate | None, Timing | None]:
    """Every candidate that passed, reopened and timed side by side on the workloads, in heats that fit in
    memory (:func:`timing.time_in_heats`); the fastest, and how it was timed (validation.json's ``timing``)."""
    passed = [(a.configuration, c) for a in attempts for c in a.passed]
    if not passed:
        return None, None
    sizes = [footprint(c.files()) for _, c in passed]
    budget = memory_budget()
    if len(passed) == 1:  # nothing to choose between: timing would only cost the export its time
        log.info("one graph passed (%s): kept without timing it", _label(*passed[0]))
        return passed[0][1], Timing(optimize=objective, heats=[], memory_budget_bytes=budget,
                                    estimated_bytes={_label(*passed[0]): sizes[0]},
                                    why="one graph passed: nothing to time it against, so it was not timed")
    log.info("timing %d graphs that passed, side by side: %s", len(passed), ", ".join(l.describe() for l in loads))
    heats = time_in_heats(lambda i: passed[i][0].target.runner(passed[i][1], passed[i][0].precision), sizes, loads,
                          budget, name=lambda i: _label(*passed[i]), objective=objective)
    last_score = {i: score for heat in heats.heats for i, score in heat.items()}  # later heats overwrite
    for index, ((_, candidate), timings) in enumerate(zip(passed, heats.timings)):
        candidate.timings, candidate.latency_ms = timings, sum(timings.values())
        candidate.score = last_score[index]
    return passed[heats.fastest][1], _timing_record(objective, passed, sizes, budget, heats)


def _label(configuration: Configuration, candidate: Candidate) -> str:
    return f"{configuration.describe()} {candidate.graph}"


def _timing_record(objective: str, passed: list[tuple[Configuration, Candidate]], sizes: list[int], budget: int,
                   heats: Heats) -> Timing:
    """How the graphs were timed: in one heat (all open together), or in several because they did not fit."""
    one = len(heats.heats) == 1
    return Timing(
        optimize=objective,
        heats=[Heat(score={_label(*passed[i]): round(score, 4) for i, score in heat.items()},
                    fastest=_label(*passed[min(heat, key=heat.get)]), rounds=rounds,
                    left_behind={_label(*passed[i]): ran for i, ran in left.items()})
               for heat, rounds, left in zip(heats.heats, heats.rounds, heats.left)],
        memory_budget_bytes=budget, estimated_bytes={_label(*p): size for p, size in zip(passed, sizes)},
        why=("every graph open at once, side by side" if one else
             "the graphs did not fit in the memory budget together: timed side by side in heats, the "
             "fastest of each heat carried into the next; each graph's timings in `measured` are from its "
             "last heat, so compare scores within a heat"),
        score="each workload's median over the heat's best on it, combined by a geometric mean weighted "
              "as `optimize` says (timing.OBJECTIVES); 1.0 is the best on every workload that counts; a graph "
              "in `left_behind` stopped being timed once it was far behind (timing.left_behind)")


def _timings(candidate: Candidate) -> str:
    return ", ".join(f"{name} {ms:.1f} ms" for name, ms in candidate.timings.items())


def _choose(attempts: list[Attempt], fastest: Candidate | None, allow_degraded: bool) -> tuple[Attempt, Candidate]:
    """The fastest candidate that passed, as timing found it; else, with ``allow_degraded``, the candidate
    closest to PyTorch."""
    if fastest is not None:
        return next(a for a in attempts if any(c is fastest for c in a.candidates)), fastest
    summary = " | ".join(f"{a.configuration.describe()}: {a.summary()}" for a in attempts)
    if not allow_degraded:
        failures = [f for a in attempts for c in a.candidates for f in c.report.failures]
        raise ValidationError(
            f"exported graph does not match PyTorch ({summary}); nothing was written. "
            "Pass --allow-degraded to write it anyway (the report records it).",
            report=attempts[-1].candidates[0].report.to_dict(), failures=failures,
        )
    log.warning("validation failed but --allow-degraded was given: %s", summary)
    return max(((a, c) for a in attempts for c in a.candidates), key=lambda pair: _closeness(pair[1].report))


def _log_table(attempts: list[Attempt], chosen: Candidate) -> None:
    """Every configuration measured, as the export log's table; validation.json keeps the same rows."""
    if sum(len(a.candidates) for a in attempts) < 2:
        return
    log.info("measured (validated against PyTorch fp32; timed where it passed):")
    width = max(len(c.graph) for a in attempts for c in a.candidates)
    for attempt in attempts:
        for candidate in attempt.candidates:
            mark = "->" if candidate is chosen else "  "
            result = (_timings(candidate) if candidate.timings else
                      "passed (the one graph that did: not timed)" if candidate.report.passed else "failed validation")
            log.info(" %s %-12s %-5s %-*s %s", mark, attempt.configuration.target.name,
                     attempt.configuration.precision, width, candidate.graph, result)


def _kept_because(attempts: list[Attempt], attempt: Attempt, chosen: Candidate) -> str | None:
    """Why ``auto`` kept ``chosen``: the fastest of the graphs that passed every bar (or the only one), and the
    first bar each other graph missed (where only fp32 passed: why no reduced precision was kept).  None where
    one configuration was asked for, or none passed."""
    if not attempt.configuration.auto or not chosen.report.passed:
        return None
    passed = sum(len(a.passed) for a in attempts)
    why = f"the fastest of the {passed} graphs that passed every bar" if passed > 1 else "the only graph that passed"
    missed = [f"{a.configuration.describe()} {c.graph}: {c.report.failures[0]}"
              for a in attempts for c in a.candidates if not c.report.passed]
    return (f"{attempt.configuration.describe()} {chosen.graph}, {why}"
            + (f"; missed a bar: {' | '.join(missed)}" if missed else ""))


def _closeness(report: ValidationReport) -> float:
    """How near PyTorch a failing graph is, higher nearer: its mean cosine where its outputs are vectors, else
    its label agreement, else its largest difference (lower is nearer).  Every candidate of one export has
    the same task, so they are all compared on the same figure."""
    if report.cosine_mean is not None:
        return report.cosine_mean
    if report.agreement is not None:
        return report.agreement
    return -report.max_abs_diff


def _report(options: ExportOptions, prepared: Prepared, attempts: list[Attempt], attempt: Attempt,
            chosen: Candidate, timing: Timing | None, tried: list[AttemptRecord]) -> ExportReport:
    """validation.json: the chosen graph's validation, every configuration tried, and the export's facts
    (:class:`export_report.ExportReport` documents each)."""
    embedder, graph = prepared.embedder, prepared.graph
    return ExportReport(
        validation=chosen.report, model=prepared.source.model_id, model_type=prepared.family.model_type,
        task=prepared.task.name, graph=chosen.graph, requested_backend=options.backend,
        requested_precision=options.precision, device=attempt.configuration.target.device,
        validated_on=attempt.configuration.target.validated_on, attempts=tried,
        allow_degraded=options.allow_degraded,
        candidates=[CandidateRecord(graph=c.graph, passed=c.report.passed, latency_ms=_rounded(c.latency_ms, 3),
                                    score=_rounded(c.score, 4), max_abs_diff=c.report.max_abs_diff,
                                    cosine_min=c.report.cosine_min) for c in attempt.candidates],
        measured=[row for a in attempts for row in a.rows(chosen)],
        workloads=[load.describe() for load in prepared.workloads], timing=timing,
        kept_because=_kept_because(attempts, attempt, chosen), large_model=graph.large,
        inputs=graph.served_inputs, truncate=options.truncate, max_length=graph.max_length,
        **(embedder.record() if embedder else {}),
        pooled_in_graph=graph.pooled,
        outputs=graph.pooling.outputs if graph.pooled else prepared.task.output_names(), walk=prepared.walk)


def check_max_batch_size(rows: int | None) -> None:
    """Refuse a ``max_batch_size`` no repository can serve, before any work."""
    if rows is not None and not (type(rows) is int and 1 <= rows <= MAX_ROWS_ASKED):  # True is an int too
        raise NexusError(f"max_batch_size must be a whole number from 1 to {MAX_ROWS_ASKED}, got {rows!r}")


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _write(root: Path, name: str, prepared: Prepared, attempt: Attempt, chosen: Candidate,
           report: ExportReport, rows: int | None = None) -> list[str]:
    """The models into the staging root, the chosen graph as the encoder's model file; the ensembles' names.
    ``rows``: the repository's ``max_batch_size`` (None: the target's device decides)."""
    task, config, embedder = prepared.task, prepared.config, prepared.embedder
    configuration = attempt.configuration
    serving = configuration.target.serving_graph(
        replace(configuration.target.serving(configuration.precision), rows=rows), chosen.path)
    facts = ServingFacts(prepared.graph.served_inputs, prepared.family.hidden_size(config),
                         int(getattr(config, "num_labels", 0) or 0), prepared.graph.max_length, prepared.graph.pad_id,
                         report.truncate, task.post_params(config, embedder), serving, f"model{chosen.path.suffix}",
                         prepared.graph.pooled, *_retrieval(prepared),
                         vocab_size=prepared.family.vocab_size(config), embedded_size=_embedded_size(prepared),
                         precision=configuration.precision, backend=configuration.target.name,
                         sides=getattr(embedder, "sides", None))
    ensembles = write_models(root, name, task.name, facts, prepared.tokenizer_path)
    encoder_dir = root / f"{name}_encoder"
    chosen.install(encoder_dir / "1")
    export_report.write(report, encoder_dir)
    # for nexus-sli validate on the serving host, with what only the graph holds besides (BGE-M3's heads)
    stored_reference.save(prepared.reference, encoder_dir, getattr(embedder, "stored", dict)())
    return ensembles


#: The tasks whose models may carry sentence-transformers prompts (SparseEncoder and MultiVectorEncoder
#: folders have them too: a MultiVectorEncoder save's markers are its query and document prompts; a
#: CrossEncoder's go in front of each pair's query).
PROMPTED_TASKS = ("embedding", "sparse-embedding", "multi-vector", "rerank")


def _retrieval(prepared: Prepared) -> tuple[Prompts, dict[str, str]]:
    """(prompts, described): a retrieval model's named prompts, for its tokenizer step and its ensemble,
    and the Matryoshka sizes a dense one was trained for, for clients (empty where the model names none)."""
    if prepared.task.name not in PROMPTED_TASKS:
        return Prompts(), {}
    named, default = prompts(prepared.source.path)
    if named:
        log.info("prompts %s (applied by the tokenizer step; default: %s)", ", ".join(named), default or "none")
    if prepared.task.name != "embedding":
        return Prompts(named, default), {}
    dims = matryoshka_dims(prepared.source.path, _embedded_size(prepared))
    return Prompts(named, default), write({MATRYOSHKA_DIMS: dims or None})


def _embedded_size(prepared: Prepared) -> int:
    """The served embedding's size: the hidden size, or what the model's Dense modules project it to (a
    late-interaction or BGE-M3 model: its vectors' size)."""
    hidden = prepared.family.hidden_size(prepared.config)
    if isinstance(prepared.embedder, (MultiVectorEmbedder, M3Embedder)):
        return prepared.embedder.vector_size
    return prepared.embedder.size(hidden) if isinstance(prepared.embedder, Embedder) else hidden
