"""What the bench exports, and what ``auto`` chose.

The bench serves the model in several configurations (:func:`variants`), each exported once
into the bench repository and reused while it holds that model (:func:`ensure_exported`).
The configuration the targets judge is the one ``auto`` exports on this machine: the bench
makes an auto export and reads what it kept (:func:`default_configuration`); it never infers
the choice from CPU flags.  What an export kept comes from the exporter's typed record
(:class:`ExportReport`): the result of an export the bench just made, or, for one it
reuses, the record in its folder (read in one place, :func:`export_choice`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from nexus_sli.exporter.export import export_report
from nexus_sli.exporter.export.export_report import ExportReport
from nexus_sli.exporter.export.source import ModelSource, check_name, resolve_model
from nexus_sli.exporter.export.static_int8 import STATIC_INT8_GRAPH
from nexus_sli.exporter.export.timing import DEFAULT_OBJECTIVE

from . import machine
from .options import BenchOptions
from .run_size import RunSize, run_size_for

log = logging.getLogger("nexus_sli.bench")

#: the label suffix of ONNX Runtime's static int8 graph (:func:`variant_label`), which only an export
#: held to the auto bar makes
STATIC_SUFFIX = "-static"
#: the name suffix of the auto export a run of fp32 and the default only serves as the default (:func:`auto_export`)
AUTO_SUFFIX = "_auto"
#: Configurations whose export failed validation, with the reason (kept beside the exports).
SKIPPED_FILE = ".skipped.json"


def variants(default: dict | None = None, every: bool = True) -> dict[str, tuple[str, str, str]]:
    """Each served configuration the bench measures: label -> (backend, precision, name suffix).
    OpenVINO bf16 only where the CPU has bf16 (elsewhere the exporter would make fp32).
    ``default`` (:func:`default_configuration`): what ``auto`` exports here, added when it is
    none of these, so that the targets are always judged on a served default.  ``every`` False
    (:attr:`RunSize.every_variant`): fp32 and the default only, the two configurations the targets read."""
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
        return f"{precision}{STATIC_SUFFIX}" if graph == STATIC_INT8_GRAPH else precision
    return f"{'openvino' if backend == 'openvino' else backend}-{precision}"


def _suffix(label: str) -> str:
    """The repository-name suffix of a label outside the fixed variants (``openvino-fp32`` -> ``_ov_fp32``)."""
    backend, _, precision = label.rpartition("-")
    short = {"openvino": "ov", "": ""}.get(backend, backend.replace("-", "_"))
    return "_".join(["", *filter(None, (short, precision))])


def requested_precision(label: str, precision: str) -> str:
    """The precision the bench asks the exporter for to make ``label``: ``auto`` for ONNX Runtime's
    static int8, which only an export held to the auto bar makes (and whose timing may keep another
    graph: :func:`_exported`), else the variant's own."""
    return "auto" if label.endswith(STATIC_SUFFIX) else precision


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


def auto_export(options: BenchOptions, run_size: RunSize) -> tuple[Path, str]:
    """Where the bench's ``auto`` export goes, and its name.  A run that serves every configuration
    exports the default's again among them, so the auto export only says which it is, from
    :func:`auto_folder`.  A run that serves fp32 and the default only (:attr:`RunSize.every_variant`)
    exports it into the served repository as ``<name>_auto`` and serves it as the default: one export
    fewer, and of a base-size model each export takes minutes (OpenVINO int8's candidate graphs most)."""
    name = check_name(resolve_model(options.model).default_name)
    if run_size.every_variant:
        return auto_folder(options.repository), name
    return Path(options.repository), f"{name}{AUTO_SUFFIX}"


def encoder_folder(folder: Path, name: str) -> Path:
    """The encoder model folder of the export ``name`` in ``folder`` (where its record lies)."""
    return Path(folder) / f"{name}_encoder"


@dataclass(frozen=True)
class ExportChoice:
    """What the bench takes from one export's record."""

    #: the model it exported (an export of another model is made again)
    model: str | None
    #: the graph it serves
    graph: str | None
    #: the row it kept, as the bench's label (:func:`variant_label`), with the measured table it chose
    #: from; None when the report names no kept row
    configuration: dict | None


def export_choice(encoder: Path) -> ExportChoice | None:
    """What the export whose encoder folder is ``encoder`` exported and kept (None: no record there).
    The one place the bench reads an export it did not just make."""
    if not export_report.path(encoder).is_file():
        return None
    return choice_of(export_report.read(encoder), export_report.path(encoder))


def choice_of(report: ExportReport, source: Path) -> ExportChoice:
    """The bench's view of an export's record (``source``: where the record is kept)."""
    chosen = report.chosen
    configuration = None if chosen is None else {
        "label": variant_label(chosen.backend, chosen.precision, chosen.graph),
        "backend": chosen.backend, "precision": chosen.precision, "graph": chosen.graph,
        "source": str(source), "optimize": report.optimize or DEFAULT_OBJECTIVE,
        "measured": [{k: row.to_dict().get(k) for k in ("backend", "precision", "graph", "passed", "cosine_min",
                                                        "cosine_mean", "timings_ms", "score", "chosen")}
                     for row in report.measured]}
    return ExportChoice(report.model, report.graph, configuration)


