"""The export pipeline, the only orchestrator of an export.

    model source -> layer walk -> plain ONNX -> PyTorch reference (once)
      -> for each configuration of :func:`targets.plan`, in turn: the target's
         candidate graphs, each validated and timed; stop at the first that passes
      -> the Triton repository (staged, then published)

Every other module does one step and knows nothing of the others.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from nexus_sli.exporter.errors import ValidationError
from nexus_sli.exporter.targets import Candidate, Configuration, ExportedGraph, plan
from nexus_sli.exporter.triton.models import ServingFacts, write_models, write_readme
from nexus_sli.exporter.triton.python_models.encoding import load_tokenizer
from nexus_sli.exporter.triton.staging import Staging
from nexus_sli.tasks import get_task, infer_task

from . import stored_reference
from .checkpoint import Checkpoint
from .handler import get_registry
from .onnx_export import export_onnx, model_input_names
from .optimize import median_latency_ms, timing_feeds
from .report import ValidationReport
from .source import check_name, load_config, max_sequence_length, normalizes, pooling_mode, resolve_model, tokenizer_file
from .validate import Embedder, Reference, build_reference, compare, parity_cases, text_batches
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
    #: reuse layers cached by an earlier export of the same checkpoint (and cache this one's)
    cache: bool = True
    #: None: $NEXUS_SLI_CACHE_DIR, else ~/.cache/nexus-sli/layers (the LayerCache default)
    cache_dir: Path | None = None


@dataclass
class ExportResult:
    name: str
    models: list[Path]
    #: what was written to the encoder's validation.json
    report: dict


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
    embedder: Embedder | None
    walk: dict


@dataclass
class Attempt:
    """One configuration's candidates after validation and timing."""

    configuration: Configuration
    candidates: list[Candidate]

    @property
    def best(self) -> Candidate | None:
        """The fastest candidate that passed, if any."""
        passed = [c for c in self.candidates if c.report.passed]
        return min(passed, key=lambda c: c.latency_ms) if passed else None

    def summary(self) -> str:
        return "; ".join(f"{c.graph}: {c.report.summary()}" for c in self.candidates)

    def record(self) -> dict:
        return {"backend": self.configuration.target.name, "precision": self.configuration.precision,
                "reason": self.configuration.reason, "passed": self.best is not None,
                "failures": [] if self.best else [self.summary()]}


def run_export(options: ExportOptions) -> ExportResult:
    """Export, validate and publish one model; see the module docstring for the steps."""
    configurations = plan(options.backend, options.precision, device=options.device)
    if options.task != "auto":
        get_task(options.task)  # an unknown task fails before any download
    source = resolve_model(options.model, options.allow_pickle)
    name = check_name(options.name or source.default_name)
    with Staging(Path(options.out)) as stage:
        prepared = _prepare(options, source, stage.work)
        log.info("exporting %s (%s, %d layers) as %s, task %s; trying %s", source.model_id,
                 prepared.family.model_type, prepared.family.num_layers(prepared.config), name,
                 prepared.task.name, ", then ".join(c.describe() for c in configurations))
        attempts = _try_in_turn(configurations, prepared)
        attempt, chosen = _choose(attempts, options.allow_degraded)
        report = _report(options, prepared, attempts, attempt, chosen)
        _write(stage.root, name, prepared, attempt, chosen, report)
        models = stage.publish()
        write_readme(Path(options.out))
    log.info("wrote %s", ", ".join(str(m) for m in models))
    return ExportResult(name, models, report)


def _prepare(options: ExportOptions, source, work: Path) -> Prepared:
    """Walk the checkpoint into a PyTorch model, export the plain graph and compute the reference."""
    config = load_config(source.path)
    task = infer_task(config) if options.task == "auto" else get_task(options.task)
    handler = get_registry().detect_family(config)
    model, walked = _walk(options, source, config, task, handler)
    family = handler.family
    max_length = max_sequence_length(source.path, family, config)
    tokenizer_path = tokenizer_file(source.path, work)
    tokenizer = load_tokenizer(tokenizer_path, max_length)
    pad_id = _pad_id(config, tokenizer)
    input_names = export_onnx(model, task, model_input_names(model, config), family.vocab_size(config),
                              work / "plain.onnx")
    reference = build_reference(
        model, task, input_names,
        parity_cases(input_names, family.vocab_size(config), pad_id, family.max_positions(config)),
        text_batches(tokenizer, input_names, pad_id, max_length, pairs=task.pair),
    )
    embedder = Embedder(pooling_mode(source.path), normalizes(source.path)) if task.name == "embedding" else None
    graph = ExportedGraph(work / "plain.onnx", work, family, config, task, input_names, tokenizer, pad_id,
                          max_length)
    return Prepared(source, config, task, family, tokenizer_path, graph, reference, embedder, walked)


def _walk(options: ExportOptions, source, config, task, handler):
    """The task model rebuilt layer by layer (from the layer cache where it has them)."""
    cache = open_layer_cache(options.cache_dir) if options.cache else None
    with Checkpoint(source.path, allow_pickle=options.allow_pickle) as checkpoint:
        model, handler, report = walk(config, checkpoint, task, handler, cache=cache)
    if cache is not None:
        log.info("reused %d of %d layers from the layer cache at %s",
                 report.layers_from_cache, report.layers_loaded, cache.cache_dir)
    return model, {"layers": report.layers_loaded, "from_cache": report.layers_from_cache,
                   "tensors": report.tensors_loaded, "skipped": report.skipped,
                   "absent_optional": report.absent_optional}


