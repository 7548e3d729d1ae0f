"""The ``bge-m3`` task exported and served: BGE-M3's three outputs from one pass, against FlagEmbedding's.

The seeded tiny BGE-M3 (:mod:`helpers.m3_models`) is exported with ``--task auto`` in fp32 on ONNX
Runtime and served by one Triton server.  Through the client (gRPC: ``embed_m3``, ``embed``,
``embed_sparse``, ``embed_multi_vector``) and the gateway (``/embed``, ``/v1/embeddings``, ``/embed_sparse``,
``/embed_multi_vector``, ``/info``), each text's outputs match FlagEmbedding's ``BGEM3FlagModel`` as kept in
``tests/data/bge_m3/flag_reference.json``: dense and ColBERT vectors at cosine >= 0.9999 per vector and
unit norm, the same lexical ids wherever FlagEmbedding's weight is >= 1e-4, the weights and both scores
(ColBERT's MeanMaxSim, the lexical score) within 1e-4 relative.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from starlette.testclient import TestClient

from helpers.m3_models import COLBERT_DIM, build_m3, weights_fingerprint
from helpers.servers import serving
from nexus_sli.client import EncoderClient, InvalidInputError, M3Embedding, SparseEmbedding, calls, late_interaction
from nexus_sli.client.model_info import ModelInfo
from nexus_sli.cli.main import main
from nexus_sli.exporter.errors import NexusError, ValidationError
from nexus_sli.exporter.export import stored_reference
from nexus_sli.exporter.export.m3_heads import M3Embedder
from nexus_sli.exporter.export.pipeline import ExportOptions, run_export
from nexus_sli.exporter.export.revalidate import RECORD, revalidate
from nexus_sli.gateway import GatewayConfig, create_app
from nexus_sli.tasks import bge_m3

REFERENCE = Path(__file__).parent / "data" / "bge_m3" / "flag_reference.json"
#: the issue's bars: per-vector cosine, the weight from which an id must be present, relative tolerance
COSINE, PRESENT, RELATIVE = 0.9999, 1e-4, 1e-4


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads(REFERENCE.read_text())


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tiny_tokenizer, reference) -> Path:
    built = build_m3(tmp_path_factory.mktemp("bge-m3"), tiny_tokenizer)
    assert weights_fingerprint(built) == reference["fingerprint"], "the tiny BGE-M3 changed: re-run make test-real"
    return built


@pytest.fixture(scope="module")
def served(tmp_path_factory, folder):
    repo = tmp_path_factory.mktemp("bge-m3-repo")
    report = run_export(ExportOptions(model=str(folder), name="m3", out=repo, precision="fp32",
                                      allow_pickle=True, cache=False)).report
    with serving(repo) as server:
        yield {**server, "report": report}


def _lexical(weights: dict) -> dict[int, float]:
    return {int(token): weight for token, weight in weights.items()}


def _same_vectors(got: np.ndarray, expected) -> None:
    expected = np.asarray(expected, np.float32).reshape(got.shape)
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, atol=1e-5)
    cosines = np.sum(got * expected, axis=-1) / np.linalg.norm(expected, axis=-1)
    assert cosines.min() >= COSINE, cosines.min()


def _same_lexical(got: SparseEmbedding, expected: dict[int, float]) -> None:
    """The same ids wherever the reference weight is >= :data:`PRESENT`, every weight within :data:`RELATIVE`."""
    ours = dict(zip(got.indices.tolist(), got.values.tolist()))
    assert {t for t, w in expected.items() if w >= PRESENT} <= set(ours) <= set(expected), (ours, expected)
    np.testing.assert_allclose([ours[t] for t in ours], [expected[t] for t in ours], rtol=RELATIVE)


def test_token_weights_become_lexical_weights_and_a_lost_term_fails_parity():
    weights = np.array([0.0, 0.5, 0.2, 0.7, 0.0], np.float32)  # cut shorter than the ids (the padding trim)
    ids = np.array([0, 9, 4, 9, 2, 1, 1])
    found, values = bge_m3.lexical(weights, ids)
    assert found.tolist() == [4, 9] and values.tolist() == pytest.approx([0.2, 0.7])
    info = ModelInfo("m3", "bge-m3", 8, {"serves": bge_m3.SERVES})
    call = calls.embed_sparse(["a"], info, top_k=1)
    assert call.outputs == ("SPARSE_WEIGHTS", "TOKEN_IDS") and call.task == "sparse-embedding"
    [terms] = call.read([(weights[None], ids[None])])
    assert terms.indices.tolist() == [9] and terms.values.tolist() == pytest.approx([0.7])
    with pytest.raises(InvalidInputError, match="asks for nothing"):
        calls.embed_m3(["a"], info, dense=False, sparse=False, multi_vector=False)
    expected, got = [None, np.array([[0.0, 2e-4, 5e-5]])], [None, np.zeros((1, 3))]
    assert M3Embedder.lost_terms(got, expected) == ["SPARSE_WEIGHTS: 1 token weights >= 0.0001 in PyTorch are "
                                                    "zero in the graph"]
    assert M3Embedder.lost_terms(expected, expected) == []


def test_auto_exports_the_three_heads_and_a_folder_without_them_is_refused(served, folder, tmp_path):
    report = served["report"]
    assert report.task == "bge-m3" and report.pooling == "bge-m3" and report.validation.passed
    assert report.outputs == ["EMBEDDING", "SPARSE_WEIGHTS", "MULTI_VECTOR"]
    plain = tmp_path / "plain"
    plain.mkdir()
    for item in folder.iterdir():
        if item.suffix != ".pt":
            (plain / item.name).symlink_to(item)
    with pytest.raises(NexusError, match="sparse_linear.pt and colbert_linear.pt"):
        run_export(ExportOptions(model=str(plain), task="bge-m3", out=tmp_path / "repo", allow_pickle=True))


def test_validate_checks_the_export_again_with_the_heads_kept_beside_its_reference(served, tmp_path, capsys):
    copy = tmp_path / "repo"
    shutil.copytree(served["repo"] / "m3_encoder", copy / "m3_encoder")
    assert main(["validate", "--repository", str(copy), "--model", "m3"]) == 0
    assert json.loads(capsys.readouterr().out)["passed"] is True
    record = json.loads((copy / "m3_encoder" / RECORD).read_text())
    assert record["texts"] == served["report"].validation.texts
    assert record["thresholds"] == served["report"].validation.thresholds
    # the heads are read from the stored reference: other heads there fail the same graph
    file = copy / "m3_encoder" / stored_reference.FILE
    with np.load(file) as stored:
        arrays = dict(stored)
    arrays["embedder.colbert_weight"] = arrays["embedder.colbert_weight"][::-1].copy()  # its dimensions reordered
    np.savez_compressed(file, **arrays)
    with pytest.raises(ValidationError, match="does not match PyTorch on this machine"):
        revalidate(copy, "m3")
    # an export from before the heads were kept there is told to export again
    np.savez_compressed(file, **{key: value for key, value in arrays.items() if not key.startswith("embedder.")})
    with pytest.raises(NexusError, match="keeps no BGE-M3 heads.*export the model again"):
        revalidate(copy, "m3")


def test_the_client_answers_flag_embeddings_outputs_from_one_pass(served, reference):
    texts = reference["queries"]["texts"] + reference["documents"]["texts"]
    expected = {key: reference["queries"][key] + reference["documents"][key]
                for key in ("dense", "lexical_weights", "colbert")}
    with EncoderClient(served["grpc"], model="m3") as client:
        info = client.info("m3")
        found = client.embed_m3(texts)
        dense, sparse = client.embed(texts), client.embed_sparse(texts)
        vectors = client.embed_multi_vector(texts, input_type="query")
        only_dense = client.embed_m3(texts[0], sparse=False, multi_vector=False)
    assert info.serves("embedding") and info.serves("sparse-embedding") and info.serves("multi-vector")
    assert info.similarity == "meanmaxsim" and len(found) == len(texts)
    assert isinstance(only_dense, M3Embedding) and only_dense.sparse is None and only_dense.vectors is None
    # alone, the text runs at another padded width than in the batch: the same sums in other SIMD lanes, so the
    # vector agrees to rounding on its own scale (unit norm), not on each component's, some near zero
    np.testing.assert_allclose(only_dense.dense, found[0].dense, rtol=0, atol=1e-6)
    for i, got in enumerate(found):
        _same_vectors(got.dense, expected["dense"][i])
        _same_vectors(dense[i], expected["dense"][i])
        _same_lexical(got.sparse, _lexical(expected["lexical_weights"][i]))
        _same_lexical(sparse[i], _lexical(expected["lexical_weights"][i]))
        assert got.vectors.shape[1] == COLBERT_DIM
        _same_vectors(got.vectors, expected["colbert"][i])
        # the same requests in the same batches as embed_m3's: the same kernels in the same order, the same bits
        np.testing.assert_allclose(vectors[i], got.vectors, rtol=1e-6, atol=1e-7)
    queries, documents = found[:3], found[3:]
    colbert = late_interaction.score(info.similarity, [q.vectors for q in queries], [d.vectors for d in documents])
    np.testing.assert_allclose(colbert, reference["colbert_scores"], rtol=RELATIVE)
    lexical = late_interaction.lexical_score([q.sparse for q in queries], [d.sparse for d in documents])
    np.testing.assert_allclose(lexical, reference["lexical_scores"], rtol=RELATIVE)


def test_the_gateway_routes_answer_a_bge_m3_model(served, reference):
    texts, expected = reference["documents"]["texts"], reference["documents"]
    with TestClient(create_app(GatewayConfig(triton=served["grpc"]))) as gateway:
        dense = gateway.post("/embed", json={"inputs": texts})
        sparse = gateway.post("/embed_sparse", json={"inputs": texts})
        vectors = gateway.post("/embed_multi_vector", json={"inputs": texts})
        openai = gateway.post("/v1/embeddings", json={"input": texts, "model": "m3"})
        info = gateway.get("/info")
    for answer in (dense, sparse, vectors, openai, info):
        assert answer.status_code == 200, answer.text
    assert info.json()["model_type"] == {"embedding": {"pooling": "cls"}}
    assert openai.json()["usage"]["prompt_tokens"] == sum(len(ids) for ids in expected["input_ids"])
    for i in range(len(texts)):
        _same_vectors(np.array(dense.json()[i], np.float32), expected["dense"][i])
        _same_vectors(np.array(openai.json()["data"][i]["embedding"], np.float32), expected["dense"][i])
        terms = sparse.json()[i]
        _same_lexical(SparseEmbedding(np.array([t["index"] for t in terms]), np.array([t["value"] for t in terms])),
                      _lexical(expected["lexical_weights"][i]))
        _same_vectors(np.array(vectors.json()[i], np.float32), expected["colbert"][i])
