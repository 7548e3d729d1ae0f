"""The validation report's decisions: what counts as agreeing with PyTorch."""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np

from nexus_sli.tasks import get_task
from nexus_sli.exporter.export import score_fidelity
from nexus_sli.exporter.export.report import (
    AgreementShortfall,
    FidelityShortfall,
    NameMismatch,
    RuntimeFailure,
    ScoreShortfall,
    ShapeMismatch,
    ValidationReport,
    ValueMismatch,
)
from nexus_sli.exporter.export.validate import (TIE_MARGIN, Embedder, Reference, compare, mixed_batches, thresholds,
                                               with_auto_bar)


class FixedSession:
    """A stand-in runtime that returns fixed outputs, so a test chooses the disagreement."""

    def __init__(self, outputs: list[np.ndarray]):
        self.outputs = outputs

    def get_inputs(self):
        return [SimpleNamespace(name="input_ids"), SimpleNamespace(name="attention_mask")]

    def get_outputs(self):
        return [SimpleNamespace(name="logits")]

    def run(self, _names, _feeds):
        return self.outputs


def rerank_report(expected_scores: list[float], got_scores: list[float], precision: str = "int8") -> ValidationReport:
    rows = len(expected_scores)
    feeds = {"input_ids": np.ones((rows, 4), np.int64), "attention_mask": np.ones((rows, 4), np.int64)}
    reference = Reference(["input_ids", "attention_mask"], ["logits"], [feeds],
                          [[np.array(expected_scores, np.float32)[:, None]]], text_batches=1)
    session = FixedSession([np.array(got_scores, np.float32)[:, None]])
    return compare(session, reference, precision, None, get_task("rerank"))


def test_rows_swapped_past_the_tie_margin_are_a_disagreement():
    report = rerank_report([0.0, 1.0, 2.0], [1.5, 1.0, 2.0])
    # the pair (0, 1) flips (1.5 > 1.0 where PyTorch had 0.0 < 1.0); (0, 2) and (1, 2) hold
    assert report.decisions == 3 and report.ties == 0
    assert report.agreement == 2 / 3
    assert not report.passed and [type(f) for f in report.failures] == [AgreementShortfall]


def test_rows_closer_than_the_tie_margin_are_ties_not_decisions():
    close = TIE_MARGIN / 10
    report = rerank_report([0.0, close, 2.0], [close, 0.0, 2.0])
    assert report.ties == 1 and report.decisions == 2
    assert report.agreement == 1.0
    assert report.passed


def test_fp32_parity_still_bounds_the_scores_of_tied_rows():
    close = TIE_MARGIN / 10
    report = rerank_report([0.0, close, 2.0], [0.01, 0.0, 2.0], precision="fp32")
    assert report.ties == 1 and report.agreement == 1.0
    assert not report.passed and [type(f) for f in report.failures] == [ValueMismatch]


def report_for(task: str, expected: np.ndarray, got: np.ndarray, mask: np.ndarray, output: str = "logits") -> ValidationReport:
    feeds = {"input_ids": np.ones(mask.shape, np.int64), "attention_mask": mask.astype(np.int64)}
    reference = Reference(["input_ids", "attention_mask"], [output], [feeds], [[expected.astype(np.float32)]],
                          text_batches=1)
    session = FixedSession([got.astype(np.float32)])
    session.get_outputs = lambda: [SimpleNamespace(name=output)]
    return compare(session, reference, "int8", None, get_task(task))


def test_labels_per_text_count_ties_apart():
    close = TIE_MARGIN / 10
    expected = np.array([[0.0, 1.0], [0.5, 0.5 + close], [2.0, 0.0]])
    got = np.array([[0.0, 1.0], [0.5 + close, 0.5], [0.0, 2.0]])  # row 1 is a tie; row 2 really flips
    report = report_for("classification", expected, got, np.ones((3, 4)))
    assert (report.decisions, report.ties, report.agreement) == (2, 1, 0.5)


def test_labels_per_token_count_only_real_tokens():
    expected = np.array([[[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]], [[0.0, 1.0], [1.0, 0.0], [1.0, 0.0]]])
    got = np.array([[[0.0, 1.0], [0.0, 1.0], [0.0, 1.0]], [[0.0, 1.0], [0.0, 1.0], [0.0, 1.0]]])
    # row 0: token 1 flips; row 1 has one real token, its two padding positions flip but do not count
    report = report_for("token-classification", expected, got, np.array([[1, 1, 1], [1, 0, 0]]))
    assert (report.decisions, report.ties, report.agreement) == (4, 0, 0.75)


