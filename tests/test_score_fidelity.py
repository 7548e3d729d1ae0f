"""Score and ranking fidelity in the validation gate: a candidate is judged on the scores users compute.

The figures (:mod:`score_fidelity`) against the client's own scorers (``late_interaction.lexical_score``,
``maxsim``) on a few hand-made texts; then on the seeded tiny BGE-M3 (:mod:`helpers.m3_models`), a candidate
whose sparse head carries seeded noise keeps the cosine bars ``auto`` holds an int8 candidate to (the issue's
int8 export kept them too), yet is refused by the score bars, while the same graph without the noise passes
them.  No server: the graphs run in ONNX Runtime.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnxruntime as ort
import pytest

from helpers.m3_models import build_m3
from nexus_sli.client import late_interaction
from nexus_sli.exporter.export import pipeline, score_fidelity
from nexus_sli.exporter.export.report import ScoreShortfall, ValidationReport
from nexus_sli.exporter.export.score_fidelity import COSINE, LEXICAL, ScoredOutput, Scoring
from nexus_sli.exporter.export.source import resolve_model
from nexus_sli.exporter.export.validate import AUTO_BAR, SCORE_BAR, compare, thresholds, with_auto_bar
from nexus_sli.tasks import get_task
from nexus_sli.tasks.agreement import ranked_pairs


def test_a_ranking_counts_the_pairs_that_decide_the_top_results_with_ties_inside_the_margin():
    expected = np.array([[0.9, 0.5, 0.5 + 1e-6, 0.1]])
    got = np.array([[0.9, 0.52, 0.49, 0.6]])  # the last result jumps over the two tied ones
    # the top two (0.9, then 0.500001), each against every result ranked below it: the tie is no decision
    assert ranked_pairs(got, expected, np.array([0.9]), top=2) == (3, 4, 1)
    assert ranked_pairs(expected, expected, np.array([0.9]), top=4) == (5, 5, 1)


def _lexical_texts(weights: list[dict[int, float]]) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(np.array(sorted(w), np.int64), np.array([w[k] for k in sorted(w)], np.float32)) for w in weights]


def test_lexical_figures_are_the_clients_scores_each_text_against_the_others():
    expected = [{3: 0.5, 7: 0.2}, {3: 0.4, 9: 0.1}, {7: 0.3, 9: 0.6, 11: 0.05}]
    got = [{3: 0.5, 7: 0.2}, {3: 0.4, 9: 0.1}, {7: 0.3, 9: 0.5}]  # one weight lower, one small term dropped
    scoring = Scoring([ScoredOutput("SPARSE_WEIGHTS", 0, LEXICAL)], sided=False)
    scoring.got["SPARSE_WEIGHTS"], scoring.expected["SPARSE_WEIGHTS"] = _lexical_texts(got), _lexical_texts(expected)
    figures = scoring.figures()["SPARSE_WEIGHTS"]
    ours, theirs = late_interaction.lexical_score(got, got), late_interaction.lexical_score(expected, expected)
    others = ~np.eye(3, dtype=bool)
    errors = (np.abs(ours - theirs) * others).max(axis=1) / (np.abs(theirs) * others).max(axis=1)
    assert figures.score_error == pytest.approx(errors.max(), rel=1e-5)
    assert figures.score_error_mean == pytest.approx(errors.mean(), rel=1e-5)
    # 0.05 is over the floor (1% of the text's 0.6): one of the seven terms dropped
    assert (figures.terms, figures.terms_kept) == (7, pytest.approx(6 / 7))
    assert figures.dropped_max == pytest.approx(0.05 / 0.6, rel=1e-5)


def test_multi_vector_figures_score_queries_against_the_other_texts_documents():
    rng = np.random.default_rng(3)
    vectors = [rng.normal(size=(n, 4)).astype(np.float32) for n in (3, 5, 2, 4, 3, 6)]  # 3 queries, then 3 documents
    scoring = Scoring([ScoredOutput("MULTI_VECTOR", 0, "meanmaxsim")], sided=True)
    scoring.expected["MULTI_VECTOR"] = vectors
    scoring.got["MULTI_VECTOR"] = [v * np.float32(1.01) for v in vectors[:3]] + vectors[3:]  # every score 1% higher
    figures = scoring.figures()["MULTI_VECTOR"]
    assert figures.score_error == pytest.approx(0.01, rel=1e-3) and figures.rank_agreement == 1.0
    assert figures.terms is None and figures.similarity == "meanmaxsim"
    assert figures.ranked + figures.ties == 3  # each query ranks the two other texts' documents: one pair each


def test_mixed_batches_are_scored_in_the_texts_own_order():
    rng = np.random.default_rng(4)
    vectors = list(rng.normal(size=(6, 8)))
    scoring = Scoring([ScoredOutput("EMBEDDING", 0, COSINE)], sided=False)
    order = [0, 3, 1, 4, 2, 5]  # text 0, then text 3, ...: as mixed_batches interleaves two batches of three
    scoring.expected["EMBEDDING"] = [vectors[i] for i in order]
    scoring.got["EMBEDDING"] = [vectors[i] + (0.05 if i == 0 else 0.0) for i in order]
    in_order = Scoring(scoring.outputs, False, got={"EMBEDDING": [vectors[0] + 0.05, *vectors[1:]]},
                       expected={"EMBEDDING": vectors})
    assert scoring.figures(order) == in_order.figures()


def test_the_scores_are_written_per_output_and_read_back():
    report = ValidationReport("bf16", "openvino", {"score_error": 0.02}, 240, 0.0, 0.999, 0.9999, None, 0, 0)
    scoring = Scoring([ScoredOutput("EMBEDDING", 0, COSINE)], sided=False,
                      got={"EMBEDDING": list(np.eye(3) + 0.1)}, expected={"EMBEDDING": list(np.eye(3) + 0.1)})
    report = replace(report, scores=scoring.figures(), score_error=0.0, rank_agreement=None)
    data = report.to_dict()
    assert data["scores"]["EMBEDDING"]["similarity"] == "cosine" and "terms_kept" not in data
    assert ValidationReport.from_dict(data) == report


def test_auto_tightens_the_score_bar_and_only_bars_that_apply_are_held():
    task = get_task("embedding")
    assert with_auto_bar({"score_error": 0.05}, task)["score_error"] == SCORE_BAR["score_error"]  # a most: the lower
    assert with_auto_bar({"score_error": 0.001}, task)["score_error"] == 0.001
    assert with_auto_bar({}, get_task("token-classification")) == {"agreement": 0.99}  # labels: no scores
    dense = Scoring([ScoredOutput("EMBEDDING", 0, COSINE)], sided=False)
    assert score_fidelity.applicable(dict(SCORE_BAR), dense) == {
        "score_error": SCORE_BAR["score_error"], "rank_agreement": SCORE_BAR["rank_agreement"]}
    assert score_fidelity.applicable(dict(SCORE_BAR), None) == {}


#: the noise on the sparse head's weights, relative to their spread: every cosine keeps ``auto``'s bar (least
#: cosine 0.997), while lexical scores move up to 12% of a text's best and a few terms over the floor are lost
SPARSE_NOISE = 0.1


@pytest.fixture(scope="module")
def m3(tmp_path_factory, tiny_tokenizer):
    """The seeded tiny BGE-M3, prepared as an export prepares it: its plain graph, PyTorch's reference, its heads."""
    folder = build_m3(tmp_path_factory.mktemp("bge-m3"), tiny_tokenizer)
    options = pipeline.ExportOptions(model=str(folder), allow_pickle=True, cache=False)
    return pipeline.prepare(options, resolve_model(str(folder), True), tmp_path_factory.mktemp("work"))


