"""Token embeddings beside every pooled embedding export, checked against sentence-transformers.

The pooled graph keeps its token states as a second output (exporter/export/pooling.py);
a second ensemble, ``NAME_tokens``, serves them with the tokenizer's attention mask.
One seeded tiny sentence-transformers model (mean pooling, normalisation) is exported in
fp32 and served by the real Triton server: ``NAME_tokens`` over gRPC and HTTP against
``SentenceTransformer.encode(output_value="token_embeddings")`` (cosine >= 0.9999 per
token, the same token count), and ``NAME`` still answers its ``EMBEDDING``, also when
both kinds of request share one encoder execution.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer import modules

from nexus_sli.exporter.export.padding_trim import add_padding_trim, trimmed_length
from nexus_sli.exporter.export.pipeline import ExportOptions, run_export
from nexus_sli.exporter.export.pooling import Pooling
from nexus_sli.exporter.export.revalidate import revalidate
from nexus_sli.exporter.export.validate import Embedder, build_reference, compare, parity_cases
from nexus_sli.exporter.export.validate import validation_texts
from nexus_sli.exporter.triton import config as tc
from nexus_sli.exporter.triton import publish
from nexus_sli.tasks import get_task
from helpers.servers import serving
from helpers.tiny_models import COMMON, VOCAB, plain_graph, quiet_session
from helpers.vectors import cosines

NAME = "tokens_st"
HIDDEN = COMMON["hidden_size"]
#: texts of different lengths: empty, one character, long, and past the model's 64 tokens (truncated)
TEXTS = ["", "a", *validation_texts()[:8], "water " * 200]
COSINE = 0.9999


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_checkpoint):
    folder = tmp_path_factory.mktemp("token-st") / "model"
    transformer = modules.Transformer(str(tiny_checkpoint("bert")), max_seq_length=64)
    SentenceTransformer(modules=[transformer, modules.Pooling(HIDDEN, "mean"), modules.Normalize()],
                        device="cpu").save(str(folder))
    return folder


@pytest.fixture(scope="module")
def reference(model_dir):
    return SentenceTransformer(str(model_dir), device="cpu")


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_dir):
    repo = tmp_path_factory.mktemp("token-repo")
    report = run_export(ExportOptions(model=str(model_dir), name=NAME, out=repo)).report
    with serving(repo) as server:
        yield {**server, "report": report}


def _infer(url: str, protocol: str, model: str, texts: list[str], outputs: list[str]) -> dict[str, np.ndarray]:
    module = httpclient if protocol == "http" else grpcclient
    tensor = module.InferInput("TEXT", [len(texts), 1], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode("utf-8") for t in texts], dtype=object).reshape(-1, 1))
    client = module.InferenceServerClient(url)
    try:
        result = client.infer(model, [tensor])
        return {name: result.as_numpy(name) for name in outputs}
    finally:
        client.close()


def _check_tokens(got: dict[str, np.ndarray], expected: list) -> None:
    """Each text's real tokens (cut by its mask) against sentence-transformers' token embeddings."""
    states, mask = got["TOKEN_EMBEDDINGS"], got["ATTENTION_MASK"]
    assert states.dtype == np.float32 and states.shape[0] == mask.shape[0] == len(expected)
    assert states.shape[2] == HIDDEN and mask.dtype == np.int64
    for row, want in enumerate(expected):
        count = int(mask[row].sum())
        assert count == len(want), (row, count, len(want))
        cos = cosines(states[row, :count], want.numpy())
        assert cos.min() >= COSINE, (row, cos.min())


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_served_token_embeddings_match_sentence_transformers(served, reference, protocol):
    got = _infer(served[protocol], protocol, NAME + "_tokens", TEXTS, ["TOKEN_EMBEDDINGS", "ATTENTION_MASK"])
    expected = reference.encode(TEXTS, output_value="token_embeddings")
    assert [len(e) for e in expected][-1] == 64  # the long text is cut at the model's length on both sides
    _check_tokens(got, expected)
    # one text alone: its states are exactly as long as its tokens
    alone = _infer(served[protocol], protocol, NAME + "_tokens", TEXTS[3:4], ["TOKEN_EMBEDDINGS", "ATTENTION_MASK"])
    assert alone["TOKEN_EMBEDDINGS"].shape == (1, len(expected[3]), HIDDEN)
    _check_tokens(alone, expected[3:4])


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_the_embedding_ensemble_still_answers_its_embedding(served, reference, protocol):
    got = _infer(served[protocol], protocol, NAME, TEXTS, ["EMBEDDING"])["EMBEDDING"]
    assert got.shape == (len(TEXTS), HIDDEN)
    assert cosines(got, reference.encode(TEXTS, normalize_embeddings=True)).min() >= COSINE


def test_embedding_and_token_requests_sharing_executions_each_get_their_own(served, reference):
    """Concurrent single texts to both ensembles merge in the encoder's batcher: each request gets what it
    asked for, computed for the union of what the execution's requests asked."""
    embeddings = reference.encode(TEXTS, normalize_embeddings=True)
    tokens = reference.encode(TEXTS, output_value="token_embeddings")

    def send(index: int):
        row = index % len(TEXTS)
        if index % 2:
            return row, "tokens", _infer(served["grpc"], "grpc", NAME + "_tokens", [TEXTS[row]],
                                         ["TOKEN_EMBEDDINGS", "ATTENTION_MASK"])
        return row, "embedding", _infer(served["grpc"], "grpc", NAME, [TEXTS[row]], ["EMBEDDING"])

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(send, range(4 * len(TEXTS))))
    for row, kind, got in answers:
        if kind == "tokens":
            _check_tokens(got, tokens[row:row + 1])
        else:
            assert cosines(got["EMBEDDING"], embeddings[row:row + 1]).min() >= COSINE