def test_span_positions_ignore_padding_and_all_ties_fail_clearly():
    close = TIE_MARGIN / 10
    expected = np.array([[0.0, 3.0, 2.0], [1.0, 1.0 + close, 9.0]])
    got = np.array([[0.0, 3.0, 2.0], [1.0 + close, 1.0, -9.0]])  # row 1: position 2 is padding
    mask = np.array([[1, 1, 1], [1, 1, 0]])
    report = report_for("question-answering", expected, got, mask, "start_logits")
    assert (report.decisions, report.ties, report.agreement) == (1, 1, 1.0)
    tied = report_for("question-answering", expected[1:, :2], got[1:, :2], mask[1:, :2], "start_logits")
    assert tied.agreement is None and not tied.passed
    assert isinstance(tied.failures[0], AgreementShortfall)
    assert "all 1 decisions were ties" in tied.failures[0].message


def embedding_report(got: np.ndarray, expected: np.ndarray, precision: str = "int8", session=None) -> ValidationReport:
    mask = np.ones(expected.shape[:2], np.int64)
    feeds = {"input_ids": np.ones(mask.shape, np.int64), "attention_mask": mask}
    reference = Reference(["input_ids", "attention_mask"], ["last_hidden_state"], [feeds],
                          [[expected.astype(np.float32)]], text_batches=1)
    session = session or FixedSession([got.astype(np.float32)])
    session.get_outputs = lambda: [SimpleNamespace(name="last_hidden_state")]
    return compare(session, reference, precision, Embedder("mean", True), get_task("embedding"))


def test_each_check_reports_its_own_failure_type():
    hidden = np.random.default_rng(0).normal(size=(2, 3, 4))
    assert embedding_report(hidden, hidden, "fp32").passed
    assert [type(f) for f in embedding_report(hidden + 1e-2, hidden, "fp32").failures] == [ValueMismatch]
    # a sign flip of every vector: cosine -1, far below the int8 limits
    assert {type(f) for f in embedding_report(-hidden, hidden).failures} == {FidelityShortfall}
    assert [type(f) for f in embedding_report(hidden[:, :2], hidden).failures] == [ShapeMismatch]


def test_names_are_checked_before_any_run_and_runtime_errors_are_typed():
    hidden = np.zeros((1, 2, 4))

    class Refusing(FixedSession):
        def run(self, _names, _feeds):
            raise RuntimeError("baked shape")

    refused = embedding_report(hidden, hidden, session=Refusing([]))
    assert [type(f) for f in refused.failures] == [RuntimeFailure] and "baked shape" in refused.failures[0].message
    renamed = FixedSession([hidden])
    renamed.get_inputs = lambda: [SimpleNamespace(name="ids")]
    report = embedding_report(hidden, hidden, session=renamed)
    assert [type(f) for f in report.failures] == [NameMismatch]
    assert report.to_dict()["failures"] == [{"kind": "names", "message": report.failures[0].message}]


# --- graphs that quantize per batch: a second batching, every batch spanning the lengths ------------

def _sorted_reference(lengths: list[int], size: int, pad_id: int = 0) -> Reference:
    """Texts of ``lengths`` (ascending) in batches of ``size``, as validation batches them: each batch
    padded to its longest, PyTorch's token states standing in as ``position + 10 * text``."""
    reference = Reference(["input_ids", "attention_mask"], ["last_hidden_state"])
    for start in range(0, len(lengths), size):
        chunk = lengths[start:start + size]
        width = max(chunk)
        mask = np.array([[1] * n + [0] * (width - n) for n in chunk], np.int64)
        ids = np.where(mask == 1, 7, pad_id)
        states = np.stack([np.arange(width)[:, None] + 10.0 * (start + row) + np.zeros((width, 2))
                           for row in range(len(chunk))])
        reference.add({"input_ids": ids, "attention_mask": mask}, [states])
    reference.text_batches = len(reference.batches)
    return reference


def test_mixed_batches_span_the_lengths_and_keep_each_texts_own_answer():
    mixed = mixed_batches(_sorted_reference([1, 2, 3, 4, 5, 6], size=2, pad_id=3), {"last_hidden_state"}, size=2)
    masks = [b["attention_mask"].sum(axis=1).tolist() for b in mixed.batches]
    assert masks == [[1, 4], [2, 5], [3, 6]] and mixed.text_batches == 3 and mixed.first_text == 0
    first = mixed.batches[0]
    assert first["input_ids"].tolist() == [[7, 3, 3, 3], [7, 7, 7, 7]]  # padded with the reference's pad id
    # text 3 (length 4) keeps its own states; text 0's are cut to its one token and padded with zeros
    states = mixed.outputs[0][0]
    assert states.shape == (2, 4, 2) and states[1, :, 0].tolist() == [30.0, 31.0, 32.0, 33.0]
    assert states[0, :, 0].tolist() == [0.0, 0.0, 0.0, 0.0]


