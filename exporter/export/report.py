"""What validation found: typed failures, and the report each candidate graph gets.

A failure says which check it failed (names, shapes, values, fidelity,
agreement, or the runtime refusing the inputs), so callers and tests branch on
its type, never on its wording.  The report is serialised once, into the
encoder's ``validation.json`` (:mod:`export_report`), and read back from there.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar

import numpy as np

REFERENCE = "pytorch-fp32"


@dataclass(frozen=True)
class Failure:
    """One check an exported graph failed."""

    kind: ClassVar[str] = "failure"
    message: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "message": self.message}

    @staticmethod
    def from_dict(data: dict) -> "Failure":
        """The typed failure :meth:`to_dict` wrote; a kind this version does not know keeps its name."""
        kinds = {kind.kind: kind for kind in Failure.__subclasses__()}
        if data["kind"] in kinds:
            return kinds[data["kind"]](data["message"])
        return UnknownFailure(data["message"], kind=data["kind"])


class NameMismatch(Failure):
    """The graph's inputs or outputs are not the model's."""

    kind = "names"


class ShapeMismatch(Failure):
    """An output's shape differs from PyTorch's for the same input."""

    kind = "shapes"


class ValueMismatch(Failure):
    """fp32 outputs further from PyTorch's than the parity tolerance."""

    kind = "values"


class FidelityShortfall(Failure):
    """Embeddings of a reduced precision below the cosine limits."""

    kind = "fidelity"


class AgreementShortfall(Failure):
    """Labels, tokens, spans or orders that differ from PyTorch's decisions too often."""

    kind = "agreement"


class ScoreShortfall(Failure):
    """Scores or rankings users compute from the outputs, or a sparse output's terms, further from PyTorch's
    than the bars (:mod:`score_fidelity`)."""

    kind = "scores"


class RuntimeFailure(Failure):
    """The runtime refused an input shape (baked shapes, bad indices)."""

    kind = "runtime"


@dataclass(frozen=True)
class UnknownFailure(Failure):
    """A failure of a kind a newer nexus-sli wrote, read back as it was written."""

    kind: str = field(default=Failure.kind, kw_only=True)


@dataclass
class Measures:
    """What running the reference inputs measured, accumulated batch by batch."""

    max_abs_diff: float = 0.0
    cosines: list[float] = field(default_factory=list)
    agree: int = 0
    decisions: int = 0
    ties: int = 0
    #: the texts whose fidelity was measured before a bar was already missed (None: every text)
    stopped_after: int | None = None
    #: (floor, output) where the run stopped on the score error: what those texts put under it
    #: (:meth:`score_fidelity.Scoring.error_floor`)
    score_floor: tuple[float, str] | None = None

    def missed(self, limits: dict[str, float]) -> bool:
        """Whether a bar that can only get worse as texts are added is missed already: the least cosine, or the
        largest difference (the mean and the agreement are judged on every text)."""
        return (("cosine_min" in limits and bool(self.cosines) and min(self.cosines) < limits["cosine_min"])
                or ("max_abs_diff" in limits and self.max_abs_diff > limits["max_abs_diff"]))

    def count(self, agree: int, decisions: int, ties: int) -> None:
        self.agree, self.decisions, self.ties = self.agree + agree, self.decisions + decisions, self.ties + ties


@dataclass
class ScoreFigures:
    """One output's scores against PyTorch's, every validation text scored against every other
    (:mod:`score_fidelity`)."""

    #: how its users score it (:data:`score_fidelity.SIMILARITIES`)
    similarity: str
    #: each text's largest score difference over its best reference score: the worst text's, and the mean
    score_error: float
    score_error_mean: float
    #: the share of the pairs that decide each text's top results ordered alike (None: no pair decided), the
    #: pairs decided, and the ties (reference scores too close to decide)
    rank_agreement: float | None
    ranked: int
    ties: int
    #: a sparse output's terms PyTorch weighs at the floor or more, and the share of them kept; the largest weight
    #: of a term PyTorch keeps and the graph drops, as a share of its text's largest (None: not sparse)
    terms: int | None = None
    terms_kept: float | None = None
    dropped_max: float | None = None

    def to_dict(self) -> dict:
        return {item.name: getattr(self, item.name) for item in fields(self)}


@dataclass
class ValidationReport:
    """One graph against PyTorch fp32: measured values, the limits, and every failure."""

    precision: str
    backend: str
    thresholds: dict[str, float]
    texts: int
    max_abs_diff: float
    cosine_min: float | None
    cosine_mean: float | None
    agreement: float | None
    decisions: int
    ties: int
    failures: list[Failure] = field(default_factory=list)
    reference: str = REFERENCE
    #: the scored outputs' worst figures (:class:`ScoreFigures`, the bars' metrics); None where the task's outputs
    #: are not scored against each other, validation stopped before every text, or exported before them
    score_error: float | None = None
    rank_agreement: float | None = None
    terms_kept: float | None = None
    #: output name -> its figures
    scores: dict[str, ScoreFigures] = field(default_factory=dict)
    #: what :meth:`to_dict` writes besides the fields, computed from them
    DERIVED: ClassVar[tuple[str, ...]] = ("passed",)
    #: the fields :meth:`to_dict` writes as records
    NESTED: ClassVar[tuple[str, ...]] = ("failures", "scores")
    #: the fields :meth:`to_dict` writes only where measured (a report of an earlier layout is written back as read)
    OPTIONAL: ClassVar[tuple[str, ...]] = ("score_error", "rank_agreement", "terms_kept", "scores")

    @classmethod
    def from_measures(cls, precision: str, backend: str, thresholds: dict[str, float], texts: int,
                      measures: Measures, failures: list[Failure],
                      scores: dict[str, ScoreFigures] | None = None) -> "ValidationReport":
        cosines, scores = measures.cosines, scores or {}
        return cls(precision, backend, dict(thresholds), texts, measures.max_abs_diff,
                   float(min(cosines)) if cosines else None, float(np.mean(cosines)) if cosines else None,
                   measures.agree / measures.decisions if measures.decisions else None,
                   measures.decisions, measures.ties, list(failures),
                   score_error=measured(max, [s.score_error for s in scores.values()]),
                   rank_agreement=measured(min, [s.rank_agreement for s in scores.values()]),
                   terms_kept=measured(min, [s.terms_kept for s in scores.values()]), scores=dict(scores))

    @property
    def passed(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        return "passed" if self.passed else "; ".join(map(str, self.failures))

    def to_dict(self) -> dict:
        values = {item.name: getattr(self, item.name) for item in fields(self) if item.name not in self.NESTED}
        values = {name: value for name, value in values.items() if value is not None or name not in self.OPTIONAL}
        scores = {"scores": {name: figures.to_dict() for name, figures in self.scores.items()}} if self.scores else {}
        return {**values, "failures": [f.to_dict() for f in self.failures], "passed": self.passed, **scores}

    @classmethod
    def from_dict(cls, data: dict) -> "ValidationReport":
        """The report :meth:`to_dict` wrote (``passed`` follows from the failures again)."""
        values = {item.name: data[item.name] for item in fields(cls)
                  if item.name in data and item.name not in cls.NESTED}
        return cls(**values, failures=[Failure.from_dict(f) for f in data.get("failures", [])],
                   scores={name: ScoreFigures(**figures) for name, figures in data.get("scores", {}).items()})


def measured(pick, values: list) -> float | None:
    """``pick`` (min or max: the worse) of the figures that were measured; None where none was."""
    measured = [value for value in values if value is not None]
    return pick(measured) if measured else None