def test_the_repository_describes_the_token_ensemble(served):
    repo = served["repo"]
    ensemble = tc.read(repo / NAME / "config.pbtxt")
    assert ensemble.parameters["token_model"].string_value == NAME + "_tokens"
    assert [(o.name, list(o.dims)) for o in ensemble.output] == [("EMBEDDING", [HIDDEN]), ("TOKEN_COUNT", [1])]
    tokens = tc.read(repo / f"{NAME}_tokens" / "config.pbtxt")
    assert tokens.platform == "ensemble" and tokens.parameters["task"].string_value == "token-embedding"
    assert tokens.parameters["embedding_model"].string_value == NAME
    assert [i.name for i in tokens.input] == ["TEXT"]
    assert [(o.name, o.data_type, list(o.dims)) for o in tokens.output] == [
        ("TOKEN_EMBEDDINGS", tc.pb.TYPE_FP32, [-1, HIDDEN]), ("ATTENTION_MASK", tc.pb.TYPE_INT64, [-1])]
    # the same tokenizer and encoder, not copies
    assert [s.model_name for s in tokens.ensemble_scheduling.step] == [f"{NAME}_tokenizer", f"{NAME}_encoder"]
    encoder = tc.read(repo / f"{NAME}_encoder" / "config.pbtxt")
    assert [(o.name, list(o.dims)) for o in encoder.output] == [("EMBEDDING", [HIDDEN]),
                                                                ("TOKEN_EMBEDDINGS", [-1, HIDDEN])]
    assert served["report"].outputs == ["EMBEDDING", "TOKEN_EMBEDDINGS"] and served["report"].validation.passed
    # publishing uploads the shared steps once, under one version with both ensembles
    assert publish.groups_of(publish.read_local(repo)) == [
        [f"{NAME}_tokenizer", f"{NAME}_encoder", NAME, f"{NAME}_tokens"]]


def test_revalidation_compares_the_token_states_too(served, tmp_path):
    record = revalidate(served["repo"], NAME)
    assert record["passed"] and record["max_abs_diff"] <= 1e-4


# --- the graph's second output -------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain(tiny_checkpoint, tmp_path_factory):
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(tiny_checkpoint("bert")), attn_implementation="eager").eval()
    return plain_graph(model, get_task("embedding"), tmp_path_factory.mktemp("token-graph"), (7, 3, 12, 1, 12), 20,
                       seed=9)


def test_the_pooled_graph_keeps_the_token_states_and_validation_compares_them(plain):
    pooling = Pooling("mean", True, "last_hidden_state", "EMBEDDING", HIDDEN, "TOKEN_EMBEDDINGS")
    pooled = pooling.append(plain["path"], plain["folder"] / "pooled.onnx")
    trimmed = add_padding_trim(pooled, plain["folder"] / "pooled.trim.onnx", pooling.per_token)
    feeds = plain["feeds"]
    (states,) = quiet_session(plain["path"]).run(None, feeds)
    session = quiet_session(trimmed)
    assert [o.name for o in session.get_outputs()] == ["EMBEDDING", "TOKEN_EMBEDDINGS"]
    embedding, tokens = session.run(None, feeds)
    length = trimmed_length(feeds["attention_mask"])
    assert tokens.shape == (5, length, HIDDEN) and length < feeds["attention_mask"].shape[1]
    np.testing.assert_allclose(tokens, states[:, :length], atol=1e-6)
    (only,) = session.run(["EMBEDDING"], feeds)  # what the served encoder asks for on embedding requests
    np.testing.assert_array_equal(only, embedding)  # one session, one input: the same sums in the same order
    reference = build_reference(plain["model"], get_task("embedding"), plain["names"],
                                parity_cases(plain["names"], VOCAB, 0, 128), [feeds])
    task = get_task("embedding")
    report = compare(session, reference, "fp32", Embedder("mean", True), task, pooled="EMBEDDING",
                     tokens="TOKEN_EMBEDDINGS")
    assert report.passed and report.max_abs_diff < 1e-5
    # judged as a graph without the token output, the names differ: the second output is checked, not ignored
    assert "graph outputs ['EMBEDDING', 'TOKEN_EMBEDDINGS']" in compare(
        session, reference, "fp32", Embedder("mean", True), task, pooled="EMBEDDING").summary()
