"""The export pipeline: checkpoint -> walk -> ONNX -> quantize -> validate -> repository."""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

from .checkpoint import Checkpoint
from nexus_sli.exporter.errors import NexusError, ValidationError
from .families import EncoderFamily
from .handler import get_registry
from .source import (
    check_name,
    load_config,
    max_sequence_length,
    normalizes,
    pooling_mode,
    resolve_model,
    tokenizer_file,
)
from .onnx_export import export_onnx
from nexus_sli.exporter.targets import openvino as openvino_target
from nexus_sli.exporter.targets.cpu import default_config, supports_bf16
from .optimize import fuse, median_latency_ms, session, timing_feeds
from .padding_trim import add_padding_trim
from nexus_sli.exporter.triton.python_models.encoding import load_tokenizer
from .quantize import ffn_output_matmuls, quantize_int8
from nexus_sli.exporter.triton.staging import Staging
from nexus_sli.tasks.spec import get_task, infer_task
from nexus_sli.exporter.triton.models import ServingFacts, write_models, write_readme
from .validate import THRESHOLDS, Embedder, build_reference, compare, parity_cases, text_batches
from .walk import open_layer_cache, walk

log = logging.getLogger("nexus_sli.export")

#: The encoder backends and the precisions each serves.
BACKEND_PRECISIONS = {"onnxruntime": ("fp32", "int8"), "openvino": ("fp32", "bf16", "int8")}
PRECISIONS = tuple(THRESHOLDS)
#: backend or precision: this CPU's default (:func:`cpu.default_config`); what the CLI and `make export` ask for.
AUTO = "auto"


@dataclass
class ExportOptions:
    model: str | None = None
    task: str = "auto"
    #: fp32, bf16 (openvino), int8, or auto; the API's default is fixed, the CLI's is auto
    precision: str = "fp32"
    #: the Triton backend serving the encoder: onnxruntime (platform onnxruntime_onnx), openvino, or auto
    backend: str = "onnxruntime"
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
class Candidate:
    graph: str
    path: Path
    report: dict = field(default_factory=dict)
    latency_ms: float | None = None

    def files(self) -> list[Path]:
        """The model file and, for an OpenVINO IR, its weights."""
        return [self.path, self.path.with_suffix(".bin")] if self.path.suffix == ".xml" else [self.path]


@dataclass
class ExportResult:
    name: str
    models: list[Path]
    report: dict


def _pad_id(config, tokenizer) -> int:
    if getattr(config, "pad_token_id", None) is not None:
        return int(config.pad_token_id)
    for token in ("[PAD]", "<pad>"):
        if tokenizer.token_to_id(token) is not None:
            return tokenizer.token_to_id(token)
    return 0


def _onnxruntime_candidates(plain: Path, work: Path, family: EncoderFamily, config, precision: str) -> list[Candidate]:
    """The plain graph and, where the ORT optimizer fuses anything, the fused one;
    quantized when int8 was asked for."""
    candidates = [Candidate("plain", plain)]
    fused_counts = fuse(plain, work / "fused.onnx", family.num_heads(config), family.hidden_size(config))
    if fused_counts:
        log.info("transformer optimizer fused %s", ", ".join(f"{n} {op}" for op, n in fused_counts.items()))
        candidates.append(Candidate("fused", work / "fused.onnx"))
    if precision == "int8":
        quantized = []
        width = family.ffn_width(config)
        for candidate in candidates:
            quantized.append(Candidate(candidate.graph, quantize_int8(candidate.path, work / f"{candidate.graph}.int8.onnx")))
            keep = ffn_output_matmuls(candidate.path, int(width), family.hidden_size(config)) if width else []
            if keep:
                path = quantize_int8(candidate.path, work / f"{candidate.graph}.int8-ffn-fp32.onnx", exclude=keep)
                quantized.append(Candidate(f"{candidate.graph}+ffn-out-fp32", path))
        candidates = quantized
    return candidates


def _openvino_candidates(plain: Path, work: Path, family: EncoderFamily, config, precision: str,
                         calibration) -> list[Candidate]:
    """The plain graph (fp32, bf16: a precision hint), or its NNCF int8 IRs."""
    if precision != "int8":
        return [Candidate("plain", plain)]
    log.info("quantizing with NNCF on %d calibration texts", sum(len(f["input_ids"]) for f in calibration))
    candidates = [Candidate("plain", openvino_target.quantize_int8(plain, work / "plain.ov-int8.xml", calibration))]
    width = family.ffn_width(config)
    keep = ffn_output_matmuls(plain, int(width), family.hidden_size(config)) if width else []
    if keep:
        path = openvino_target.quantize_int8(plain, work / "plain.ov-int8-ffn-fp32.xml", calibration, keep)
        candidates.append(Candidate("plain+ffn-out-fp32", path))
    return candidates