def _states(mask: np.ndarray) -> np.ndarray:
    """Every text's token states alike: position + 1, so only a flipped row can disagree."""
    return np.broadcast_to(np.arange(1.0, mask.shape[1] + 1)[None, :, None], (*mask.shape, 2)).copy()


class LoudNeighbours(FixedSession):
    """A graph whose answer for a text suffers when a much longer one shares its batch (as dynamic int8's
    per-batch activation scale makes it): in a batch of mixed lengths, every row but the longest flips."""

    def get_outputs(self):
        return [SimpleNamespace(name="last_hidden_state")]

    def run(self, _names, feeds):
        mask = feeds["attention_mask"]
        lengths, states = mask.sum(axis=1), _states(mask)
        if lengths.max() - lengths.min() > 2:
            states[lengths < lengths.max()] *= -1
        return [states]


def test_a_graph_that_scales_per_batch_is_held_to_the_bar_in_mixed_batches_too():
    reference = _sorted_reference([1, 2, 2, 3, 6, 7, 7, 8], size=2)
    reference.outputs = [[_states(feeds["attention_mask"])] for feeds in reference.batches]
    embedding, embedder = get_task("embedding"), Embedder("mean", True)
    alone = compare(LoudNeighbours([]), reference, "int8", embedder, embedding)  # sorted batches: no mix
    assert alone.passed and alone.texts == 8
    together = compare(LoudNeighbours([]), reference, "int8", embedder, embedding, per_batch=True)
    assert {type(f) for f in together.failures} == {FidelityShortfall} and together.texts == 8
    assert together.cosine_min < -0.99 < 0.99 < alone.cosine_min  # the flipped rows, measured in the mix


def test_where_no_text_was_padded_the_texts_keep_their_batches():
    reference = _sorted_reference([2, 2, 5, 5], size=2)  # no padding: the pad id is unknown
    mixed = mixed_batches(reference, {"last_hidden_state"}, size=2)
    assert [b["attention_mask"].sum(axis=1).tolist() for b in mixed.batches] == [[2, 2], [5, 5]]


# --- stopping at the first text batch after which a bar is missed for good ---------------------------------

class Drifting(FixedSession):
    """A graph whose answers are PyTorch's plus noise of ``scale``, from text batch ``start`` on (seeded)."""

    def __init__(self, reference: Reference, start: int, scale: float):
        super().__init__([])
        self.by_ids = {feeds["input_ids"].tobytes(): (n, out[0]) for n, (feeds, out) in
                       enumerate(zip(reference.batches, reference.outputs))}
        self.start, self.scale = start, scale

    def get_outputs(self):
        return [SimpleNamespace(name="last_hidden_state")]

    def run(self, _names, feeds):
        number, states = self.by_ids[feeds["input_ids"].tobytes()]
        if number < self.start:
            return [states]
        noise = np.random.default_rng(number).normal(size=states.shape).astype(np.float32)
        return [states + self.scale * noise * np.abs(states).mean()]


def _seeded_reference(batches: int = 6, rows: int = 4, width: int = 5) -> Reference:
    rng = np.random.default_rng(7)
    reference = Reference(["input_ids", "attention_mask"], ["last_hidden_state"])
    for n in range(batches):
        ids = rng.integers(5, 1000, size=(rows, width)).astype(np.int64)
        reference.add({"input_ids": ids, "attention_mask": np.ones_like(ids)},
                      [rng.normal(size=(rows, width, 8)).astype(np.float32)])
    reference.text_batches = batches
    return reference


def test_stopping_early_gives_the_full_runs_verdict_and_runs_fewer_texts_only_where_a_bar_is_missed():
    reference, embedding, embedder = _seeded_reference(), get_task("embedding"), Embedder("mean", True)
    cases = {"faithful": Drifting(reference, 0, 0.0), "breaks at batch 2": Drifting(reference, 2, 3.0),
             "slightly off everywhere": Drifting(reference, 0, 0.22)}
    for name, session in cases.items():
        full = compare(session, reference, "int8", embedder, embedding)
        early = compare(session, reference, "int8", embedder, embedding, stop_early=True)
        assert early.passed == full.passed, name
        missed_min = full.cosine_min is not None and full.cosine_min < full.thresholds["cosine_min"]
        assert (early.texts < full.texts) == missed_min, name  # stops only where the least cosine says so
        if not missed_min:
            assert early.to_dict() == full.to_dict(), name
    broken = compare(cases["breaks at batch 2"], reference, "int8", embedder, embedding, stop_early=True)
    assert not broken.passed and broken.texts == 3 * 4 and {type(f) for f in broken.failures} == {FidelityShortfall}
    # the cases cover each verdict: one passes, one misses the least cosine, one only the mean
    off = compare(cases["slightly off everywhere"], reference, "int8", embedder, embedding)
    assert compare(cases["faithful"], reference, "int8", embedder, embedding).passed
    assert not off.passed and off.cosine_min >= off.thresholds["cosine_min"], (off.cosine_min, off.cosine_mean)