def _holds(encoder: Path, model_id: str) -> bool:
    """Whether the export in ``encoder`` is one of ``model_id`` (one to reuse unless ``reexport`` asks)."""
    choice = export_choice(encoder)
    return choice is not None and choice.model == model_id


def served_graph(repository: Path, name: str) -> str | None:
    """The graph the export ``name`` in ``repository`` serves (its timing picked it among candidates)."""
    choice = export_choice(encoder_folder(repository, name))
    return None if choice is None else choice.graph


def default_configuration(options: BenchOptions, run_size: RunSize | None = None, export: bool = True) -> dict | None:
    """The configuration ``auto`` (what ``make export`` runs) exports on this machine, read from
    an auto export's record: its ``measured`` table and the row it kept.  The export is
    made where :func:`auto_export` says unless one of this model is there (``reexport``: always);
    the choice is measured by the exporter, never inferred from CPU flags here.  None when the
    auto export fails (the targets then say the default is unknown).  ``run_size``: None, the run
    size of the model's size."""
    source = resolve_model(options.model)
    folder, name = auto_export(options, run_size or run_size_for(options)[0])
    encoder = encoder_folder(folder, name)
    if export and (options.reexport or not _holds(encoder, source.model_id)):
        choice = _export_auto(options, source.model_id, folder, name)
    else:
        choice = export_choice(encoder)
    return None if choice is None else choice.configuration


def _export_auto(options: BenchOptions, model_id: str, folder: Path, name: str) -> ExportChoice | None:
    """The auto export, made as ``name`` into ``folder``, and what it kept; None when it failed."""
    from nexus_sli.exporter.errors import NexusError
    from nexus_sli.exporter.export.pipeline import ExportOptions, run_export

    log.info("exporting %s with backend and precision auto into %s: the configuration the targets judge",
             model_id, folder)
    try:
        result = run_export(ExportOptions(model=options.model, precision="auto", backend="auto", name=name,
                                          out=folder))
    except NexusError as exc:
        log.warning("the auto export failed, so the default configuration is unknown: %s", exc)
        return None
    return choice_of(result.report, export_report.path(encoder_folder(folder, name)))


def ensure_exported(options: BenchOptions, run_size: RunSize | None = None) -> dict[str, str]:
    """Export the model in every configuration the run serves (None: the run size of its size) into
    the bench repository unless it already holds exports of this model (or ``reexport`` asks for
    fresh ones).  A configuration whose export fails validation is left out, and the reason recorded."""
    run_size = run_size or run_size_for(options)[0]
    default = default_configuration(options, run_size)
    source, names = model_names(options.model, default, run_size.every_variant)
    repository = Path(options.repository)
    skipped = {} if options.reexport else _read_skipped(repository)
    for label, name in names.items():
        if not run_size.every_variant and default is not None and label == default["label"]:
            continue  # the auto export, made above into the repository (auto_export)
        if label in skipped or (not options.reexport and _holds(encoder_folder(repository, name), source.model_id)):
            continue
        backend, precision, _ = variants(default)[label]
        reason = _exported(options, source.model_id, label, name, backend, precision)
        if reason is not None:
            skipped[label] = reason
    repository.mkdir(parents=True, exist_ok=True)
    (repository / SKIPPED_FILE).write_text(json.dumps(skipped, indent=2) + "\n")
    return {label: name for label, name in names.items() if label not in skipped}


def _exported(options: BenchOptions, model_id: str, label: str, name: str, backend: str, precision: str
              ) -> str | None:
    """Export ``label`` as ``name`` into the bench repository; why it is left out of the bench, or None."""
    from nexus_sli.exporter.errors import ValidationError
    from nexus_sli.exporter.export.pipeline import ExportOptions, run_export

    precision = requested_precision(label, precision)
    log.info("exporting %s (%s) into %s as %s", model_id, label, options.repository, name)
    try:
        result = run_export(ExportOptions(model=options.model, precision=precision, backend=backend, name=name,
                                          out=Path(options.repository)))
    except ValidationError as exc:
        log.warning("%s is left out of the bench: %s", label, exc)
        return str(exc)
    if precision != "auto":
        return None
    # auto's choice is a timing: this export of it may have kept another graph
    chosen = result.report.chosen
    kept = variant_label(chosen.backend, chosen.precision, chosen.graph)
    if kept == label:
        return None
    log.warning("%s is left out of the bench: its export kept %s instead", label, kept)
    return f"the bench's ONNX Runtime auto export kept {kept}, not {label}"


def _read_skipped(repository: Path) -> dict[str, str]:
    path = Path(repository) / SKIPPED_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def export_skips(repository: Path) -> list[dict]:
    """The configurations whose export failed validation, as the results' skip entries."""
    return [{"path": f"triton / in-process {label}", "mode": "all", "reason": f"export failed validation: {reason}"}
            for label, reason in _read_skipped(repository).items()]