def _trimmed(candidates: list[Candidate], work: Path, task) -> list[Candidate]:
    """Each ONNX candidate with the padding trim in front (see :mod:`padding_trim`)."""
    per_token = task.output_names() if task.per_token else []
    return [Candidate(c.graph, add_padding_trim(c.path, work / f"{c.path.stem}.trim.onnx", per_token))
            for c in candidates]


def _choose(candidates: list[Candidate], allow_degraded: bool) -> Candidate:
    passed = [c for c in candidates if c.report["passed"]]
    if passed:
        return min(passed, key=lambda c: c.latency_ms)
    summary = "; ".join(f"{c.graph}: {', '.join(c.report['failures'])}" for c in candidates)
    if not allow_degraded:
        raise ValidationError(
            f"exported graph does not match PyTorch ({summary}); nothing was written. "
            "Pass --allow-degraded to write it anyway (the report records it).",
            report=candidates[0].report,
        )
    log.warning("validation failed but --allow-degraded was given: %s", summary)
    return max(candidates, key=lambda c: c.report["cosine_mean"] or c.report["agreement"] or -c.report["max_abs_diff"])


def _post_params(task, config, embedder) -> dict[str, str]:
    """What the postprocess model (and a client reading the ensemble config) needs."""
    if task.name == "embedding":
        return {"pooling": embedder.pooling, "normalize": str(embedder.normalize).lower()}
    params = {"id2label": json.dumps({str(k): v for k, v in (getattr(config, "id2label", None) or {}).items()})}
    if task.name == "classification":
        params["multi_label"] = str(getattr(config, "problem_type", None) == "multi_label_classification").lower()
    return params


def _resolve_auto(options: ExportOptions) -> ExportOptions:
    """``auto`` backend or precision -> this CPU's default (:func:`cpu.default_config`).

    Both auto: the default configuration.  One named: the other follows it
    (bf16 needs OpenVINO; OpenVINO without a precision takes bf16 where the CPU
    has it; everything else keeps ONNX Runtime fp32)."""
    backend, precision = options.backend, options.precision
    if backend != AUTO and precision != AUTO:
        return options
    default = default_config()
    if backend == AUTO and precision == AUTO:
        backend, precision = default.backend, default.precision
        log.info("backend %s, precision %s: %s", backend, precision, default.reason)
    elif backend == AUTO:
        backend = "openvino" if precision == "bf16" else "onnxruntime"
    else:
        precision = "bf16" if backend == "openvino" and supports_bf16() else "fp32"
    return replace(options, backend=backend, precision=precision)


def _resolve_precision(options: ExportOptions) -> str:
    """The precision the export makes: as asked, except bf16 without CPU support (fp32, with a warning)."""
    if options.backend not in BACKEND_PRECISIONS:
        raise NexusError(f"unknown backend {options.backend!r}; choose one of {', '.join(BACKEND_PRECISIONS)}")
    if options.precision not in PRECISIONS:
        raise NexusError(f"unknown precision {options.precision!r}; choose one of {', '.join(PRECISIONS)}")
    allowed = BACKEND_PRECISIONS[options.backend]
    if options.precision not in allowed:
        raise NexusError(f"the {options.backend} backend serves precision {', '.join(allowed)}, "
                         f"not {options.precision!r}")
    if options.precision == "bf16" and not supports_bf16():
        log.warning("this CPU has no bf16 instructions (avx512_bf16 or amx_bf16): exporting fp32 instead of bf16")
        return "fp32"
    return options.precision


def _encoder_params(backend: str, precision: str) -> dict[str, str]:
    """Parameters of the encoder's Triton config (Triton's OpenVINO backend reads these names)."""
    if backend != "openvino":
        return {}
    return {"HINT_BF16": "YES" if precision == "bf16" else "NO", "PERFORMANCE_HINT": "LATENCY"}


def _session(candidate: Candidate, backend: str, params: dict[str, str]):
    if backend == "openvino":
        return openvino_target.OpenVINOSession(candidate.path, params)
    return session(candidate.path)


#: Where the CPU's default fails validation for a model, ``auto`` falls back to this:
#: the configuration every model exports at exact parity.
FALLBACK = ("onnxruntime", "fp32")


def run_export(options: ExportOptions) -> ExportResult:
    """Export, validate and publish one model; ``auto`` backend/precision resolved first.

    With both ``auto``, the CPU's default was chosen on one model's measurements: a
    model it fails validation for is exported as :data:`FALLBACK` instead, and the
    report says why (``auto_fallback``)."""
    requested = {"requested_backend": options.backend, "requested_precision": options.precision}
    resolved = _resolve_auto(options)
    try:
        return _export(resolved, requested)
    except ValidationError as exc:
        fully_auto = options.backend == AUTO and options.precision == AUTO
        if not fully_auto or (resolved.backend, resolved.precision) == FALLBACK:
            raise
        reason = f"{resolved.backend} {resolved.precision} failed validation: {exc}"
        log.warning("%s; exporting %s %s instead", reason, *FALLBACK)
        fallback = replace(resolved, backend=FALLBACK[0], precision=FALLBACK[1])
        return _export(fallback, {**requested, "auto_fallback": reason})