class Shifted(Drifting):
    """A graph whose answers are PyTorch's moved by ``shift`` along one fixed direction, from text batch ``start``
    on: each text keeps its own direction well (its cosine) while its scores against the others move."""

    def __init__(self, reference: Reference, start: int, shift: float):
        super().__init__(reference, start, 0.0)
        self.shift = shift

    def run(self, _names, feeds):
        number, states = self.by_ids[feeds["input_ids"].tobytes()]
        if number < self.start:
            return [states]
        direction = np.random.default_rng(0).normal(size=states.shape[-1]).astype(np.float32)
        return [states + self.shift * direction / np.linalg.norm(direction)]


def test_stopping_on_the_score_error_gives_the_full_runs_verdict():
    """A cosine-scored output stops once the texts so far put the score error past its bar for good (each text's
    differences so far over its scale already bound its error): the verdict is the full run's."""
    reference, embedding, embedder = _seeded_reference(), get_task("embedding"), Embedder("mean", True)
    limits = with_auto_bar(thresholds(embedding, "int8"), embedding)
    for start, shift in [(0, 0.0), (0, 0.05), (2, 0.05), (2, 0.1), (0, 0.2)]:
        session = Shifted(reference, start, shift)
        full = compare(session, reference, "int8", embedder, embedding, limits=limits)
        early = compare(session, reference, "int8", embedder, embedding, limits=limits, stop_early=True)
        assert early.passed == full.passed, (start, shift)
        if full.passed:
            assert early.to_dict() == full.to_dict()
            continue
        assert full.score_error > limits["score_error"] and full.cosine_min >= limits["cosine_min"] or shift == 0.2
        # stopped at the first shifted batch, saying what those texts put under the score error
        assert early.texts == (start + 1) * 4 < full.texts
        (score,) = [f for f in early.failures if isinstance(f, ScoreShortfall)]
        assert "or more > 0.02 (EMBEDDING, cosine)" in str(score)


def test_the_score_floor_divides_by_each_texts_scale_known_from_pytorch(monkeypatch):
    """Each text's scale (its largest reference score against all the other texts) comes from PyTorch's scores
    before the graph runs, so the floor is the text's differences so far over its own scale, not over 1: a graph
    whose errors pass the bar stops at its first shifted batch, where the floor over 1 ran on."""
    reference, embedding, embedder = _seeded_reference(), get_task("embedding"), Embedder("mean", True)
    limits = with_auto_bar(thresholds(embedding, "int8"), embedding)
    stopped = {}
    for shift in (0.02, 0.03):
        session = Shifted(reference, 2, shift)
        full = compare(session, reference, "int8", embedder, embedding, limits=limits)
        early = compare(session, reference, "int8", embedder, embedding, limits=limits, stop_early=True)
        assert not full.passed and not early.passed and full.cosine_min >= limits["cosine_min"]
        assert early.texts == 3 * 4 < full.texts  # the first shifted batch
        (score,) = [f for f in early.failures if isinstance(f, ScoreShortfall)]
        floor = float(re.search(r"score_error (\S+) or more", str(score)).group(1))
        assert limits["score_error"] < floor <= full.score_error  # a floor of the full run's error
        stopped[shift] = early.texts
    monkeypatch.setattr(score_fidelity.Scoring, "know_scales", lambda self, batches: None)
    for shift, texts in stopped.items():
        unscaled = compare(Shifted(reference, 2, shift), reference, "int8", embedder, embedding, limits=limits,
                           stop_early=True)
        assert not unscaled.passed and unscaled.texts > texts


def test_a_figure_that_is_nan_misses_its_bar():
    """Finite outputs so large that the python pooling's float32 sum overflows give a NaN cosine; NaN compares
    false with every bar, so the bars are read as "not within": NaN fails."""
    hidden = np.random.default_rng(0).normal(size=(4, 3, 8))
    loud = hidden.copy()
    loud[1, :, 0] = 3e38  # finite in float32; three of them sum past its range
    report = embedding_report(loud, hidden, "int8")
    assert np.isnan(report.cosine_mean)
    assert not report.passed and {type(f) for f in report.failures} == {FidelityShortfall}
