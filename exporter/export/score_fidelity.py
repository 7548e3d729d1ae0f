"""Score and ranking fidelity: a candidate judged on the scores its users compute from its outputs.

A retrieval model's users do not read its vectors: they score texts against
each other and rank what comes back.  The cosines :func:`validate.compare`
takes per output bound each vector's direction, not the scores (a lexical score
sums products of weights, MaxSim sums maxima over many vectors), nor whether a
ranking changes.  So every validation text is scored against every other text
(the texts have no queries), as users score each output:

- a dense vector: cosine;
- sparse weights: their dot product (SPLADE's ``[vocab]`` rows; BGE-M3's lexical
  weights, per token id its tokens' largest weight, FlagEmbedding's lexical
  matching score, as :func:`client.late_interaction.lexical_score`);
- vectors per token: MaxSim or MeanMaxSim (:func:`client.late_interaction.maxsim`),
  each text's query side against the other texts' document side.

Each scored output gets its figures against PyTorch fp32's scores
(:class:`report.ScoreFigures`), which the bars in :mod:`validate` hold:

- ``score_error``: a text's largest score difference over its best reference
  score (the scale its ranking is read on), for the worst text;
- ``rank_agreement``: of the pairs that decide each text's top :data:`RANKED`
  results (:func:`tasks.agreement.ranked_pairs`), the share ordered alike;
  reference scores within ``TIE_MARGIN`` of the text's best score are ties;
- ``terms_kept`` (sparse outputs): of the terms PyTorch weighs at
  :data:`TERM_FLOOR` of the text's largest weight or more, the share kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable

import numpy as np

from nexus_sli.client.late_interaction import SIMILARITIES as MULTI_VECTOR_SIMILARITIES
from nexus_sli.client.late_interaction import maxsim
from nexus_sli.tasks import TaskSpec
from nexus_sli.tasks.agreement import ranked_pairs
from nexus_sli.tasks.bge_m3 import lexical

from .report import ScoreFigures, measured

#: how a dense vector (cosine), SPLADE's ``[vocab]`` row (dot product) and BGE-M3's token weights with their ids
#: (the lexical matching score) are scored; MaxSim and MeanMaxSim by their names
COSINE, DOT, LEXICAL = "cosine", "dot", "lexical"
SIMILARITIES = (COSINE, DOT, LEXICAL, *MULTI_VECTOR_SIMILARITIES)
#: the bars' metrics: the worst text's scaled score error (an upper bar), the rank agreement and the share of terms
#: kept (lower bars)
SCORE_METRICS = ("score_error", "rank_agreement", "terms_kept")
#: the results of a text's ranking whose order counts: a first page of results
RANKED = 10
#: the weight, as a share of the text's largest, from which PyTorch's terms must be kept (docs/export.md, "Scores
#: and rankings": below it, the faithful precisions already zero a few terms)
TERM_FLOOR = 0.01


@dataclass(frozen=True)
class ScoredOutput:
    """One output users score: its name, its place among the graph's outputs, and its similarity."""

    name: str
    position: int
    similarity: str

    @property
    def sparse(self) -> bool:
        return self.similarity in (DOT, LEXICAL)