def _export(options: ExportOptions, requested: dict) -> ExportResult:
    precision = _resolve_precision(options)
    if options.task != "auto":
        get_task(options.task)  # an unknown task fails before any download
    source = resolve_model(options.model, options.allow_pickle)
    name = check_name(options.name or source.default_name)
    config = load_config(source.path)
    task = infer_task(config) if options.task == "auto" else get_task(options.task)
    handler = get_registry().detect_family(config)
    family = handler.family
    log.info("exporting %s (%s, %s) as %s, task %s, %s on %s", source.model_id, family.model_type,
             f"{family.num_layers(config)} layers", name, task.name, precision, options.backend)

    with Staging(Path(options.out)) as stage:
        cache = open_layer_cache(options.cache_dir) if options.cache else None
        with Checkpoint(source.path, allow_pickle=options.allow_pickle) as checkpoint:
            model, handler, walk_report = walk(config, checkpoint, task, handler, cache=cache)
        if cache is not None:
            log.info("reused %d of %d layers from the layer cache at %s",
                     walk_report.layers_from_cache, walk_report.layers_loaded, cache.cache_dir)
        max_length = max_sequence_length(source.path, family, config)
        tokenizer_path = tokenizer_file(source.path, stage.work)
        tokenizer = load_tokenizer(tokenizer_path, max_length)
        pad_id = _pad_id(config, tokenizer)

        plain = stage.work / "plain.onnx"
        input_names = export_onnx(model, task, _inputs(model, config), family.vocab_size(config), plain)
        reference = build_reference(
            model, task, input_names,
            parity_cases(input_names, family.vocab_size(config), pad_id, family.max_positions(config)),
            text_batches(tokenizer, input_names, pad_id, max_length, pairs=task.pair),
        )
        embedder = Embedder(pooling_mode(source.path), normalizes(source.path)) if task.name == "embedding" else None
        feeds = timing_feeds(input_names, family.vocab_size(config), min(128, max_length))
        if options.backend == "openvino":
            calibration = (openvino_target.calibration_feeds(tokenizer, input_names, pad_id, max_length, task.pair)
                           if precision == "int8" else None)
            trimmed = _trimmed([Candidate("plain", plain)], stage.work, task)[0].path
            candidates = _openvino_candidates(trimmed, stage.work, family, config, precision, calibration)
        else:
            candidates = _trimmed(_onnxruntime_candidates(plain, stage.work, family, config, precision),
                                  stage.work, task)
        params = _encoder_params(options.backend, precision)
        for candidate in candidates:
            runner = _session(candidate, options.backend, params)
            candidate.report = compare(runner, reference, precision, embedder, task, options.backend)
            candidate.latency_ms = median_latency_ms(runner, feeds)
            log.info("%s graph: %s, %.1f ms per batch of %d x %d", candidate.graph,
                     "passed" if candidate.report["passed"] else "FAILED " + "; ".join(candidate.report["failures"]),
                     candidate.latency_ms, *next(iter(feeds.values())).shape)
        chosen = _choose(candidates, options.allow_degraded)

        report = dict(chosen.report)
        report.update(
            model=source.model_id,
            model_type=family.model_type,
            task=task.name,
            graph=chosen.graph,
            **requested,
            allow_degraded=options.allow_degraded,
            candidates=[{"graph": c.graph, "passed": c.report["passed"], "latency_ms": round(c.latency_ms, 3),
                         "max_abs_diff": c.report["max_abs_diff"], "cosine_min": c.report["cosine_min"]}
                        for c in candidates],
            inputs=input_names,
            truncate=options.truncate,
            max_length=max_length,
            pooling=embedder.pooling if embedder else None,
            normalize=embedder.normalize if embedder else None,
            walk={"layers": walk_report.layers_loaded, "from_cache": walk_report.layers_from_cache,
                  "tensors": walk_report.tensors_loaded,
                  "skipped": walk_report.skipped, "absent_optional": walk_report.absent_optional},
        )
        facts = ServingFacts(input_names, family.hidden_size(config), int(getattr(config, "num_labels", 0) or 0),
                             max_length, pad_id, options.truncate, _post_params(task, config, embedder),
                             options.backend, f"model{chosen.path.suffix}", params)
        write_models(stage.root, name, task.name, facts, tokenizer_path)
        encoder_dir = stage.root / f"{name}_encoder"
        for file in chosen.files():
            shutil.copyfile(file, encoder_dir / "1" / f"model{file.suffix}")
        (encoder_dir / "validation.json").write_text(json.dumps(report, indent=2) + "\n")
        models = stage.publish()
        write_readme(Path(options.out))
    log.info("wrote %s", ", ".join(str(m) for m in models))
    return ExportResult(name, models, report)


def _inputs(model, config) -> list[str]:
    from .onnx_export import model_input_names

    return model_input_names(model, config)
