"""Parity (fp32) and fidelity (int8) of an exported graph against PyTorch fp32.

Checks run in the order optimum's validator uses: output names, then shapes,
then values, and every failure is collected before deciding.  Inputs differ
from the export example: batch 1 and 5, padded rows, and a sequence near the
position limit, plus a fixed, project-written set of texts for fidelity.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from importlib import resources
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from .dense import SENTENCE, TOKENS, Dense
from .export_report import ExportReport, LayerNormRecord, SpladeRecord
from . import score_fidelity
from .padding_trim import trimmed_length
from .report import (
    AgreementShortfall,
    Failure,
    FidelityShortfall,
    Measures,
    NameMismatch,
    RuntimeFailure,
    ScoreShortfall,
    ShapeMismatch,
    ValidationReport,
    ValueMismatch,
)
from .score_fidelity import COSINE, DOT, SCORE_METRICS
from nexus_sli.exporter.triton.python_models.encoding import encode, l2_normalize, pool, splade
from nexus_sli.exporter.triton.python_models.sides import DOCUMENT, SCORE_MASK, Sides, side_tokenizers, sided_encode
from nexus_sli.tasks import TaskSpec
from nexus_sli.tasks.agreement import TIE_MARGIN, agreement

if TYPE_CHECKING:  # the folder reader imports the model families (PyTorch): a GPU host validates without them
    from .multi_vector import MultiVectorConfig

#: The scores users compute from embeddings, every validation text against every other
#: (:mod:`score_fidelity`): the worst text's score error as a share of its best score, the rank agreement of
#: each text's top results, and the share kept of the sparse terms over the floor.  Derived from what bf16
#: and fp16, the reduced precisions that keep fidelity, reach against fp32 (docs/export.md, "Scores and
#: rankings"; the figures: bench/data/tried.md, "Score and ranking bars").
SCORE_BAR: dict[str, float] = {"score_error": 0.02, "rank_agreement": 0.999, "terms_kept": 1.0}

#: Embeddings: token states within 1e-4 (fp32); sentence-embedding cosine (bf16, int8), and the
#: score bar where the precision keeps fidelity (bf16, fp16).
#: fp32's tolerance is also the margin under which two reference scores are a tie
#: (:data:`tasks.agreement.TIE_MARGIN`): parity allows either order of such scores.
THRESHOLDS: dict[str, dict[str, float]] = {
    "fp32": {"max_abs_diff": TIE_MARGIN},
    "bf16": {"cosine_mean": 0.9999, "cosine_min": 0.999, **SCORE_BAR},
    "fp16": {"cosine_mean": 0.9999, "cosine_min": 0.999, **SCORE_BAR},
    "int8": {"cosine_mean": 0.99, "cosine_min": 0.95},
}
#: Tasks with labels or spans: the same argmax as PyTorch fp32.
LABEL_THRESHOLDS: dict[str, dict[str, float]] = {
    "fp32": {"max_abs_diff": TIE_MARGIN, "agreement": 1.0},
    "bf16": {"agreement": 0.99},
    "fp16": {"agreement": 0.99},
    "int8": {"agreement": 0.98},
}


def thresholds(task: TaskSpec | None, precision: str) -> dict[str, float]:
    """The default limits for ``precision``: argmax agreement for tasks that decide, else values."""
    return (LABEL_THRESHOLDS if task is not None and task.agreement else THRESHOLDS)[precision]


#: The bar a configuration must clear to be exported without being asked for by name
#: (``auto``), whatever its precision: a reduced precision earns its place by speed
#: only at this fidelity, and at the :data:`SCORE_BAR`.  The bench holds the served default to the same
#: cosines.
AUTO_BAR: dict[str, float] = {"cosine_mean": 0.995, "cosine_min": 0.98}
AUTO_LABEL_BAR: dict[str, float] = {"agreement": 0.99}


#: The metrics whose bar is a most (the others' is a least).
UPPER_BARS = ("max_abs_diff", "score_error")


def with_auto_bar(limits: dict[str, float], task: TaskSpec | None) -> dict[str, float]:
    """``limits`` tightened to :data:`AUTO_BAR` and :data:`SCORE_BAR` (or the label bar for tasks that decide):
    of two limits on one metric the stricter holds."""
    bar = AUTO_LABEL_BAR if task is not None and task.agreement else {**AUTO_BAR, **SCORE_BAR}
    tightened = dict(limits)
    for metric, limit in bar.items():
        stricter = min if metric in UPPER_BARS else max
        tightened[metric] = stricter(limit, tightened.get(metric, limit))
    return tightened


#: Longest sequence the parity check runs (attention cost grows with its square).
LONG_CASE_CAP = 1024
TEXT_BATCH = 16


def validation_texts() -> list[str]:
    text = resources.files("nexus_sli.exporter.export").joinpath("data/validation_texts.txt").read_text("utf-8")
    return [line for line in text.splitlines() if line.strip()]


def parity_cases(input_names: list[str], vocab_size: int, pad_id: int, long_len: int) -> list[dict[str, np.ndarray]]:
    """Token batches of shapes other than the export example's (2 x 16), one of them
    padded past its longest row, as the served tokenizer pads (the graph cuts it off)."""
    rng = np.random.default_rng(1234)
    cases = []
    long_len = min(long_len, LONG_CASE_CAP)
    for lengths, width in (([7], 7), ([23, 17, 9, 3, 2], 23), ([11, 5], 40), ([long_len], long_len)):
        batch = len(lengths)
        ids = rng.integers(5, max(vocab_size, 6), size=(batch, width), dtype=np.int64)
        ids[ids == pad_id] = pad_id + 1 if pad_id + 1 < vocab_size else pad_id - 1
        mask = np.zeros((batch, width), dtype=np.int64)
        for row, n in enumerate(lengths):
            mask[row, :n] = 1
            ids[row, n:] = pad_id
        feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
        cases.append({name: feeds[name] for name in input_names})
    return cases


#: Scored positions past a parity row's last attended token, in the cases of a graph with a scoring mask:
#: what a query expansion the encoder does not attend to looks like.
UNATTENDED_SCORED = 4


def with_score_masks(cases: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """``cases`` with a scoring mask (:data:`SCORE_MASK`, after the other inputs): every attended position,
    and up to :data:`UNATTENDED_SCORED` positions past each row's last one, unattended, holding the row's
    first token rather than padding (a query's expansion with ``attend`` false), so that validation proves
    the graph computes and keeps positions the encoder does not attend to."""
    scored_cases = []
    for feeds in cases:
        ids, mask = feeds["input_ids"].copy(), feeds["attention_mask"]
        score = mask.copy()
        for row, n in enumerate(mask.sum(axis=1)):
            extra = slice(int(n), min(int(n) + UNATTENDED_SCORED, mask.shape[1]))
            score[row, extra] = 1
            ids[row, extra] = ids[row, 0]
        scored_cases.append({**feeds, "input_ids": ids, SCORE_MASK: score})
    return scored_cases


@dataclass
class Embedder:
    """How token states become the served embedding (Dense modules on the token states, pooling, Dense
    modules on the pooled vector, a layer norm, normalisation: sentence-transformers' order)."""

    pooling: str
    normalize: bool
    #: sentence-transformers' LayerNorm module after the pooling, or None
    layer_norm: LayerNormRecord | None = None
    #: sentence-transformers' Dense modules, in order: on the token states before the pooling, then on
    #: the pooled vector (:attr:`Dense.input` says which)
    dense: list[Dense] = field(default_factory=list)
    #: the mask input it pools with, and whether it answers per token (a vector per text here)
    reads: ClassVar[str] = "attention_mask"
    per_token: ClassVar[bool] = False
    #: how users score its outputs, in order (:mod:`score_fidelity`; the token states kept beside: not scored)
    scored: ClassVar[tuple[str, ...]] = (COSINE,)

    def __call__(self, hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
        for module in self.on(TOKENS):
            hidden = module(hidden)
        vectors = pool(hidden, mask, self.pooling)
        for module in self.on(SENTENCE):
            vectors = module(vectors)
        if self.layer_norm is not None:
            vectors = _layer_norm(vectors, self.layer_norm)
        return l2_normalize(vectors) if self.normalize else vectors

    def on(self, feature: str) -> list[Dense]:
        """The Dense modules that read ``feature`` (:data:`dense.TOKENS` or :data:`dense.SENTENCE`), in order."""
        return [module for module in self.dense if module.input == feature]

    def size(self, hidden_size: int) -> int:
        """The served vector's size: the last Dense module's ``out_features``, else the hidden size."""
        return self.dense[-1].out_features if self.dense else hidden_size

    @property
    def graph_only(self) -> list[str]:
        """The modules only a graph that pools applies (the python post-processing step pools and
        normalises only)."""
        named = ["a LayerNorm module"] if self.layer_norm is not None else []
        return named + (["Dense modules"] if self.dense else [])

    def record(self) -> dict:
        """What validation.json keeps of it (:func:`embedder_from_report` reads it back)."""
        return {"pooling": self.pooling, "normalize": self.normalize,
                **({"layer_norm": self.layer_norm} if self.layer_norm is not None else {}),
                **({"dense": [module.record() for module in self.dense]} if self.dense else {})}


def _layer_norm(vectors: np.ndarray, norm: LayerNormRecord) -> np.ndarray:
    """torch.nn.LayerNorm over the last axis, in float64 then back (the reference's own arithmetic)."""
    x = vectors.astype(np.float64)
    centred = x - x.mean(axis=-1, keepdims=True)
    scaled = centred / np.sqrt((centred ** 2).mean(axis=-1, keepdims=True) + norm.eps)
    return (scaled * np.asarray(norm.weight) + np.asarray(norm.bias)).astype(np.float32)


@dataclass
class SparseEmbedder:
    """How masked-LM logits become the served sparse embedding (sentence-transformers' SpladePooling)."""

    strategy: str
    activation: str
    reads: ClassVar[str] = "attention_mask"
    per_token: ClassVar[bool] = False
    scored: ClassVar[tuple[str, ...]] = (DOT,)

    def __call__(self, logits: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return splade(logits, mask, self.strategy, self.activation)

    def record(self) -> dict:
        return {"pooling": "splade", "normalize": False,
                "splade": SpladeRecord(strategy=self.strategy, activation=self.activation)}


#: validation.json's ``pooling`` for a late-interaction export (:meth:`MultiVectorEmbedder.record`)
MULTI_VECTOR_POOLING = "multi-vector"
#: validation.json's ``pooling`` for a BGE-M3 export (``m3_heads.M3Embedder``)
M3_POOLING = "bge-m3"


@dataclass
class MultiVectorEmbedder:
    """How token states become a late-interaction model's vectors: the Dense modules on every token, the
    normalisation, and only the tokens of the scoring mask (``python_models/sides.py``), as
    sentence-transformers' ``MultiVectorEncoder`` makes them."""

    normalize: bool
    dense: list[Dense] = field(default_factory=list)
    #: the model's similarity (``multi_vector.SIMILARITIES``), and the vectors' size, for clients
    similarity: str = "maxsim"
    vector_size: int = 0
    #: the folder as read (its sides, for the tokenizer step); None where rebuilt from validation.json
    config: MultiVectorConfig | None = None
    reads: ClassVar[str] = SCORE_MASK
    per_token: ClassVar[bool] = True

    @property
    def scored(self) -> tuple[str, ...]:
        """Its vectors are scored by the model's similarity (MaxSim or MeanMaxSim)."""
        return (self.similarity,)

    def __call__(self, hidden: np.ndarray, score_mask: np.ndarray) -> np.ndarray:
        """``[batch, sequence, size]``: each token's vector where ``score_mask`` is 1, zeros elsewhere; the rows
        :func:`multi_vector.multi_vectors` lists per text, in place (here, since ``nexus-sli validate`` on a
        GPU host runs it without the folder reader's PyTorch)."""
        vectors = hidden.astype(np.float32)
        for module in self.dense:
            vectors = module(vectors)
        if self.normalize:
            vectors = l2_normalize(vectors)
        return (vectors * score_mask[..., None]).astype(np.float32)

    @property
    def graph_only(self) -> list[str]:
        """Only a graph with the head keeps the scoring mask's positions the encoder does not attend to
        (a graph without it cuts the padding by the attention mask alone)."""
        return ["the scoring mask"]

    @property
    def sides(self) -> Sides | None:
        """How the tokenizer step makes each side's tokens and scoring mask (None: rebuilt from a report)."""
        return self.config.sides if self.config is not None else None

    def record(self) -> dict:
        return {"pooling": MULTI_VECTOR_POOLING, "normalize": self.normalize,
                **({"dense": [module.record() for module in self.dense]} if self.dense else {})}


def embedder_from_report(exported: ExportReport) -> Embedder | SparseEmbedder | MultiVectorEmbedder | None:
    """The embedder an export's validation.json records (None: the task's graph does not pool)."""
    if exported.splade:
        return SparseEmbedder(exported.splade.strategy, exported.splade.activation)
    if not exported.pooling:
        return None
    if exported.pooling == M3_POOLING:
        raise ValueError("a bge-m3 export keeps its heads' weights beside its stored reference, not in its report: "
                         "M3Embedder.from_stored builds its embedder (as revalidate does)")
    if exported.pooling == MULTI_VECTOR_POOLING:
        return MultiVectorEmbedder(bool(exported.normalize), [Dense.from_record(r) for r in exported.dense or []])
    return Embedder(exported.pooling, bool(exported.normalize), exported.layer_norm,
                    [Dense.from_record(record) for record in exported.dense or []])


@dataclass
class Reference:
    input_names: list[str]
    output_names: list[str]
    batches: list[dict[str, np.ndarray]] = field(default_factory=list)
    outputs: list[list[np.ndarray]] = field(default_factory=list)
    text_batches: int = 0
    #: each text row's place among the validation texts' rows, in batch order, where the batches mixed them
    #: (:func:`mixed_batches`); None: in order
    order: list[int] | None = None

    @property
    def texts(self) -> int:
        """The validation texts in the text batches."""
        return sum(len(b["input_ids"]) for b in self.batches[self.first_text:])

    @property
    def first_text(self) -> int:
        """Index of the first text batch (the parity cases come first)."""
        return len(self.batches) - self.text_batches

    def add(self, feeds: dict[str, np.ndarray], outputs: list[np.ndarray]) -> None:
        self.batches.append(feeds)
        self.outputs.append(outputs)


def build_reference(model: Any, task: TaskSpec, input_names: list[str], cases, text_batches) -> Reference:
    """PyTorch fp32 outputs for the parity cases and the text batches, computed once.  ``input_names``: the
    served graph's inputs; the scoring mask among them is the head's, not the PyTorch model's."""
    import torch  # only here: validating a stored reference (nexus-sli validate) needs no PyTorch

    reference = Reference(input_names, task.output_names())
    with torch.no_grad():
        for feeds in [*cases, *text_batches]:
            model_feeds = {k: torch.from_numpy(v) for k, v in feeds.items() if k != SCORE_MASK}
            output = model(**model_feeds, return_dict=True)
            reference.add(feeds, [t.detach().numpy() for t in task.select_outputs(output)])
    reference.text_batches = len(text_batches)
    return reference


def text_batches(tokenizer, input_names: list[str], pad_id: int, max_length: int,
                 pairs: bool = False) -> list[dict[str, np.ndarray]]:
    texts = validation_texts()
    if pairs:  # each text with the next one: (query, document) / (question, context) shaped
        texts = list(zip(texts, texts[1:] + texts[:1]))
    # Batches of similar lengths pad little, so the reference kept beside the model stays small.
    lengths = [len(e.ids) for e in tokenizer.encode_batch(texts)]
    texts = [text for _, text in sorted(zip(lengths, texts), key=lambda pair: pair[0])]
    return [
        encode(tokenizer, texts[i : i + TEXT_BATCH], input_names, pad_id, max_length)
        for i in range(0, len(texts), TEXT_BATCH)
    ]


def sided_text_batches(tokenizer_path, sides: Sides, input_names: list[str],
                       pad_id: int) -> list[dict[str, np.ndarray]]:
    """The validation texts on each side of a late-interaction model, tokenized as the ``sided`` tokenizer
    step does (``python_models/sides.py``: the side's marker, length, query expansion and scoring mask):
    the query batches, then the document batches, both in one order (by the documents' lengths), so that the
    i-th query is the i-th document's text: each text is scored against the others' documents
    (:mod:`score_fidelity`), not against its own."""
    texts = validation_texts()
    tokenizers = side_tokenizers(str(tokenizer_path), sides)
    lengths = [len(e.ids) for e in tokenizers[DOCUMENT].encode_batch(texts)]
    ordered = [text for _, text in sorted(zip(lengths, texts), key=lambda pair: pair[0])]
    return [sided_encode(tokenizer, ordered[i:i + TEXT_BATCH], side, sides, input_names, pad_id)
            for side, tokenizer in tokenizers.items() for i in range(0, len(ordered), TEXT_BATCH)]


def _masked_max_diff(a: np.ndarray, b: np.ndarray, mask: np.ndarray | None) -> float:
    """The largest difference over the compared positions (padded ones carry no meaning), of the finite ones:
    a NaN or infinity is a failure of its own (:func:`_non_finite`), and validation.json keeps plain numbers."""
    diff = _masked(np.abs(a.astype(np.float64) - b.astype(np.float64)), mask)
    diff = diff[np.isfinite(diff)]
    return float(diff.max()) if diff.size else 0.0


def compare(session: Any, reference: Reference, precision: str, embedder: Embedder | SparseEmbedder | None,
            task: TaskSpec | None = None, backend: str = "onnxruntime",
            limits: dict[str, float] | None = None, trims_padding: bool = True,
            pooled: str | None = None, tokens: str | None = None, per_batch: bool = False,
            stop_early: bool = False) -> ValidationReport:
    """Run ``session`` on the reference inputs: names, then shapes and values, then
    fidelity against ``limits`` (default: :func:`thresholds`), every failure collected.

    Per-token outputs (``task.per_token``) of a graph that ``trims_padding`` must
    come back cut to the batch's longest real token (:func:`trimmed_length`), and
    are compared with PyTorch's over that length; other graphs answer at the
    padded width.

    ``pooled``: the name of the first output of a graph that ends in the pooling
    (:mod:`pooling`); that output is compared as it comes, ``[batch, hidden]`` (or
    ``[batch, vocab]``), with PyTorch's outputs pooled by ``embedder`` (the python
    pooling runs on the reference only, never on the graph's answer).  ``tokens``:
    the graph's second output, the token states it keeps beside the pooled one,
    compared with PyTorch's over the real tokens (a per-token output).

    ``per_batch``: the graph scales its activations per batch (dynamic
    quantization), so a text's answer depends on the texts served with it.  The
    texts then run a second time in batches that each span every length
    (:func:`mixed_batches`), and the fidelity figures cover both batchings: a
    text batched with longer, louder ones must keep the bar too.

    ``stop_early``: stop at the first text batch after which the graph has missed a bar for good (its least
    cosine below ``cosine_min``, a difference past ``max_abs_diff``, a cosine score difference past
    ``score_error``: :meth:`score_fidelity.Scoring.error_floor`): the verdict is the full run's, and the
    report's figures cover the texts run (``texts``).  An export's candidates stop early; ``nexus-sli
    validate`` runs every text.

    Where users score the outputs against each other (an embedder's ``scored``), a graph that ran every text
    is judged on those scores too (:mod:`score_fidelity`: every text against every other, once the batches
    are done, in each batching), against the bars of ``limits`` that apply to its outputs."""
    limits = limits or thresholds(task, precision)
    measures = Measures()
    if pooled is not None:
        reference = _pooled_reference(reference, embedder, pooled, tokens)
        per_token = {tokens, pooled if embedder.per_token else None, *getattr(embedder, "token_outputs", ())} - {None}
    else:
        per_token = set(reference.output_names) if task is not None and task.per_token else set()
    scoring = score_fidelity.scoring(embedder, task, reference.output_names, pooled is not None)
    limits = score_fidelity.applicable(limits, scoring)
    failures = _name_failures(session, reference)
    trimmed = per_token if trims_padding else set()
    stop_below = limits if stop_early else None
    scores: dict = {}
    for mixed in (False, True) if per_batch else (False,):
        if failures or measures.stopped_after is not None:
            break
        batches = mixed_batches(reference, per_token) if mixed else reference
        gathered = replace(scoring, got={}, expected={}, scales={}) if scoring is not None else None
        if gathered is not None and stop_below is not None and "score_error" in limits:
            # each text's scale from PyTorch's scores alone: the score bar's floor divides by it (exact, and sooner)
            texts = range(batches.first_text, len(batches.batches))
            gathered.know_scales(_cut(batches.batches[i], batches.outputs[i], batches.output_names, trimmed)
                                 for i in texts)
        failures = _run_batches(session, batches, embedder, task, backend, measures, trimmed, per_token,
                                pooled is not None, exact="max_abs_diff" in limits, stop_below=stop_below,
                                scoring=gathered)
        if gathered is not None and not failures and measures.stopped_after is None:
            found = gathered.figures(batches.order)
            scores = score_fidelity.worst(found, scores) if scores else found
    texts = measures.stopped_after or reference.texts
    report = ValidationReport.from_measures(precision, backend, limits, texts, measures, failures, scores)
    if not failures:
        report.failures.extend(_threshold_failures(report, measures.score_floor))
    return report


def mixed_batches(reference: Reference, per_token: set[str], size: int = TEXT_BATCH) -> Reference:
    """``reference``'s texts (already sorted by length) batched again so that every batch spans
    their lengths: batch ``k`` takes texts ``k``, ``k + n``, ``k + 2n`` ... of ``n`` batches.  Each
    text's inputs and PyTorch outputs are cut to its real tokens and padded to its new batch's
    longest (``per_token``: the outputs that follow the sequence), with the id the reference padded
    with; no PyTorch run is needed.  Where no text was padded that id is unknown, and the texts keep
    their batches."""
    texts = range(reference.first_text, len(reference.batches))
    pad_id = _pad_id([reference.batches[index] for index in texts])
    if pad_id is None:
        return Reference(reference.input_names, reference.output_names, [reference.batches[i] for i in texts],
                         [reference.outputs[i] for i in texts], text_batches=len(texts))
    rows = [row for index in texts
            for row in _rows(reference.batches[index], reference.outputs[index], reference.output_names, per_token)]
    count = -(-len(rows) // size)
    mixed = Reference(reference.input_names, reference.output_names)
    for start in range(count):
        feeds, outputs = _padded(rows[start::count], reference.input_names, reference.output_names, per_token, pad_id)
        mixed.add(feeds, outputs)
    mixed.text_batches = count
    mixed.order = [place for start in range(count) for place in range(start, len(rows), count)]
    return mixed


def _rows(feeds: dict[str, np.ndarray], outputs: list[np.ndarray], names: list[str],
          per_token: set[str]) -> list[tuple[dict[str, np.ndarray], list[np.ndarray]]]:
    """One batch as its texts: each row's inputs and outputs cut to its real tokens."""
    lengths = _held(feeds).sum(axis=1)
    return [({name: array[row, :n] for name, array in feeds.items()},
             [out[row, :n] if name in per_token else out[row] for name, out in zip(names, outputs)])
            for row, n in enumerate(lengths)]


def _pad_id(batches: list[dict[str, np.ndarray]]) -> int | None:
    """The id the reference padded its inputs with (the model's: RoBERTa's 1 counts positions from it);
    None where no text needed padding."""
    padded = np.concatenate([feeds["input_ids"][~_held(feeds)] for feeds in batches])
    return int(np.bincount(padded).argmax()) if padded.size else None


def _held(feeds: dict[str, np.ndarray]) -> np.ndarray:
    """The positions a row holds: attended, or scored where the graph has a scoring mask (a query's
    unattended expansion); padding is what follows them."""
    held = feeds["attention_mask"].astype(bool)
    return held | feeds[SCORE_MASK].astype(bool) if SCORE_MASK in feeds else held


def _padded(rows, input_names: list[str], output_names: list[str], per_token: set[str],
            pad_id: int) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
    """Rows right-padded to the longest as the served tokenizer pads a batch (ids with ``pad_id``)."""
    width = max(len(feeds["input_ids"]) for feeds, _ in rows)

    def pad(array: np.ndarray, value) -> np.ndarray:
        extra = [(0, width - array.shape[0])] + [(0, 0)] * (array.ndim - 1)
        return np.pad(array, extra, constant_values=value)

    feeds = {name: np.stack([pad(f[name], pad_id if name == "input_ids" else 0) for f, _ in rows])
             for name in input_names}
    outputs = [np.stack([pad(o[i], 0) if name in per_token else o[i] for _, o in rows])
               for i, name in enumerate(output_names)]
    return feeds, outputs


def _name_failures(session: Any, reference: Reference) -> list[Failure]:
    graph_inputs = [i.name for i in session.get_inputs()]
    graph_outputs = [o.name for o in session.get_outputs()]
    failures: list[Failure] = []
    if graph_inputs != reference.input_names:
        failures.append(NameMismatch(f"graph inputs {graph_inputs} != model inputs {reference.input_names}"))
    if graph_outputs != reference.output_names:
        failures.append(NameMismatch(f"graph outputs {graph_outputs} != expected {reference.output_names}"))
    return failures


def _pooled_reference(reference: Reference, embedder: Embedder | SparseEmbedder | None, output: str,
                      tokens: str | None = None) -> Reference:
    """``reference`` with PyTorch's outputs pooled as the served embedding (``embedder``), and with the
    token states themselves beside it as ``tokens`` where the graph keeps them."""
    if embedder is None:
        raise ValueError("a graph that pools needs the embedder that says how (pooling, normalisation)")
    if hasattr(embedder, "answer"):  # several outputs made from the token states (BGE-M3's heads)
        pooled = Reference(reference.input_names, list(embedder.outputs), text_batches=reference.text_batches)
        for feeds, outputs in zip(reference.batches, reference.outputs):
            pooled.add(feeds, embedder.answer(outputs[0], feeds))
        return pooled
    names = [output, tokens] if tokens else [output]
    pooled = Reference(reference.input_names, names, text_batches=reference.text_batches)
    for feeds, outputs in zip(reference.batches, reference.outputs):
        pooled.add(feeds, [embedder(outputs[0], feeds[embedder.reads]), *outputs[:1]][:len(names)])
    return pooled


def _run_batches(session: Any, reference: Reference, embedder, task: TaskSpec | None, backend: str,
                 measures: Measures, trimmed: set[str], per_token: set[str], pooled: bool = False,
                 exact: bool = False, stop_below: dict[str, float] | None = None,
                 scoring: score_fidelity.Scoring | None = None) -> list[Failure]:
    """Every reference batch through ``session``: shapes and values always, fidelity on
    the text batches while nothing has failed.  ``per_token``: the outputs that follow the
    sequence (compared over real tokens only); ``trimmed``: those the graph cuts to the
    batch's longest real token.  ``exact``: the parity bar (fp32) holds, under which an embedder that keeps
    terms (BGE-M3's token weights) must keep every term PyTorch keeps.  ``stop_below``: the bars; the run
    stops at the first text batch after which one is missed for good (:meth:`Measures.missed`).  ``scoring``
    gathers the text batches' scored outputs."""
    failures: list[Failure] = []
    names = reference.output_names
    for index, (feeds, expected) in enumerate(zip(reference.batches, reference.outputs)):
        try:
            got = session.run(None, feeds)
        except Exception as exc:  # runtimes report graph errors (baked shapes, bad indices) this way
            return [*failures, RuntimeFailure(f"{backend} failed on input shape {feeds['input_ids'].shape}: "
                                              f"{str(exc)[:300]}")]
        expected, feeds, mask, scored = _cut(feeds, expected, names, trimmed)
        # pooled vectors have no token axis to mask (a [batch, hidden] could match the mask's shape)
        masks = [scored if name in per_token else None for name in names]
        failures.extend(_compare_outputs(names, got, expected, masks, measures))
        if exact and not failures and hasattr(embedder, "lost_terms"):
            failures.extend(ValueMismatch(message) for message in embedder.lost_terms(got, expected))
        if index >= reference.first_text and not failures:
            _measure_fidelity(got, expected, mask, embedder, task, measures, pooled, scored)
            if scoring is not None:
                scoring.add(got, expected, feeds, mask, scored)
            if stop_below is not None and (measures.missed(stop_below) or _past_score_bar(scoring, stop_below,
                                                                                          measures)):
                measures.stopped_after = sum(len(b["input_ids"])
                                             for b in reference.batches[reference.first_text:index + 1])
                break
    return failures


def _cut(feeds: dict[str, np.ndarray], expected: list[np.ndarray], names: list[str], trimmed: set[str]
         ) -> tuple[list[np.ndarray], dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """A batch as the graph's outputs are compared: ``(expected, feeds, mask, scored)``, the outputs ``trimmed``
    names and the masks cut to the batch's longest real token where the graph cuts its padding.  Per-token
    outputs count where a token is scored (a late-interaction graph's scoring mask), else where attended."""
    mask, scored = feeds["attention_mask"], feeds.get(SCORE_MASK, feeds["attention_mask"])
    if trimmed:
        width = trimmed_length(mask, feeds.get(SCORE_MASK))
        mask, scored = mask[:, :width], scored[:, :width]
        expected = [e[:, :width] if name in trimmed else e for name, e in zip(names, expected)]
    return expected, feeds, mask, scored


#: how far past the score bar a floor must be to stop on it: the floor's scores come from smaller matrices than the
#: full run's, whose products may round differently in the last bits (float64: about 1e-16 of a score)
FLOOR_ROUNDING = 1e-9


def _past_score_bar(scoring: score_fidelity.Scoring | None, limits: dict[str, float], measures: Measures) -> bool:
    """Whether the texts so far put the score error past its bar for good (kept in ``measures``)."""
    if scoring is None or "score_error" not in limits:
        return False
    floor = scoring.error_floor()
    if floor is None or floor[0] <= limits["score_error"] + FLOOR_ROUNDING:
        return False
    measures.score_floor = floor
    return True


def _compare_outputs(names: list[str], got, expected, masks: list[np.ndarray | None],
                     measures: Measures) -> list[Failure]:
    failures: list[Failure] = []
    for name, g, e, mask in zip(names, got, expected, masks):
        if g.shape != e.shape:
            inputs = f"mask shape {mask.shape}" if mask is not None else "the batch's inputs"
            failures.append(ShapeMismatch(f"{name}: shape {g.shape} != {e.shape} for {inputs}"))
            continue
        failures.extend(_non_finite(name, g, e, mask))
        measures.max_abs_diff = max(measures.max_abs_diff, _masked_max_diff(g, e, mask))
    return failures


def _non_finite(name: str, got: np.ndarray, expected: np.ndarray, mask: np.ndarray | None) -> list[Failure]:
    """NaN or infinity where PyTorch's output is finite, at any position: a NaN is no number any bar can compare
    (every comparison with it is false), and one on a padded position still reaches users (the python pooling
    multiplies padding by zero, and NaN times zero is NaN).  Also PyTorch's own non-finite values where they are
    compared: a reference that holds none to compare with validates nothing."""
    failures: list[Failure] = []
    graph = ~np.isfinite(got) & np.isfinite(expected)
    if graph.any():
        real = _masked(graph, mask)
        where = "" if real is graph else f", {int(real.sum())} of them compared" if real.any() else ", all on padding"
        failures.append(ValueMismatch(f"{name}: {int(graph.sum())} NaN or infinite values where PyTorch's are "
                                      f"finite{where}"))
    reference = _masked(~np.isfinite(expected), mask)
    if reference.any():
        failures.append(ValueMismatch(f"{name}: PyTorch's own output has {int(reference.sum())} NaN or infinite "
                                      "values where it is compared"))
    return failures


def _masked(values: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """``values`` at the positions a per-token output is compared on (``mask``), else all of them."""
    if mask is not None and values.ndim >= 2 and values.shape[:2] == mask.shape:
        return values[mask.astype(bool)]
    return values


def _measure_fidelity(got, expected, mask: np.ndarray, embedder: Embedder | None, task: TaskSpec | None,
                      measures: Measures, pooled: bool = False, scored: np.ndarray | None = None) -> None:
    """Cosines of the embeddings (pooled here by ``embedder``, or compared as they came from a graph
    that pools; a late-interaction graph's per scored token), and argmax agreement for tasks that decide."""
    if pooled:
        a, b = l2_normalize(got[0].astype(np.float64)), l2_normalize(expected[0].astype(np.float64))
        cosines = np.sum(a * b, axis=-1)
        if cosines.ndim == 2:  # [batch, sequence]: one vector per token, judged where it is scored
            cosines = cosines[scored.astype(bool)]
        measures.cosines.extend(cosines.tolist())
        if hasattr(embedder, "cosines"):  # the outputs beside the first (BGE-M3's weights and ColBERT vectors)
            measures.cosines.extend(embedder.cosines(got, expected, scored))
    elif embedder is not None:
        a, b = l2_normalize(embedder(got[0], mask)), l2_normalize(embedder(expected[0], mask))
        measures.cosines.extend(np.sum(a * b, axis=-1).tolist())
    if task is not None and task.agreement:
        measures.count(*agreement(task.agreement, got, expected, mask))


def _threshold_failures(report: ValidationReport, score_floor: tuple[float, str] | None = None) -> list[Failure]:
    """Every bar of the report's thresholds its figures miss; the score bars last, as what users compute from the
    outputs.  A score figure that is None had nothing to judge (every pair a tie: the texts score alike; no term
    over the floor), or validation stopped at a bar (``score_floor``: at the score error's, with the floor the
    texts run put under it); only a missing score error with no other failure counts."""
    failures: list[Failure] = []
    metrics = sorted(report.thresholds, key=lambda metric: metric in SCORE_METRICS)
    for metric in metrics:
        value, limit = getattr(report, metric), report.thresholds[metric]
        kind = {"max_abs_diff": ValueMismatch, "agreement": AgreementShortfall}.get(metric, FidelityShortfall)
        if metric in SCORE_METRICS:
            if value is None and metric == "score_error" and score_floor is not None:
                failures.append(ScoreShortfall(f"score_error {score_floor[0]:.6g} or more > {limit:g} "
                                               f"({score_floor[1]}, {COSINE})"))
            elif value is None and metric == "score_error" and not failures:
                failures.append(ScoreShortfall("score_error could not be measured"))
            if value is None:
                continue
            kind = ScoreShortfall
        if value is None and metric == "agreement" and report.ties:
            failures.append(kind(f"agreement could not be measured: all {report.ties} decisions were ties "
                                 f"(PyTorch's own scores within {TIE_MARGIN:g})"))
        elif value is None:
            failures.append(kind(f"{metric} could not be measured"))
        # negated, so that a NaN figure (every comparison with it false) misses its bar
        elif metric in UPPER_BARS and not value <= limit:
            failures.append(kind(f"{metric} {value:.3g} > {limit:g}{_worst_output(report, metric)}"))
        elif metric not in UPPER_BARS and not value >= limit:
            failures.append(kind(f"{metric} {value:.5f} < {limit:g}{_worst_output(report, metric)}"))
    return failures


def _worst_output(report: ValidationReport, metric: str) -> str:
    """`` (OUTPUT, similarity)``: the scored output whose figure the report's ``metric`` is (empty for others)."""
    value = getattr(report, metric)
    for name, figures in report.scores.items() if metric in SCORE_METRICS else ():
        if getattr(figures, metric) == value:
            return f" ({name}, {figures.similarity})"
    return ""