@dataclass
class Scoring:
    """The validation texts' scored outputs, gathered batch by batch (one validation pass), then scored."""

    outputs: list[ScoredOutput]
    #: the texts come as every query-side row, then every document-side row, in one order (``sided`` tokenizers)
    sided: bool
    #: turns a graph's first output into the served vector where the graph does not pool (None: it pools)
    pool: Any = None
    got: dict[str, list] = field(default_factory=dict)
    expected: dict[str, list] = field(default_factory=dict)
    #: per cosine output, each text's scale over all the texts (its largest reference score against the others),
    #: in the order the texts are gathered, where known before the graph runs (:meth:`know_scales`)
    scales: dict[str, np.ndarray] = field(default_factory=dict)

    def add(self, got: list[np.ndarray], expected: list[np.ndarray], feeds: dict[str, np.ndarray],
            mask: np.ndarray, scored: np.ndarray) -> None:
        """One text batch: each scored output's texts, from the graph (``got``) and from PyTorch (``expected``);
        ``mask`` and ``scored`` as the batch's outputs are cut (the attention and scoring masks)."""
        for output in self.outputs:
            for answers, kept in ((got, self.got), (expected, self.expected)):
                array = self.pool(answers[0], mask) if self.pool is not None else answers[output.position]
                kept.setdefault(output.name, []).extend(_texts(output.similarity, array, feeds, scored))

    def know_scales(self, batches: Iterable[tuple[list[np.ndarray], dict[str, np.ndarray], np.ndarray, np.ndarray]]
                    ) -> None:
        """Each text's scale over all the texts, per cosine output, from PyTorch's outputs alone (every text
        batch's ``(expected, feeds, mask, scored)``, as :meth:`add` takes them, in the order it will): the scale
        :func:`_figures` divides each text's score differences by, known before the graph runs."""
        if self.sided:
            return
        texts: dict[str, list] = {}
        for expected, feeds, mask, scored in batches:
            for output in self.outputs:
                if output.similarity == COSINE:
                    array = self.pool(expected[0], mask) if self.pool is not None else expected[output.position]
                    texts.setdefault(output.name, []).extend(_texts(COSINE, array, feeds, scored))
        for name, vectors in texts.items():
            e = _scores(COSINE, vectors, vectors)
            self.scales[name] = np.where(~np.eye(len(e), dtype=bool), np.abs(e), 0.0).max(axis=1)

    def error_floor(self) -> tuple[float, str] | None:
        """(floor, output): a floor the texts gathered so far already put under the score error, where one holds.
        A text's error is its largest score difference against the other texts over its scale, and texts
        gathered later only add differences: so its largest difference so far over its scale (known from
        :meth:`know_scales`), or else over 1, as a cosine is at most 1 away from 0, is a floor.  None where no
        output has one: other similarities' scores are unbounded, and a sided model's texts are scored against
        a side gathered after them."""
        if self.sided:
            return None
        floors = []
        for output in self.outputs:
            got, expected = self.got.get(output.name, []), self.expected.get(output.name, [])
            if output.similarity != COSINE or len(expected) < 2:
                continue
            g, e = _scores(COSINE, got, got), _scores(COSINE, expected, expected)
            others = ~np.eye(len(e), dtype=bool)
            differences = np.where(others, np.abs(g - e), 0.0).max(axis=1)
            if output.name in self.scales:
                scale = self.scales[output.name][:len(e)]
                ranked = scale > 0  # the texts the full run judges (:func:`_figures`)
                floors.append((float((differences[ranked] / scale[ranked]).max(initial=0.0)), output.name))
            else:
                ranked = np.where(others, np.abs(e), 0.0).max(axis=1) > 0
                floors.append((float(differences[ranked].max(initial=0.0)), output.name))
        return max(floors, default=None)

    def figures(self, order: list[int] | None = None) -> dict[str, ScoreFigures]:
        """Each output's figures over the texts gathered (``order``: each text's place in the validation texts,
        where the batches mixed them; None: in order)."""
        return {output.name: _figures(output, _ordered(self.got[output.name], order),
                                      _ordered(self.expected[output.name], order), self.sided)
                for output in self.outputs if output.name in self.got}


def scoring(embedder: Any, task: TaskSpec | None, output_names: list[str], pooled: bool) -> Scoring | None:
    """How ``embedder``'s outputs are scored (its ``scored``: a similarity per graph output, in order); None where
    the task's outputs are not scored against each other.  ``pooled``: the graph answers the outputs as served
    (``output_names`` names them); else its first output is pooled by ``embedder`` into ``task``'s result."""
    similarities = tuple(getattr(embedder, "scored", ()) or ())
    if not similarities or task is None:
        return None
    names = output_names if pooled else [task.client_output]
    outputs = [ScoredOutput(name, position, similarity)
               for position, (name, similarity) in enumerate(zip(names, similarities))]
    return Scoring(outputs, task.tokenizer_mode == "sided", None if pooled else embedder)


def applicable(limits: dict[str, float], found: Scoring | None) -> dict[str, float]:
    """``limits`` without the score bars that cannot apply: every one where nothing is scored, ``terms_kept``
    where no output is sparse."""
    if found is None:
        left_out = set(SCORE_METRICS)
    else:
        left_out = set() if any(output.sparse for output in found.outputs) else {"terms_kept"}
    return {metric: limit for metric, limit in limits.items() if metric not in left_out}


def worst(first: dict[str, ScoreFigures], second: dict[str, ScoreFigures]) -> dict[str, ScoreFigures]:
    """Per output, the worse of two passes' figures (a graph validated in two batchings)."""
    return {name: _worse(figures, second[name]) if name in second else figures for name, figures in first.items()}


def _worse(a: ScoreFigures, b: ScoreFigures) -> ScoreFigures:
    ranked = [f for f in (a, b) if f.rank_agreement is not None]
    ranking = min(ranked, key=lambda f: f.rank_agreement) if ranked else a
    return replace(a, score_error=max(a.score_error, b.score_error),
                   score_error_mean=max(a.score_error_mean, b.score_error_mean),
                   rank_agreement=ranking.rank_agreement, ranked=ranking.ranked, ties=ranking.ties,
                   terms_kept=measured(min, [a.terms_kept, b.terms_kept]),
                   dropped_max=measured(max, [a.dropped_max, b.dropped_max]))


