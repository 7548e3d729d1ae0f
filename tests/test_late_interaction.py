"""Late interaction (ColBERT): the client's scores against sentence-transformers', the served vectors' parse,
the requests the client sends, and the gateway's ``/embed_multi_vector`` and ``/rerank`` on a multi-vector model.

Without a server, the routes answer through the client's real calls from synthetic arrays laid out as the
multi-vector ensemble answers them (``MULTI_VECTOR`` zero off the scoring mask, ``SCORE_MASK`` wider, a hole
at the first token).  Served: a seeded tiny ColBERT (``helpers/colbert_models.py``) exported in fp32 and
served by one Triton server, its vectors, scores and ranking through the client (gRPC) and the gateway
against ``MultiVectorEncoder``'s: the same vector counts, per-token cosine >= 0.9999, unit norms, scores
within 1e-4 relative.
"""

from __future__ import annotations

import asyncio
import json
import string
import zlib

import numpy as np
import pytest
import torch
from sentence_transformers import MultiVectorEncoder
from sentence_transformers.util import similarity as st
from starlette.testclient import TestClient

from helpers.colbert_models import colbert_folder
from helpers.fake_triton import ConfigTriton
from helpers.http_api import schema_problems, tei_schema
from helpers.rounding import EPS32, assert_within, maxsim_atol
from helpers.servers import serving
from nexus_sli.client import EncoderClient, InvalidInputError, WrongTaskError
from nexus_sli.client import calls, late_interaction
from nexus_sli.client.error_codes import INPUT_TYPE_PARAMETER, PROMPT_PARAMETER
from nexus_sli.client.errors import UnknownInputTypeError
from nexus_sli.client.model_info import ModelInfo
from nexus_sli.exporter.export.pipeline import ExportOptions, run_export
from nexus_sli.gateway import GatewayConfig, create_app
from nexus_sli.gateway.discovery import Catalog
from nexus_sli.gateway.errors import GatewayError
from nexus_sli.gateway.tei_info import EXTENSIONS
from nexus_sli.tasks.results import Ranked, SparseEmbedding

DIM = 8


def _ragged(rng, lengths: list[int]) -> list[np.ndarray]:
    return [rng.standard_normal((n, DIM)).astype(np.float32) for n in lengths]


def _theirs(queries, documents, mean: bool) -> np.ndarray:
    torched = ([torch.from_numpy(v) for v in side] for side in (queries, documents))
    return (st.mean_maxsim if mean else st.maxsim)(*torched).numpy()


@pytest.mark.parametrize("mean", [False, True])
def test_maxsim_is_sentence_transformers_on_ragged_texts_empty_ones_included(mean):
    rng = np.random.default_rng(7)
    queries, documents = _ragged(rng, [3, 0, 32, 1, 9]), _ragged(rng, [4, 0, 2, 70, 1, 0, 180])
    ours = late_interaction.maxsim(queries, documents, mean=mean)
    assert ours.dtype == np.float32 and ours.shape == (5, 7)
    # numpy's and PyTorch's kernels add in their own orders: float32 rounding of the terms, not of the score
    rounding = maxsim_atol(queries, documents, mean)
    assert_within(ours, _theirs(queries, documents, mean), rounding, rtol=EPS32 if mean else 0.0)
    assert (ours[:, [1, 5]] <= late_interaction.EMPTY_DOCUMENT_SCORE / 32).all()  # below every real score
    # one array is one text (a product of another shape: another kernel), and nothing to score is an empty matrix
    assert_within(late_interaction.maxsim(queries[0], documents, mean=mean), ours[:1], rounding[:1])
    assert late_interaction.maxsim([], documents).shape == (0, 7) and late_interaction.maxsim(queries, []).shape == (5, 0)


