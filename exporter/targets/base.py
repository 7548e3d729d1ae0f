"""What every runtime target provides, and the values the pipeline passes to it.

A target is one runtime that can serve the encoder (ONNX Runtime on the CPU,
OpenVINO, ...).  It says which precisions it offers, turns the exported plain
graph into candidate graphs for one precision, runs a candidate for validation
and timing, and says what the encoder's ``config.pbtxt`` needs to serve it.
The pipeline never asks which target it holds.
"""

from __future__ import annotations

import shutil
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from nexus_sli.exporter.errors import NexusError
from nexus_sli.exporter.export import onnx_files
from nexus_sli.exporter.export.candidate_cache import CandidateCache, graph_files
from nexus_sli.exporter.export.padding_trim import add_padding_trim
from nexus_sli.exporter.export.pooling import MultiVectorHead, Pooling, SpladePooling
from nexus_sli.exporter.export.quantize import attention_output_matmuls, ffn_output_matmuls
from nexus_sli.exporter.triton.config import EncoderServing


#: The task of the real models every kept bench run measured (dense sentence embeddings): for it, a target leaves
#: out the variants that missed the auto bar in each of those runs (docs/export.md, "What auto skips"); nothing was
#: measured for other tasks, which keep them
MEASURED_TASK = "embedding"


