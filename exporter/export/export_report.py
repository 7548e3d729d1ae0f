"""``validation.json``, the encoder's export report: the one module that reads and writes it.

The pipeline writes it into ``<name>_encoder/``; ``nexus-sli build-plan`` adds the TensorRT plans it
builds; ``nexus-sli validate``, the bench and the tests read it back.  Each field is documented once,
on the dataclass below that holds it, and its JSON key is the field's name.  The chosen graph's
validation (:class:`report.ValidationReport`) sits at the top level of the file, beside the export's
own fields, as a plan's validation sits beside the plan's.

Versions: :data:`VERSION` is the layout this module writes.  A file without ``version`` is layout 1,
which differs from layout 2 only by lacking that key; the keys older exports lack read as the defaults
below, each field saying which.  Keys this module does not know (a newer nexus-sli's) are kept in the
record's ``extra`` and written back as they were, so that rewriting a newer file (build-plan does) does
not damage it; a record's ``version`` is the one it was read with.
"""

from __future__ import annotations

import json
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from nexus_sli.exporter.errors import ExportReportError
from nexus_sli.exporter.triton import staging

from .report import ValidationReport

#: The file, in the encoder's model folder.
FILE = "validation.json"
#: The layout :func:`write` writes.
VERSION = 2
#: A file without ``version`` is this layout.
UNVERSIONED = 1

#: Field metadata: the record's keys sit beside this record's own, not under the field's name.
FLAT = {"flat": True}
#: Field metadata: written only where it differs from its default (an optional part of the layout).
OPTIONAL = {"optional": True}
#: Field metadata: None is written, and read, as an empty object.
NONE_AS_EMPTY = {"none_as_empty": True}


@dataclass(kw_only=True)
class Record:
    """A JSON object read and written by field name (nested records, lists and maps of them included)."""

    #: keys this version of nexus-sli does not know, written back unchanged
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, data: Any, where: str = ""):
        """The record ``data`` holds; :class:`ExportReportError` naming ``where`` if it is not one."""
        where = where or cls.__name__
        if not isinstance(data, dict):
            raise ExportReportError(f"{where}: expected an object, found {type(data).__name__}")
        hints, values, known = typing.get_type_hints(cls), {}, set()
        for spec in _fields(cls):
            if spec.metadata.get("flat"):
                values[spec.name] = _flat(hints[spec.name], data, where)
                known |= {item.name for item in fields(hints[spec.name])} | set(hints[spec.name].DERIVED)
                continue
            if spec.name in data:
                values[spec.name] = _load(hints[spec.name], data[spec.name], f"{where}.{spec.name}", spec)
            elif _default(spec) is MISSING:
                raise ExportReportError(f"{where}: no {spec.name!r}")
            known.add(spec.name)
        return cls(**values, extra={key: value for key, value in data.items() if key not in known})

    def to_dict(self) -> dict[str, Any]:
        """The JSON object, in field order, then the keys kept in ``extra``."""
        out: dict[str, Any] = {}
        for spec in _fields(type(self)):
            value = getattr(self, spec.name)
            if spec.metadata.get("flat"):
                out.update(value.to_dict())
            elif not (spec.metadata.get("optional") and value == _default(spec)):
                out[spec.name] = {} if value is None and spec.metadata.get("none_as_empty") else _dump(value)
        return {**out, **self.extra}


def _fields(cls) -> list:
    return [spec for spec in fields(cls) if spec.name != "extra"]


def _default(spec) -> Any:
    """The field's default (MISSING: it has none)."""
    return spec.default_factory() if spec.default_factory is not MISSING else spec.default


def _flat(kind, data: dict, where: str):
    """A record whose keys sit in ``data`` itself (a :class:`ValidationReport`)."""
    missing = [item.name for item in fields(kind) if item.name not in data and _default(item) is MISSING]
    if missing:
        raise ExportReportError(f"{where}: no {', '.join(map(repr, missing))}")
    return kind.from_dict(data)


def _load(hint, value: Any, where: str, spec=None) -> Any:
    """``value`` as ``hint`` says: a record, a list or map of records, or a plain JSON value (taken as it is)."""
    if spec is not None and spec.metadata.get("none_as_empty") and value == {}:
        return None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [arg for arg in args if arg is not type(None)]
        return None if value is None else _load(inner[0], value, where)
    if _holds_records(hint):
        return hint.from_dict(value, where)
    if origin is list and _holds_records(args[-1]):
        _expect(value, list, where)
        return [_load(args[0], item, f"{where}[{index}]") for index, item in enumerate(value)]
    if origin is dict and _holds_records(args[-1]):
        _expect(value, dict, where)
        return {key: _load(args[1], item, f"{where}[{key!r}]") for key, item in value.items()}
    return value