def test_maxsim_in_pieces_is_maxsim_at_once(monkeypatch):
    rng = np.random.default_rng(3)
    queries, documents = _ragged(rng, [5, 2, 0, 7]), _ragged(rng, [3, 0, 9, 1, 4, 6])
    half = [h.astype(np.float16) for h in documents]  # any float dtype: computed in float32
    whole = late_interaction.maxsim(queries, half)
    monkeypatch.setattr(late_interaction, "CHUNK_ELEMENTS", 20)  # a few vectors per piece, one text at least
    # products of other shapes add in other orders (another BLAS kernel, other SIMD lanes): the pieces agree
    # to float32 rounding of the terms summed, which a score near zero can exceed relatively
    assert_within(late_interaction.maxsim(queries, half), whole, maxsim_atol(queries, half))


def test_score_is_the_models_similarity_and_bad_input_is_named():
    rng = np.random.default_rng(1)
    queries, documents = _ragged(rng, [4, 6]), _ragged(rng, [5, 3])
    # score() computes what maxsim() computes, in the same order: the same bits (rtol is only a margin)
    np.testing.assert_allclose(late_interaction.score("maxsim", queries, documents),
                               late_interaction.maxsim(queries, documents), rtol=1e-6)
    np.testing.assert_allclose(late_interaction.score("meanmaxsim", queries, documents),
                               late_interaction.maxsim(queries, documents) / np.array([[4], [6]]), rtol=1e-6)
    with pytest.raises(InvalidInputError, match="unknown late-interaction similarity 'cosine'; known: maxsim"):
        late_interaction.score("cosine", queries, documents)
    with pytest.raises(InvalidInputError, match=r"differ in size \(8, 9\)"):
        late_interaction.maxsim(queries, [np.ones((2, 9), np.float32)])
    with pytest.raises(InvalidInputError, match=r"documents\[0\] must be a \[vectors, dim\] array, got shape \(8,\)"):
        late_interaction.maxsim(queries, [np.ones(8)])
    with pytest.raises(InvalidInputError, match="a list of .* arrays"):
        late_interaction.maxsim(np.ones((2, 3, DIM)), documents)


def _flag_lexical(lw1: dict, lw2: dict) -> float:
    """FlagEmbedding's ``compute_lexical_matching_score`` of two texts, as it is written there."""
    scores = 0
    for token, weight in lw1.items():
        if token in lw2:
            scores += weight * lw2[token]
    return scores


def test_lexical_score_is_flag_embeddings_on_its_weights_and_on_sparse_embeddings():
    a = {"5": 0.25, "17": 1.5, "300": 0.125}
    b = {"17": 0.5, "300": 2.0, "9": 3.0}
    c = {"4": 1.0}
    expected = _flag_lexical(a, b)
    assert late_interaction.lexical_score(a, b) == pytest.approx(expected, rel=1e-12) and expected == 1.0

    def sparse(weights: dict) -> SparseEmbedding:
        ids = sorted(int(k) for k in weights)
        return SparseEmbedding(np.array(ids), np.array([weights[str(i)] for i in ids], np.float32))
    assert late_interaction.lexical_score(sparse(a), b) == pytest.approx(expected, rel=1e-7)
    matrix = late_interaction.lexical_score([sparse(a), c], [b, sparse(a), c])
    # the weights are short binary fractions (0.125 .. 3): every product and sum is exact, in any order
    np.testing.assert_allclose(matrix, [[_flag_lexical(x, y) for y in (b, a, c)] for x in (a, c)], rtol=1e-7)
    with pytest.raises(InvalidInputError, match="a list on each side"):
        late_interaction.lexical_score([a], b)


def test_the_served_vectors_are_each_rows_scored_positions_in_order():
    vectors = np.arange(2 * 4 * 2, dtype=np.float32).reshape(2, 4, 2) + 1
    mask = np.array([[0, 1, 0, 1, 0, 0], [1, 1, 1, 1, 0, 0]])  # wider than the vectors, holes allowed
    first, second = calls.embed_multi_vector(["a", "b"], COLBERT).read([(vectors, mask)])
    np.testing.assert_array_equal(first, vectors[0, [1, 3]])
    np.testing.assert_array_equal(second, vectors[1])
    np.testing.assert_array_equal(calls.embed_multi_vector("a", COLBERT).read([(vectors[:1], mask[:1])]), first)