def _pad_id(config, tokenizer) -> int:
    if getattr(config, "pad_token_id", None) is not None:
        return int(config.pad_token_id)
    for token in ("[PAD]", "<pad>"):
        if tokenizer.token_to_id(token) is not None:
            return tokenizer.token_to_id(token)
    return 0


def _try_in_turn(configurations: list[Configuration], prepared: Prepared) -> list[Attempt]:
    """Each configuration in turn until one has a candidate that passes validation."""
    attempts: list[Attempt] = []
    for configuration in configurations:
        attempts.append(_attempt(configuration, prepared))
        if attempts[-1].best is not None:
            break
        if len(attempts) < len(configurations):
            log.warning("%s failed validation (%s); trying the next configuration",
                        configuration.describe(), attempts[-1].summary())
    return attempts


def _attempt(configuration: Configuration, prepared: Prepared) -> Attempt:
    """The configuration's candidate graphs, each validated against the reference and timed."""
    target, precision = configuration.target, configuration.precision
    work = prepared.graph.work / f"{target.name}-{precision}"
    work.mkdir(exist_ok=True)
    graph = replace(prepared.graph, work=work)
    limits = target.thresholds(prepared.task, precision)
    feeds = timing_feeds(graph.input_names, prepared.family.vocab_size(prepared.config),
                         min(128, prepared.graph.max_length))
    candidates = target.candidates(graph, precision)
    for candidate in candidates:
        runner = target.runner(candidate, precision)
        candidate.report = compare(runner, prepared.reference, precision, prepared.embedder, prepared.task,
                                   target.name, limits, target.trims_padding)
        candidate.latency_ms = median_latency_ms(runner, feeds)
        log.info("%s %s, %s graph: %s, %.1f ms per batch of %d x %d", target.name, precision, candidate.graph,
                 candidate.report.summary(), candidate.latency_ms, *next(iter(feeds.values())).shape)
    return Attempt(configuration, candidates)


def _choose(attempts: list[Attempt], allow_degraded: bool) -> tuple[Attempt, Candidate]:
    """The first attempt with a passing candidate, and its fastest; else, with
    ``allow_degraded``, the last attempt's candidate closest to PyTorch."""
    for attempt in attempts:
        if attempt.best is not None:
            return attempt, attempt.best
    summary = " | ".join(f"{a.configuration.describe()}: {a.summary()}" for a in attempts)
    last = attempts[-1]
    if not allow_degraded:
        failures = [f for c in last.candidates for f in c.report.failures]
        raise ValidationError(
            f"exported graph does not match PyTorch ({summary}); nothing was written. "
            "Pass --allow-degraded to write it anyway (the report records it).",
            report=last.candidates[0].report.to_dict(), failures=failures,
        )
    log.warning("validation failed but --allow-degraded was given: %s", summary)
    return last, max(last.candidates, key=lambda c: _closeness(c.report))


def _closeness(report: ValidationReport) -> float:
    return report.cosine_mean or report.agreement or -report.max_abs_diff


def _report(options: ExportOptions, prepared: Prepared, attempts: list[Attempt], attempt: Attempt,
            chosen: Candidate) -> dict:
    """validation.json: the chosen graph's validation, every configuration tried, and the export's facts."""
    embedder = prepared.embedder
    return {
        **chosen.report.to_dict(),
        "model": prepared.source.model_id,
        "model_type": prepared.family.model_type,
        "task": prepared.task.name,
        "graph": chosen.graph,
        "requested_backend": options.backend,
        "requested_precision": options.precision,
        "device": attempt.configuration.target.device,
        "validated_on": attempt.configuration.target.validated_on,
        "attempts": [a.record() for a in attempts],
        "allow_degraded": options.allow_degraded,
        "candidates": [{"graph": c.graph, "passed": c.report.passed, "latency_ms": round(c.latency_ms, 3),
                        "max_abs_diff": c.report.max_abs_diff, "cosine_min": c.report.cosine_min}
                       for c in attempt.candidates],
        "inputs": prepared.graph.input_names,
        "truncate": options.truncate,
        "max_length": prepared.graph.max_length,
        "pooling": embedder.pooling if embedder else None,
        "normalize": embedder.normalize if embedder else None,
        "walk": prepared.walk,
    }


def _write(root: Path, name: str, prepared: Prepared, attempt: Attempt, chosen: Candidate, report: dict) -> None:
    """The four models into the staging root, the chosen graph as the encoder's model file."""
    task, config, embedder = prepared.task, prepared.config, prepared.embedder
    configuration = attempt.configuration
    facts = ServingFacts(prepared.graph.input_names, prepared.family.hidden_size(config),
                         int(getattr(config, "num_labels", 0) or 0), prepared.graph.max_length, prepared.graph.pad_id,
                         report["truncate"], task.post_params(config, embedder),
                         configuration.target.serving(configuration.precision), f"model{chosen.path.suffix}")
    write_models(root, name, task.name, facts, prepared.tokenizer_path)
    encoder_dir = root / f"{name}_encoder"
    for file in chosen.files():
        shutil.copyfile(file, encoder_dir / "1" / f"model{file.suffix}")
    (encoder_dir / "validation.json").write_text(json.dumps(report, indent=2) + "\n")
    stored_reference.save(prepared.reference, encoder_dir)  # for nexus-sli validate on the serving host