def _holds_records(hint) -> bool:
    return isinstance(hint, type) and issubclass(hint, Record)


def _expect(value: Any, kind: type, where: str) -> None:
    if not isinstance(value, kind):
        raise ExportReportError(f"{where}: expected {'a list' if kind is list else 'an object'}, "
                                f"found {type(value).__name__}")


def _dump(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_dict()
    if isinstance(value, list):
        return [_dump(item) for item in value]
    if isinstance(value, dict):
        return {key: _dump(item) for key, item in value.items()}
    return value


@dataclass(kw_only=True)
class AttemptRecord(Record):
    """One configuration the export tried (``attempts``), in the order tried."""

    #: the runtime target (:data:`targets.TARGETS`)
    backend: str
    precision: str
    #: why the plan tried it (``auto``: what this CPU or device offers)
    reason: str
    #: whether any of its candidate graphs passed validation
    passed: bool
    #: where none passed, one line naming each candidate's failures
    failures: list[str]
    #: what the target left out for a large graph, and why (absent where it left nothing out)
    left_out: str | None = field(default=None, metadata=OPTIONAL)


@dataclass(kw_only=True)
class CandidateRecord(Record):
    """One candidate graph of the chosen configuration (``candidates``)."""

    #: the candidate's label (``plain``, ``fused+ffn-out-fp32``, ...)
    graph: str
    passed: bool
    #: the sum of its median milliseconds over the workloads (None: not timed, it failed)
    latency_ms: float | None
    max_abs_diff: float
    cosine_min: float | None
    #: its timing score (:func:`timing.scores`, 1.0 the best); None: not timed, or exported before scores
    score: float | None = None


@dataclass(kw_only=True)
class MeasuredRow(Record):
    """One candidate graph of any configuration, validated and, where it passed, timed (``measured``):
    the table ``auto`` chose from, as the export log prints it."""

    backend: str
    precision: str
    graph: str
    #: its validation against PyTorch fp32 (:class:`report.ValidationReport`'s fields of the same names)
    passed: bool
    cosine_min: float | None
    cosine_mean: float | None
    agreement: float | None
    max_abs_diff: float
    #: the worst scored output's figures (:class:`report.ValidationReport`'s fields of the same names; absent where
    #: the task's outputs are not scored against each other, or validation stopped before every text)
    score_error: float | None = field(default=None, metadata=OPTIONAL)
    rank_agreement: float | None = field(default=None, metadata=OPTIONAL)
    terms_kept: float | None = field(default=None, metadata=OPTIONAL)
    #: workload name -> median milliseconds of one run (empty: not timed, it failed validation)
    timings_ms: dict[str, float]
    #: its timing score in the last heat it ran in (1.0 the best); None: not timed, or exported before scores
    #: (those rows have ``score_ms``, a sum of milliseconds, kept in ``extra``)
    score: float | None = None
    #: whether this is the graph the export kept
    chosen: bool


@dataclass(kw_only=True)
class Heat(Record):
    """Graphs timed side by side, all open at once (:func:`timing.time_in_heats`)."""

    #: graph label (``backend precision graph``) -> its score in this heat (1.0 the best); exports before
    #: scores have ``score_ms`` instead, kept in ``extra``
    score: dict[str, float] = field(default_factory=dict)
    #: the label of the heat's best, carried into the next heat
    fastest: str
    #: timed rounds (each graph once on each workload per round)
    rounds: int
    #: graph label -> the timed rounds it ran, where fewer than ``rounds``: left far behind by another graph, it
    #: stopped being timed (:func:`timing.left_behind`); empty in exports before that rule
    left_behind: dict[str, int] = field(default_factory=dict, metadata=OPTIONAL)


@dataclass(kw_only=True)
class Timing(Record):
    """How the graphs that passed were timed (``timing``; an empty object where none passed)."""

    #: what ``auto`` kept the fastest graph for (:data:`timing.OBJECTIVES`); None: exported before the choice
    optimize: str | None = None
    heats: list[Heat]
    #: the bytes the graphs of one heat may take (:func:`timing.memory_budget`)
    memory_budget_bytes: int
    #: graph label -> the bytes it was estimated to take open (:func:`timing.footprint`)
    estimated_bytes: dict[str, int]
    #: why one heat or several, in words
    why: str
    #: how a score is computed, in words (None: exported before scores)
    score: str | None = None


@dataclass(kw_only=True)
class WalkRecord(Record):
    """How the checkpoint was walked into the model (``walk``; :class:`walk.WalkReport`)."""

    #: distinct layers put into the model
    layers: int
    #: of those, layers rebuilt from the layer cache
    from_cache: int
    #: tensors put into the model
    tensors: int
    #: reason -> checkpoint keys deliberately not loaded
    skipped: dict[str, list[str]]
    #: model parameters the checkpoint lacks but the task never uses
    absent_optional: list[str]


@dataclass(kw_only=True)
class PlanRecord(Record):
    """A TensorRT plan ``nexus-sli build-plan`` built, validated and installed on a GPU host."""

    #: the plan against the export's stored reference, run by TensorRT on that GPU
    validation: ValidationReport = field(metadata=FLAT)
    #: the plan's file in the version folder (:func:`targets.tensorrt_plan.plan_filename`)
    file: str
    #: TensorRT's version
    tensorrt: str
    #: the GPU's name, and its compute capability (``"8.6"``)
    gpu: str
    compute_capability: str
    #: the host it was built on
    host: str
    #: the optimization profile: ``min``, ``opt``, ``max`` -> [batch, sequence]
    profile: dict[str, list[int]]
    #: how many layers were pinned to fp32
    fp32_layers: int
    workspace_bytes: int
    #: what validating there proves about serving
    validated_on: str


@dataclass(kw_only=True)
class LayerNormRecord(Record):
    """sentence-transformers' LayerNorm module after the pooling (``layer_norm``): ``torch.nn.LayerNorm`` over
    the pooled vector, read from the model's folder (:func:`st_folder.layer_norm`)."""

    #: the scale and the shift, one value per dimension
    weight: list[float]
    bias: list[float]
    #: its epsilon (sentence-transformers keeps torch's default: :data:`st_folder.LAYER_NORM_EPS`)
    eps: float


@dataclass(kw_only=True)
class DenseRecord(Record):
    """One of sentence-transformers' Dense modules (``dense``), as :class:`dense.Dense` holds it
    (:meth:`dense.Dense.record`); every export that wrote the record wrote all its keys."""

    #: ``[out_features, in_features]``
    weight: list[list[float]]
    #: ``[out_features]``; None: the module has no bias
    bias: list[float] | None
    #: the ``torch.nn`` activation's class name (a key of :data:`dense.ACTIVATIONS`)
    activation: str
    #: the feature it reads and overwrites (:data:`dense.SENTENCE`, the pooled vector, or :data:`dense.TOKENS`)
    input: str
    #: whether its input is added back, through ``residual`` (``[out_features, in_features]``) where the
    #: sizes differ (None: the input itself)
    use_residual: bool
    residual: list[list[float]] | None


@dataclass(kw_only=True)
class SpladeRecord(Record):
    """A sparse encoder's SpladePooling (``splade``): :data:`encoding.SPLADE_STRATEGIES` and
    :data:`encoding.SPLADE_ACTIVATIONS` of the python models' ``encoding.py``."""

    strategy: str
    activation: str


@dataclass(kw_only=True)
class ExportReport(Record):
    """What an export validated, measured and chose, and the facts the served model is built from."""

    #: the layout it was written in (:data:`VERSION`; a file without the key: :data:`UNVERSIONED`)
    version: int = VERSION
    #: the chosen graph against PyTorch fp32: precision, backend, thresholds, cosines, failures, ...
    validation: ValidationReport = field(metadata=FLAT)
    #: the model id (a hub id, or the local folder) and its family's ``model_type``
    model: str
    model_type: str
    #: the task spec's name (:mod:`tasks`)
    task: str
    #: the chosen candidate's graph label
    graph: str
    #: ``--backend`` and ``--precision`` as asked (``auto``, or a name)
    requested_backend: str
    requested_precision: str
    #: where the encoder runs (``cpu``, ``gpu``); exports before the GPU target are CPU ones
    device: str = "cpu"
    #: what validating on the export machine proves about serving (:attr:`targets.Target.validated_on`)
    validated_on: str | None = None
    #: every configuration tried, in order
    attempts: list[AttemptRecord]
    #: ``--allow-degraded``: whether a graph that failed validation could be written
    allow_degraded: bool
    #: the chosen configuration's candidate graphs
    candidates: list[CandidateRecord]
    #: every candidate of every configuration, validated and timed: how the export chose
    measured: list[MeasuredRow] = field(default_factory=list)
    #: the workloads each candidate was timed on, described
    workloads: list[str] = field(default_factory=list)
    #: how the passing graphs were timed; None where none passed (or before it was recorded)
    timing: Timing | None = field(default=None, metadata=NONE_AS_EMPTY)
    #: why this graph was kept, in words, where ``auto`` measured several (absent: one configuration was asked for)
    kept_because: str | None = field(default=None, metadata=OPTIONAL)
    #: whether the plain graph is past onnx_files.EXTERNAL_DATA_THRESHOLD (weights in a data file,
    #: fewer candidates)
    large_model: bool = False
    #: the graph's input names, in order
    inputs: list[str]
    #: whether texts longer than ``max_length`` are cut (else refused)
    truncate: bool
    #: the longest sequence the model takes, in tokens
    max_length: int
    #: how token states become the served embedding (``mean``, ``cls``, ``max``; ``splade``; ``multi-vector``: a
    #: late-interaction model's vector per scored token; ``bge-m3``: BGE-M3's three heads; None: the task does not pool;
    #: :func:`validate.embedder_from_report` reads these five back)
    pooling: str | None = None
    normalize: bool | None = None
    #: sentence-transformers' LayerNorm module after the pooling, where the model has one
    layer_norm: LayerNormRecord | None = field(default=None, metadata=OPTIONAL)
    #: sentence-transformers' Dense modules in order, where the model has them
    dense: list[DenseRecord] | None = field(default=None, metadata=OPTIONAL)
    #: a sparse encoder's SpladePooling
    splade: SpladeRecord | None = field(default=None, metadata=OPTIONAL)
    #: whether the graph ends in the pooling, its first output the pooled embedding (False: the token states,
    #: pooled by the python post-processing step; exports before pooling moved into the graph lack the key)
    pooled_in_graph: bool = False
    #: the graph's output names, in order (None: exported before the key, see ``pooled_in_graph``)
    outputs: list[str] | None = field(default=None, metadata=OPTIONAL)
    #: how the checkpoint was walked
    walk: WalkRecord
    #: compute capability -> the TensorRT plan build-plan installed for it
    tensorrt_plans: dict[str, PlanRecord] = field(default_factory=dict, metadata=OPTIONAL)

    @property
    def chosen(self) -> MeasuredRow | None:
        """The ``measured`` row of the graph the export kept: what ``auto`` chose (None only for
        exports before the table was recorded)."""
        return next((row for row in self.measured if row.chosen), None)

    @property
    def optimize(self) -> str | None:
        """What ``auto`` kept the fastest graph for; None where nothing was timed or before the choice."""
        return self.timing.optimize if self.timing is not None else None

    @classmethod
    def from_dict(cls, data: Any, where: str = "") -> "ExportReport":
        """``data`` read as its layout says (no ``version``: :data:`UNVERSIONED`)."""
        if isinstance(data, dict) and "version" not in data:
            data = {"version": UNVERSIONED, **data}
        return super().from_dict(data, where)

    def encode(self) -> bytes:
        """The file's bytes: :meth:`to_dict` as indented JSON, with a final newline."""
        return (json.dumps(self.to_dict(), indent=2) + "\n").encode()


def path(folder: Path) -> Path:
    """Where the report of the encoder model ``folder`` (``<name>_encoder``) is."""
    return Path(folder) / FILE


def read(folder: Path) -> ExportReport:
    """The report of the encoder model ``folder``; :class:`ExportReportError` where it is missing or not one."""
    file = path(folder)
    if not file.is_file():
        raise ExportReportError(f"{file} is missing: is {Path(folder).name} an exported encoder?")
    try:
        data = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExportReportError(f"{file} is not JSON: {exc}") from exc
    return ExportReport.from_dict(data, str(file))


def write(report: ExportReport, folder: Path) -> Path:
    """``report`` into the encoder model ``folder`` (the pipeline's staging folder: nothing serves it yet)."""
    file = path(folder)
    file.write_bytes(report.encode())
    return file


def replace(report: ExportReport, folder: Path) -> Path:
    """``report`` over the record of an encoder ``folder`` that may be served: by a rename, so that a reader
    sees the old record or the new one, never a part (``build-plan``'s update)."""
    file = path(folder)
    staging.replace_file(file, report.encode())
    return file