def _config(name: str, task: str, **params: str) -> dict:
    """An ensemble's config as Triton's JSON writes it."""
    if task == "multi-vector":
        params = {"similarity": "maxsim", "input_types": "query,document", "vector_size": str(DIM),
                  "prompts": json.dumps({"query": "[Q] ", "document": "[D] "}), **params}
        outputs = [{"name": "MULTI_VECTOR", "dims": ["-1", str(DIM)]}, {"name": "SCORE_MASK", "dims": ["-1"]}]
    else:
        outputs = [{"name": "EMBEDDING" if task == "embedding" else "SCORES", "dims": [str(DIM)]}]
    return {"name": name, "platform": "ensemble", "max_batch_size": 2, "output": outputs,
            "parameters": {k: {"string_value": v} for k, v in {"task": task, **params}.items()},
            "ensemble_scheduling": {"step": [{"model_name": f"{name}_tokenizer"}]}}


COLBERT = ModelInfo.from_config("colbert", _config("colbert", "multi-vector"))


def test_a_model_serves_its_task_and_the_ones_its_serves_parameter_lists():
    m3 = ModelInfo.from_config("m3", _config("m3", "bge-m3", serves="embedding,sparse-embedding,multi-vector"))
    assert m3.tasks == ("bge-m3", "embedding", "sparse-embedding", "multi-vector")
    assert all(m3.serves(t) for t in m3.tasks) and not m3.serves("rerank")
    m3.expect("multi-vector")
    assert COLBERT.serves("multi-vector") and COLBERT.tasks == ("multi-vector",)
    assert COLBERT.similarity == "maxsim" and COLBERT.input_types == ("query", "document") and COLBERT.dimensions == DIM
    embedder = ModelInfo.from_config("embedder", _config("embedder", "embedding"))
    with pytest.raises(WrongTaskError, match="model 'embedder' serves task 'embedding', not 'multi-vector'"):
        embedder.expect(calls.embed_multi_vector("a text", embedder).task)


def test_embed_multi_vector_sends_the_side_and_the_prompt_and_checks_them_first():
    call = calls.embed_multi_vector(["a", "b", "c"], COLBERT, "query", prompt_name="document")
    assert call.task == "multi-vector" and call.outputs == ("MULTI_VECTOR", "SCORE_MASK")
    assert len(call.requests) == 2  # chunked by the model's max_batch_size
    assert call.parameters_of(1) == {INPUT_TYPE_PARAMETER: "query", PROMPT_PARAMETER: "document"}
    assert calls.embed_multi_vector("a", COLBERT).parameters == {INPUT_TYPE_PARAMETER: "document"}
    for bad in ("passage", None, 1):
        with pytest.raises(UnknownInputTypeError, match=r"unknown input_type .* for model 'colbert'; it reads "
                                                        r"'query', 'document'"):
            calls.embed_multi_vector("a", COLBERT, bad)


# -- a synthetic late-interaction model: one unit vector per word and side, two expansion vectors per query


def _unit(key: str) -> np.ndarray:
    vector = np.random.default_rng(zlib.crc32(key.encode())).standard_normal(DIM).astype(np.float32)
    return vector / np.linalg.norm(vector)


def _vectors(text: str, side: str) -> np.ndarray:
    words = [_unit(f"{side}:{word}") for word in text.split()] + ([_unit("[MASK]")] * 2 if side == "query" else [])
    return np.array(words, np.float32).reshape(-1, DIM)