def _validate(prepared, head, path):
    """The plain graph ended in ``head``, validated as ``auto`` validates an int8 candidate."""
    graph = prepared.graph
    head.append(graph.plain, path)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    limits = with_auto_bar(thresholds(prepared.task, "int8"), prepared.task)
    return compare(session, prepared.reference, "int8", prepared.embedder, prepared.task, "onnxruntime", limits,
                   trims_padding=False, pooled=head.outputs[0])


def test_a_candidate_within_the_cosine_bars_but_off_on_scores_is_refused(m3, tmp_path):
    head = m3.graph.pooling
    faithful = _validate(m3, head, tmp_path / "faithful.onnx")
    assert faithful.passed, faithful.summary()
    assert set(faithful.scores) == {"EMBEDDING", "SPARSE_WEIGHTS", "MULTI_VECTOR"}
    rng = np.random.default_rng(0)
    weight = head.heads.sparse_weight
    noisy_heads = replace(head.heads, sparse_weight=(weight + SPARSE_NOISE * weight.std() *
                                                     rng.standard_normal(weight.shape)).astype(np.float32))
    noisy = _validate(m3, replace(head, heads=noisy_heads), tmp_path / "noisy.onnx")
    assert noisy.cosine_min >= AUTO_BAR["cosine_min"] and noisy.cosine_mean >= AUTO_BAR["cosine_mean"]
    assert noisy.failures and all(isinstance(f, ScoreShortfall) for f in noisy.failures), noisy.summary()
    assert {str(f).split()[1] for f in noisy.failures} == set(score_fidelity.SCORE_METRICS)  # each bar missed
    assert all("(SPARSE_WEIGHTS, lexical)" in str(f) for f in noisy.failures)
    sparse = noisy.scores["SPARSE_WEIGHTS"]
    assert sparse.score_error > SCORE_BAR["score_error"] and sparse.dropped_max >= score_fidelity.TERM_FLOOR
    assert noisy.scores["EMBEDDING"] == faithful.scores["EMBEDDING"]  # the dense head is untouched