@dataclass(frozen=True)
class ExportedGraph:
    """The plain ONNX export and the facts a target needs to derive its graphs from it."""

    plain: Path
    work: Path
    family: Any
    config: Any
    task: Any
    input_names: list[str]
    #: how texts become the graph's inputs (for targets that calibrate on real texts)
    tokenizer: Any
    pad_id: int
    max_length: int
    #: embeddings pooled in the graph (:mod:`export.pooling`): every candidate ends in the pooling and
    #: answers ``[batch, hidden]`` (and the token states beside it), or SPLADE's ``[batch, vocab]``, or a
    #: late-interaction model's vectors, or BGE-M3's three outputs (``export/m3_heads.py``'s ``M3Head``); None: the
    #: candidates answer token states (or logits)
    pooling: Pooling | SpladePooling | MultiVectorHead | Any | None = None
    #: the plain graph is past :data:`onnx_files.EXTERNAL_DATA_THRESHOLD` (its weights in a data file):
    #: targets may offer fewer candidates (:meth:`Target.left_out` says which and why)
    large: bool = False
    #: the candidates are held to ``validate.AUTO_BAR`` (``auto`` chose the configuration): a target may offer
    #: variants that only such a bar needs, slower than the ones that keep the precision's own bar
    auto: bool = False
    #: only the first candidate is wanted (an export without a search, ``--no-search``): a target need not
    #: make the others
    first_only: bool = False
    #: where derived graphs made by an earlier export are kept (:mod:`export.candidate_cache`); None: make each
    cache: CandidateCache | None = None
    #: the graphs :meth:`trimmed` made in this export, by source: every configuration's copy of this object shares
    #: it, so that the targets that serve the same trimmed graph (ONNX Runtime's and OpenVINO's plain one) make it
    #: once
    trimmed_made: dict[Path, Path] = field(default_factory=dict, compare=False, repr=False)

    @property
    def pooled(self) -> bool:
        return self.pooling is not None

    @property
    def served_inputs(self) -> list[str]:
        """The candidates' inputs: the encoder's (:attr:`input_names`), then any the pooling adds (a
        late-interaction graph's scoring mask)."""
        return [*self.input_names, *(self.pooling.inputs if self.pooling is not None else ())]

    def complete(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``feeds`` of the encoder's inputs completed for a candidate: the inputs the pooling adds, where
        their values only shape the answer, not the work (timing, calibration)."""
        return self.pooling.complete(feeds) if self.pooling is not None else feeds

    def pooled_graph(self, path: Path) -> Path:
        """``path`` with the pooling appended where this export pools (targets call it after lowering
        the precision, so the pooling stays fp32), else ``path`` itself."""
        if self.pooling is None:
            return path
        return self.pooling.append(path, self.work / f"{path.stem}.pooled.onnx")

    def trimmed(self, path: Path) -> Path:
        """``path`` pooled (:meth:`pooled_graph`) and with the padding trim in front (see :mod:`padding_trim`), made
        once per export: a later configuration reads the same file (no target writes to a candidate's graph)."""
        if path in self.trimmed_made:
            return self.trimmed_made[path]
        if self.pooling is not None:
            per_token = self.pooling.per_token
        else:
            per_token = self.task.output_names() if self.task.per_token else []
        made = add_padding_trim(self.pooled_graph(path), self.work / f"{path.stem}.trim.onnx", per_token)
        self.trimmed_made[path] = made
        return made

    def derived(self, target: Path, make: Callable[[], Path], sources: list[Path], **recipe: Any) -> Path:
        """The graph ``make()`` writes at ``target`` from the graphs ``sources`` by ``recipe`` (what else it
        depends on, JSON-able): restored from the candidate cache where an earlier export made the same, else
        made (and cached).  Either way the pipeline validates it."""
        return make() if self.cache is None else self.cache.made(target, make, sources, recipe)

    def ffn_outputs(self, path: Path) -> list[str]:
        """The feed-forward output MatMuls of ``path``: int8 variants keep them in fp32."""
        width = self.family.ffn_width(self.config)
        return ffn_output_matmuls(path, int(width), self.family.hidden_size(self.config)) if width else []

    def attention_outputs(self, path: Path) -> list[str]:
        """The attention output projections of ``path``: the int8 MatMuls that cost the most fidelity
        once SmoothQuant has tamed the rest (bench/data/tried.md, "Role-based mixed precision")."""
        return attention_output_matmuls(path, self.family.hidden_size(self.config))


@dataclass
class Candidate:
    """One graph a target offers for a precision; validated and timed before one is chosen."""

    graph: str
    path: Path
    report: Any = None
    #: median milliseconds per workload (:mod:`export.timing`), and their sum
    timings: dict[str, float] | None = None
    latency_ms: float | None = None
    #: the score candidates are ranked by (:func:`export.timing.scores`, in the last heat it ran in; 1.0 the best)
    score: float | None = None

    def files(self) -> list[Path]:
        """The model file and what it reads beside it: an OpenVINO IR's weights, an ONNX graph's
        external data (past 2 GB, :mod:`export.onnx_files`)."""
        return graph_files(self.path)

    def install(self, folder: Path, stem: str = "model") -> list[Path]:
        """The candidate's files into a model version ``folder`` as ``stem.*`` (``model.onnx``, ``model.xml``
        + ``model.bin``); an ONNX graph's data file becomes ``model.onnx.data``, as the graph then names it."""
        if self.path.suffix != ".onnx":
            written = [folder / f"{stem}{file.suffix}" for file in self.files()]
            for file, target in zip(self.files(), written):
                shutil.copyfile(file, target)
            return written
        return onnx_files.files(onnx_files.gather(self.path, folder / f"{stem}.onnx"))


class Target(ABC):
    """One runtime that can serve the encoder; registered in :mod:`targets.registry`."""

    #: the name users pass (``--backend``) and the report records
    name: ClassVar[str]
    #: the precisions it serves, first the one it prefers
    precisions: ClassVar[tuple[str, ...]]
    #: where it runs: ``cpu`` or ``gpu`` (``--target``)
    device: ClassVar[str] = "cpu"
    #: whether its graphs cut trailing padding themselves (validation compares at the cut length)
    trims_padding: ClassVar[bool] = True
    #: what validating here proves about serving (recorded in validation.json)
    validated_on: ClassVar[str] = "the runtime that serves it, on this machine"
    #: why an export cannot make its graphs (they are built elsewhere), or None where it can
    not_exported: ClassVar[str | None] = None

    def check(self, precision: str) -> None:
        """Refuse a precision this target does not serve, naming the ones it does."""
        if precision not in self.precisions:
            raise NexusError(f"the {self.name} backend serves precision {', '.join(self.precisions)}, "
                             f"not {precision!r}")

    def runnable(self, precision: str, flags: set[str]) -> str:
        """The precision this machine can run of ``precision`` (a target may fall back, and warn)."""
        return precision

    def suits(self, precision: str, flags: set[str]) -> bool:
        """Whether ``auto`` may pick this configuration on a machine with these flags."""
        return True

    def left_out(self, graph: ExportedGraph, precision: str) -> str | None:
        """What :meth:`candidates` leaves out for this graph and why (a large graph's costly variants), or None;
        the export log and validation.json record it."""
        return None

    def thresholds(self, task: Any, precision: str) -> dict[str, float] | None:
        """Fidelity limits other than the default ones for this precision, or None."""
        return None

    @abstractmethod
    def candidates(self, graph: ExportedGraph, precision: str) -> list[Candidate]:
        """The graphs to validate and time for ``precision``, padding trim included."""

    @abstractmethod
    def open(self, path: Path, parameters: dict[str, str]) -> Any:
        """A graph as this runtime serves it with these encoder config parameters: something
        with ``get_inputs()``, ``get_outputs()`` and ``run(None, feeds)``, like an ORT session."""

    def runner(self, candidate: Candidate, precision: str) -> Any:
        """The candidate as it would be served at ``precision``: what validation and timing run."""
        return self.open(candidate.path, self.serving(precision).parameters)

    @abstractmethod
    def serving(self, precision: str) -> EncoderServing:
        """The encoder config's platform or backend, parameters and device."""

    def serving_graph(self, serving: EncoderServing, graph: Path) -> EncoderServing:
        """``serving`` (:meth:`serving`) for the one graph the encoder serves, where a setting depends on it."""
        return serving