def _answer(request: dict, parameters: dict) -> tuple[np.ndarray, np.ndarray]:
    """(MULTI_VECTOR, SCORE_MASK) as the ensemble lays them out: position 0 ([CLS]) never scored, the vectors
    zero off the mask, the mask wider than the vectors."""
    found = [_vectors(t.decode(), parameters[INPUT_TYPE_PARAMETER]) for t in request["TEXT"].reshape(-1)]
    width = 1 + max(len(v) for v in found)
    vectors, mask = np.zeros((len(found), width, DIM), np.float32), np.zeros((len(found), width + 2), np.int64)
    for row, text in enumerate(found):
        vectors[row, 1:1 + len(text)], mask[row, 1:1 + len(text)] = text, 1
    return vectors, mask


def _run(call: calls.Call, info: ModelInfo):
    """A client's ``_run`` with the synthetic model answering each request."""
    info.expect(call.task)
    return call.read([_answer(request, call.parameters_of(i)) for i, request in enumerate(call.requests)])


DOCUMENTS = ["red apples fall", "a cat sleeps", "apples and a cat", "stone", "red red cat"]


def _best_first(query: str, similarity: str) -> list[tuple[int, float]]:
    scores = _theirs([_vectors(query, "query")], [_vectors(d, "document") for d in DOCUMENTS],
                     similarity == "meanmaxsim")[0]
    return sorted(((i, float(s)) for i, s in enumerate(scores)), key=lambda pair: -pair[1])


def _scored_as_theirs(scores: list[float], query: str, similarity: str) -> None:
    """``scores``, best first, are sentence-transformers' (:func:`_best_first`) to float32 rounding of the
    terms summed: numpy's and PyTorch's kernels add in their own orders."""
    expected, mean = _best_first(query, similarity), similarity == "meanmaxsim"
    rounding = maxsim_atol([_vectors(query, "query")], [_vectors(d, "document") for d in DOCUMENTS], mean)[0]
    assert_within(scores, [s for _, s in expected], rounding[[i for i, _ in expected]], rtol=EPS32 if mean else 0.0)


@pytest.mark.parametrize("similarity", ["maxsim", "meanmaxsim"])
def test_rerank_on_a_multi_vector_model_ranks_by_its_own_score(similarity):
    info = ModelInfo.from_config("colbert", _config("colbert", "multi-vector", similarity=similarity))
    call = calls.rerank("red cat", DOCUMENTS, info)
    assert [call.parameters_of(i)[INPUT_TYPE_PARAMETER] for i in range(len(call.requests))] == \
        ["query", "document", "document", "document"]
    ranked = _run(call, info)
    expected = _best_first("red cat", similarity)
    assert [r.index for r in ranked] == [i for i, _ in expected]
    _scored_as_theirs([r.score for r in ranked], "red cat", similarity)
    assert ranked[0] == Ranked(ranked[0].index, ranked[0].score, DOCUMENTS[ranked[0].index])
    assert _run(calls.rerank("red cat", DOCUMENTS, info, top_k=2), info) == ranked[:2]
    vectors = _run(calls.embed_multi_vector(DOCUMENTS[:3], info), info)
    for got, text in zip(vectors, DOCUMENTS):
        np.testing.assert_array_equal(got, _vectors(text, "document"))
    with pytest.raises(WrongTaskError, match="names no late-interaction similarity"):
        calls.rerank("q", ["d"], ModelInfo.from_config("c", _config("c", "multi-vector", similarity="cosine")))


# -- the gateway's routes, answered through the client's calls from the synthetic model


class _Client:
    """The gateway's client as the late-interaction routes call it, its calls the real ones."""

    def __init__(self, models: dict[str, ModelInfo]):
        self.models = models

    async def embed_multi_vector(self, texts, model, input_type, prompt_name=None):
        info = self.models[model]
        return _run(calls.embed_multi_vector(texts, info, input_type, prompt_name), info)

    async def rerank(self, query, documents, model):
        return _run(calls.rerank(query, documents, self.models[model]), self.models[model])


class _Backend:
    def __init__(self, configs: dict):
        self.catalog = Catalog(ConfigTriton(configs), ttl_s=60)
        self.client = _Client({name: ModelInfo.from_config(name, config) for name, config in configs.items()})