def _texts(similarity: str, array: np.ndarray, feeds: dict[str, np.ndarray], scored: np.ndarray) -> list:
    """One batch's texts as ``similarity`` scores them: vectors, (ids, weights), or each text's scored vectors."""
    if similarity == COSINE:
        return list(array.astype(np.float64))
    if similarity == DOT:
        return [(np.flatnonzero(row), row[row != 0].astype(np.float64)) for row in array]
    if similarity == LEXICAL:
        return [lexical(row, ids) for row, ids in zip(array, feeds["input_ids"])]
    return [row[kept.astype(bool)] for row, kept in zip(array, scored)]


def _ordered(texts: list, order: list[int] | None) -> list:
    if order is None:
        return texts
    placed = [None] * len(texts)
    for text, place in zip(texts, order):
        placed[place] = text
    return placed


def _figures(output: ScoredOutput, got: list, expected: list, sided: bool) -> ScoreFigures:
    """One output's figures, each text's scores against the other texts' (their document side where sided); a
    sparse output's terms are counted on the texts scored against (each text once)."""
    half = len(expected) // 2 if sided else 0
    queries, documents = (slice(0, half), slice(half, None)) if sided else (slice(None), slice(None))
    g = _scores(output.similarity, got[queries], got[documents])
    e = _scores(output.similarity, expected[queries], expected[documents])
    others = ~np.eye(len(e), dtype=bool)  # a text is not scored against itself (its other side, where sided)
    g, e = g[others].reshape(len(e), -1), e[others].reshape(len(e), -1)
    scale = np.abs(e).max(axis=1)
    ranked = scale > 0  # a text PyTorch scores 0 against every other has no ranking to keep
    errors = np.abs(g - e)[ranked].max(axis=1) / scale[ranked]
    agree, decided, ties = ranked_pairs(g[ranked], e[ranked], scale[ranked], RANKED)
    terms = _terms(got[documents], expected[documents]) if output.sparse else {}
    return ScoreFigures(similarity=output.similarity, score_error=_figure(errors.max(initial=0.0)),
                        score_error_mean=_figure(errors.mean() if errors.size else 0.0),
                        rank_agreement=agree / decided if decided else None, ranked=decided, ties=ties, **terms)


def _figure(value: float) -> float:
    return float(f"{value:.6g}")


def _scores(similarity: str, queries: list, documents: list) -> np.ndarray:
    """``[queries, documents]`` scores, float64 (MaxSim: float32, as served)."""
    if similarity == COSINE:
        a, b = np.stack(queries), np.stack(documents)
        a /= np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)
        b /= np.maximum(np.linalg.norm(b, axis=1, keepdims=True), 1e-12)
        return a @ b.T
    if similarity in (DOT, LEXICAL):
        return _sparse_matrix(queries, columns := _columns(queries + documents)) @ _sparse_matrix(documents, columns).T
    return maxsim(queries, documents, mean=MULTI_VECTOR_SIMILARITIES[similarity]).astype(np.float64)


def _columns(texts: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Every term id the texts hold, sorted: the columns of their weights as dense rows."""
    return np.unique(np.concatenate([ids for ids, _ in texts] + [np.zeros(0, np.int64)]))


def _sparse_matrix(texts: list[tuple[np.ndarray, np.ndarray]], columns: np.ndarray) -> np.ndarray:
    matrix = np.zeros((len(texts), len(columns)))
    for row, (ids, weights) in enumerate(texts):
        matrix[row, np.searchsorted(columns, ids)] = weights
    return matrix


def _terms(got: list, expected: list) -> dict:
    """``terms``: PyTorch's terms weighing :data:`TERM_FLOOR` of their text's largest weight or more, ``terms_kept``:
    the share of them the graph keeps (a weight above zero), ``dropped_max``: the largest relative weight of a
    term the graph drops (0.0: none)."""
    terms = kept = 0
    dropped = 0.0
    for (got_ids, got_weights), (ids, weights) in zip(got, expected):
        if not len(weights):
            continue
        relative = weights / weights.max()
        held = np.isin(ids, got_ids[got_weights > 0])
        terms += int((relative >= TERM_FLOOR).sum())
        kept += int((held & (relative >= TERM_FLOOR)).sum())
        dropped = max(dropped, float(relative[~held].max(initial=0.0)))
    return {"terms": terms, "terms_kept": kept / terms if terms else None, "dropped_max": _figure(dropped)}