def _gateway(*models: tuple[str, str]):
    app = create_app(GatewayConfig())
    app.state.backend = _Backend({name: _config(name, task) for name, task in models})
    return TestClient(app, raise_server_exceptions=False)  # no lifespan: Triton is not needed


def _tei_error(response, status: int, words: str) -> None:
    body = response.json()
    assert response.status_code == status and schema_problems(body, tei_schema("ErrorResponse")) == [], body
    assert words in body["error"], body


def test_embed_multi_vector_answers_each_texts_vectors_on_the_side_asked():
    gateway = _gateway(("colbert", "multi-vector"), ("embedder", "embedding"))
    for body, side in (({"inputs": ["red cat", "stone"]}, "document"), ({"inputs": "red cat", "input_type": "query"},
                                                                       "query")):
        response = gateway.post("/embed_multi_vector", json=body)
        texts = [body["inputs"]] if isinstance(body["inputs"], str) else body["inputs"]
        assert response.status_code == 200 and len(response.json()) == len(texts)
        for got, text in zip(response.json(), texts):
            # the gateway writes the vectors it was given to JSON and back: no arithmetic, the same values
            np.testing.assert_allclose(got, _vectors(text, side), rtol=1e-6)
    _tei_error(gateway.post("/embed_multi_vector", json={"inputs": "x", "input_type": "passage"}), 422,
               "unknown input_type 'passage' for model 'colbert'; it reads 'query', 'document'")
    _tei_error(gateway.post("/embed_multi_vector", json={"inputs": "x", "model": "embedder"}), 424,
               "serves task 'embedding', not 'multi-vector'")
    _tei_error(gateway.post("/embed", json={"inputs": "x", "model": "colbert"}), 424,
               "use POST /embed_multi_vector or /rerank")


def test_rerank_by_a_multi_vector_model_is_its_score_best_first_and_raw_scores_changes_nothing():
    gateway = _gateway(("colbert", "multi-vector"), ("embedder", "embedding"))
    body = {"query": "red cat", "texts": DOCUMENTS, "return_text": True}
    assert schema_problems(body, tei_schema("RerankRequest")) == []
    response = gateway.post("/rerank", json=body)
    assert response.status_code == 200
    ranks = response.json()
    assert all(schema_problems(rank, tei_schema("Rank")) == [] for rank in ranks)
    expected = _best_first("red cat", "maxsim")
    assert [r["index"] for r in ranks] == [i for i, _ in expected]
    assert [r["text"] for r in ranks] == [DOCUMENTS[i] for i, _ in expected]
    _scored_as_theirs([r["score"] for r in ranks], "red cat", "maxsim")
    assert gateway.post("/rerank", json={**body, "raw_scores": True}).json() == ranks
    _tei_error(gateway.post("/rerank", json={**body, "model": "embedder"}), 424,
               "serves task 'embedding', not 'rerank' or 'multi-vector'")
    both = _gateway(("colbert", "multi-vector"), ("reranker", "rerank"))
    _tei_error(both.post("/rerank", json=body), 422, "several models serve 'rerank' or 'multi-vector' "
               "(colbert, reranker)")


def test_the_catalog_finds_a_model_by_every_task_it_serves():
    configs = {"m3": _config("m3", "bge-m3", serves="embedding,sparse-embedding,multi-vector"),
               "embedder": _config("embedder", "embedding")}
    catalog = Catalog(ConfigTriton(configs), ttl_s=60)
    assert asyncio.run(catalog.only_for("multi-vector")).name == "m3"
    assert asyncio.run(catalog.get("m3", "sparse-embedding")).name == "m3"
    with pytest.raises(GatewayError, match="several models serve 'embedding'"):
        asyncio.run(catalog.only_for("embedding"))


def test_info_describes_a_multi_vector_model_as_an_unpooled_embedder():
    info = _gateway(("colbert", "multi-vector")).get("/info").json()
    assert schema_problems({k: v for k, v in info.items() if k not in EXTENSIONS}, tei_schema("Info")) == []
    assert info["model_type"] == {"embedding": {"pooling": "none"}} and info["dimensions"] == DIM


# -- served: a seeded tiny ColBERT exported, served by Triton, read through the client and the gateway


QUERIES = ["what is a tiny model?", "Where is Paris?"]
PASSAGES = ["Paris is the capital of France.", "A tiny model has few weights; it is fast.", "Water boils at 100 degrees.",
            "What? Yes, it is: (really)!"]
COSINE = 0.9999


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A native MultiVectorEncoder folder (queries expanded, documents' punctuation not scored, MeanMaxSim)
    exported in fp32 and served; its vectors as sentence-transformers encodes them."""
    root = tmp_path_factory.mktemp("late-interaction")
    folder = colbert_folder(root / "colbert", "native", expansion_length=12, skiplist_words=list(string.punctuation),
                            similarity="meanmaxsim")
    run_export(ExportOptions(model=str(folder), name="colbert", out=root / "repo", precision="fp32"))
    model = MultiVectorEncoder(str(folder), device="cpu")
    reference = {"query": model.encode_query(QUERIES, convert_to_numpy=True),
                 "document": model.encode_document(PASSAGES, convert_to_numpy=True)}
    with serving(root / "repo") as server:
        yield {**server, "model": model, "reference": reference}


def _same_vectors(got: list[np.ndarray], expected: list[np.ndarray]) -> None:
    """As many vectors per text, each a unit vector pointing where the reference's does."""
    for text, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g.shape == e.shape, text
        np.testing.assert_allclose(np.linalg.norm(g, axis=1), 1.0, atol=1e-5)
        cosines = np.sum(g * e, axis=1) / np.linalg.norm(e, axis=1)
        assert cosines.min() >= COSINE, (text, cosines.min())


def test_served_vectors_scores_and_ranking_are_multi_vector_encoders(served):
    model, reference = served["model"], served["reference"]
    with EncoderClient(served["grpc"], model="colbert") as client:
        queries = client.embed_multi_vector(QUERIES, input_type="query")
        documents = client.embed_multi_vector(PASSAGES)  # the document side by default
        similarity = client.info("colbert").similarity
        ranked = client.rerank(QUERIES[0], PASSAGES)
    _same_vectors(queries, reference["query"])
    _same_vectors(documents, reference["document"])
    assert similarity == model.similarity_fn_name == "meanmaxsim"
    expected = model.similarity(reference["query"], reference["document"]).numpy()
    np.testing.assert_allclose(late_interaction.score(similarity, queries, documents), expected, rtol=1e-4)
    # best first: each rank's reference score is the next largest (ties may come in either order)
    np.testing.assert_allclose([expected[0, r.index] for r in ranked], np.sort(expected[0])[::-1], rtol=1e-4)
    np.testing.assert_allclose([r.score for r in ranked], np.sort(expected[0])[::-1], rtol=1e-4)


def test_the_gateway_serves_the_vectors_and_ranks_by_them(served):
    with TestClient(create_app(GatewayConfig(triton=served["grpc"]))) as gateway:
        vectors = gateway.post("/embed_multi_vector", json={"inputs": QUERIES, "input_type": "query"})
        ranks = gateway.post("/rerank", json={"query": QUERIES[1], "texts": PASSAGES})
    assert vectors.status_code == 200 and ranks.status_code == 200, (vectors.text, ranks.text)
    _same_vectors([np.array(v, np.float32) for v in vectors.json()], served["reference"]["query"])
    expected = served["model"].similarity(served["reference"]["query"][1:], served["reference"]["document"]).numpy()[0]
    np.testing.assert_allclose([expected[r["index"]] for r in ranks.json()], np.sort(expected)[::-1], rtol=1e-4)
    np.testing.assert_allclose([r["score"] for r in ranks.json()], np.sort(expected)[::-1], rtol=1e-4)
