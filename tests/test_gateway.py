"""The HTTP gateway (OpenAI's and TEI's APIs) in front of the real Triton server, called by real clients.

One Triton server for the module (the packaged MiniLM, a tiny classifier and a
tiny reranker), and gateways started as ``nexus-sli gateway`` subprocesses on
free ports: an open one, a strict one (API key, small limits), and one whose
Triton is not there.
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai
import psutil
import pytest
import tritonclient.grpc as grpcclient
from huggingface_hub import InferenceClient
from prometheus_client.parser import text_string_to_metric_families
from sentence_transformers import SentenceTransformer
from tokenizers import Tokenizer

from helpers.servers import end_serve, running, serving, start_gateway, step_counts
from helpers.waiting import wait_for_line, wait_until
from helpers import task_models
from helpers.exports import MINILM
from helpers.http_api import call, schema_problems, tei, tei_schema
from helpers.vectors import cosines
from nexus_sli.bench.served import Gateway, free_ports
from nexus_sli.cli.main import build_parser
from nexus_sli.client import DeadlineExceededError, EncoderClient, ReplicasFailedError, ServerUnavailableError
from nexus_sli.exporter.export.pipeline import ExportOptions, run_export
from nexus_sli.exporter.export.source import resolve_model
from nexus_sli.exporter.export.validate import validation_texts
from nexus_sli.exporter.serving import server as serve
from nexus_sli.exporter.serving import temporary_folders
from nexus_sli.gateway import GatewayConfig, create_app
from nexus_sli.gateway.errors import from_client
from nexus_sli.gateway.server import exposure_warning

TEXTS = validation_texts()[:24]
READY_LINE = "gateway is ready"
#: the ``admitting`` gateway's --max-concurrent-requests, and the burst sent to it: several times as many
#: requests, each of many texts (the admitted ones answered whole)
ADMITTED, BURST, BURST_TEXTS = 2, 12, 256
REFUSED = "nexus_sli_gateway_requests_refused"
#: the gateway hands the server's vectors on unchanged (float32 written as JSON numbers, or its bytes in
#: base64): compared with the direct client's on the same server, only the server's own batching may differ
#: (another padding, another order of summation), far below this
PASSED_THROUGH = 1e-6
MODELS = ["classifier", "minilm", "reranker", "tiny_embedder"]


# --- TEI's OpenAPI description as the judge of shapes -------------------------------------------

def test_the_schema_checker_catches_wrong_shapes():
    assert schema_problems([[0.5, 1.0]], tei_schema("EmbedResponse")) == []
    assert schema_problems([0.5, 1.0], tei_schema("EmbedResponse")) != []
    assert schema_problems([{"index": 0, "score": 0.5, "doc": "x"}], tei_schema("RerankResponse")) != []
    assert schema_problems({"error": "x", "error_type": "validation"}, tei_schema("ErrorResponse")) != []
    assert schema_problems({"error": "x", "error_type": "Validation"}, tei_schema("ErrorResponse")) == []


# --- servers ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_tokenizer, tiny_checkpoint, exports):
    root = tmp_path_factory.mktemp("gateway")
    repo = root / "repo"
    exports.copy(MINILM, repo, as_name="minilm")
    # a second embedding model, one that does not normalise (no sentence-transformers Normalize module)
    run_export(ExportOptions(model=str(tiny_checkpoint("bert")), name="tiny_embedder", out=repo))
    run_export(ExportOptions(model=str(task_models.classifier(tiny_tokenizer, root / "classifier")),
                             name="classifier", out=repo))
    run_export(ExportOptions(model=str(task_models.reranker(tiny_tokenizer, root / "reranker")),
                             name="reranker", out=repo))
    with serving(repo) as server:
        yield server


@pytest.fixture(scope="module")
def gateway(served, tmp_path_factory):
    # two models serve embeddings: TEI's routes (which name none) use minilm
    started = start_gateway(served["grpc"], "--tei-model", "minilm", log=tmp_path_factory.mktemp("gw") / "open.log")
    yield started
    started.stop()


@pytest.fixture(scope="module")
def strict(served, tmp_path_factory):
    started = start_gateway(served["grpc"], "--max-inputs", "4", "--max-input-chars", "100", "--max-body-bytes",
                            "4096", log=tmp_path_factory.mktemp("gw") / "strict.log")
    yield started
    started.stop()


@pytest.fixture(scope="module")
def keyed(served, tmp_path_factory):
    # the key from the environment variable, as a deployment would pass it; a misspelt --tei-model
    os.environ["NEXUS_SLI_API_KEY"] = "s3cret"
    try:
        started = start_gateway(served["grpc"], "--tei-model", "minlm",
                                log=tmp_path_factory.mktemp("gw") / "keyed.log")
    finally:
        del os.environ["NEXUS_SLI_API_KEY"]
    yield started
    started.stop()


@pytest.fixture(scope="module")
def admitting(served, tmp_path_factory):
    """A gateway that admits two inference requests at once."""
    started = start_gateway(served["grpc"], "--tei-model", "minilm", "--max-concurrent-requests", str(ADMITTED),
                            log=tmp_path_factory.mktemp("gw") / "admitting.log")
    yield started
    started.stop()


@pytest.fixture(scope="module")
def orphan(tmp_path_factory):
    """A gateway whose Triton is not running."""
    started = start_gateway(f"127.0.0.1:{free_ports(1)[0]}", log=tmp_path_factory.mktemp("gw") / "orphan.log")
    yield started
    started.stop()


@pytest.fixture(scope="module")
def hung(tmp_path_factory):
    """A gateway whose Triton hangs: its port accepts connections and never answers."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.listen(64)
    try:
        started = start_gateway(f"127.0.0.1:{listener.getsockname()[1]}", "--triton-timeout", "1",
                                log=tmp_path_factory.mktemp("gw") / "hung.log")
        yield started
        started.stop()
    finally:
        listener.close()


@pytest.fixture(scope="module")
def reference():
    return SentenceTransformer(str(resolve_model(None).path), device="cpu")


@pytest.fixture(scope="module")
def direct(served):
    with EncoderClient(served["grpc"]) as client:
        yield client


def sdk(gateway: Gateway, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0)


# --- OpenAI's API, through the official SDK -----------------------------------------------------

def _vector(embedding) -> np.ndarray:
    """The SDK hands back base64 as sent when the caller asked for it by name."""
    if isinstance(embedding, str):
        return np.frombuffer(base64.b64decode(embedding), dtype="<f4")
    return np.array(embedding, dtype=np.float32)


# None: the SDK's default, which asks for base64 and decodes it itself
@pytest.mark.parametrize("encoding_format", ["float", "base64", None])
def test_openai_sdk_embeds_like_the_client_and_sentence_transformers(gateway, direct, reference, encoding_format):
    options = {"encoding_format": encoding_format} if encoding_format else {}
    response = sdk(gateway).embeddings.create(model="minilm", input=TEXTS, **options)
    assert all(isinstance(item.embedding, str) == (encoding_format == "base64") for item in response.data)
    got = np.stack([_vector(item.embedding) for item in response.data])
    assert [item.index for item in response.data] == list(range(len(TEXTS))) and response.model == "minilm"
    assert got.shape == (len(TEXTS), 384)
    assert np.allclose(got, direct.embed(TEXTS, model="minilm"), atol=PASSED_THROUGH)
    assert cosines(got, reference.encode(TEXTS, normalize_embeddings=True)).min() >= 0.9999
    expected = _model_tokens(TEXTS, reference.max_seq_length)
    assert response.usage.prompt_tokens == response.usage.total_tokens == expected


def _model_tokens(texts: list[str], max_length: int) -> int:
    """The tokens the packaged model's own tokenizer makes of ``texts``, as usage counts them: special tokens
    included, after truncation to the model's length (sentence-transformers' max_seq_length; tokenizer.json
    says 128)."""
    tokenizer = Tokenizer.from_file(str(resolve_model(None).path / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length)
    return sum(len(e.ids) for e in tokenizer.encode_batch(texts))


def test_base64_is_little_endian_float32_of_the_same_vector(gateway):
    status, _, as_floats = call(f"{gateway.url}/v1/embeddings", {"model": "minilm", "input": "one text"})
    status64, _, as_b64 = call(f"{gateway.url}/v1/embeddings",
                               {"model": "minilm", "input": "one text", "encoding_format": "base64"})
    assert status == status64 == 200 and len(as_floats["data"]) == 1
    decoded = np.frombuffer(base64.b64decode(as_b64["data"][0]["embedding"]), dtype="<f4")
    # one text asked twice runs alone both times (the same kernels, the same bits), and JSON keeps a float32 exact
    assert np.array_equal(decoded, np.array(as_floats["data"][0]["embedding"], dtype=np.float32))
    # TEI describes the same OpenAI-compatible route: the answer fits its schema too
    assert schema_problems(as_b64, tei_schema("OpenAICompatResponse")) == []
    assert as_floats["object"] == "list" and as_floats["data"][0]["object"] == "embedding"


def test_dimensions_equal_to_the_models_is_accepted(gateway):
    response = sdk(gateway).embeddings.create(model="minilm", input="text", dimensions=384)
    assert len(response.data[0].embedding) == 384
    # a model whose card names no Matryoshka sizes may be cut too (tests/test_retrieval.py checks the values)
    response = sdk(gateway).embeddings.create(model="minilm", input="text", dimensions=128)
    assert len(response.data[0].embedding) == 128


def test_models_lists_each_served_model_with_its_task(gateway, served):
    # nexus-sli serve keeps the repository index to its supervisor: the names come from the statistics API
    with pytest.raises(Exception, match="restricted|denied|PERMISSION|UNAVAILABLE"):
        grpcclient.InferenceServerClient(served["grpc"]).get_model_repository_index()
    assert sorted(m.id for m in sdk(gateway).models.list()) == MODELS
    _, _, body = call(f"{gateway.url}/v1/models")
    assert {m["id"]: m["task"] for m in body["data"]} == {
        "minilm": "embedding", "tiny_embedder": "embedding", "classifier": "classification", "reranker": "rerank"}
    # one model, as the SDK's models.retrieve asks for it: the list's entry; an unknown one a 404 in OpenAI's shape
    listed = next(m for m in body["data"] if m["id"] == "reranker")
    retrieved = sdk(gateway).models.retrieve("reranker").model_dump()
    assert {name: retrieved[name] for name in listed} == listed
    with pytest.raises(openai.NotFoundError) as missing:
        sdk(gateway).models.retrieve("no-such-model")
    assert missing.value.code == "model_not_found"
    status, _, part = call(f"{gateway.url}/v1/models/minilm_tokens")  # minilm's token states: not listed
    assert status == 404 and "part of another model" in part["error"]["message"], part


#: Discovery as the gateway runs it, with a real grpc.aio client to a real server, in an interpreter
#: of its own: grpc.aio channels on a fresh event loop per call stay out of the test process (a full
#: run once died of an unexplained segfault around here).  ``WithoutStatistics`` is that client with
#: the statistics API failing: a discovery that still finds the models read the repository index.
_DISCOVER = """
import asyncio, json, sys
import tritonclient.grpc.aio as grpc_aio
from nexus_sli.gateway import discovery

class WithoutStatistics(grpc_aio.InferenceServerClient):
    async def get_inference_statistics(self, *args, **kwargs):
        raise RuntimeError("the statistics API was called")

async def run(url, statistics):
    client = (grpc_aio.InferenceServerClient if statistics else WithoutStatistics)(url)
    try:
        return sorted(await discovery.model_names(client, timeout_s=30))
    finally:
        await client.close()

try:
    print(json.dumps({"names": asyncio.run(run(sys.argv[1], sys.argv[2] == "1"))}))
except Exception as exc:
    print(json.dumps({"error": type(exc).__name__ + ": " + str(exc)}))
"""


def _names(url: str, statistics: bool = True) -> dict:
    """``{"names": [...]}`` the discovery found, or ``{"error": "Type: message"}``."""
    out = subprocess.run([sys.executable, "-c", _DISCOVER, url, "1" if statistics else "0"],
                         capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout)


def test_behind_nexus_sli_serve_the_names_come_from_the_statistics_api(served):
    # the index is refused (restricted to the supervisor) ...
    with pytest.raises(Exception, match="restricted|denied|PERMISSION|UNAVAILABLE"):
        grpcclient.InferenceServerClient(served["grpc"]).get_model_repository_index()
    # ... so without the statistics API there are no names, and with it there are
    refused = _names(served["grpc"], statistics=False)["error"]
    assert refused.startswith("InferenceError") and "the statistics API was called" in refused
    assert set(MODELS) <= set(_names(served["grpc"])["names"])


def test_discovery_reads_the_repository_index_where_triton_allows_it(served, tmp_path):
    """A plain tritonserver (an NGC container, say) leaves the repository API open: the names come from it."""
    http, grpc, metrics = free_ports(3)
    triton = serve.TritonServer(serve.server_command(served["repo"], http, grpc, metrics), None,
                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        serve.wait_ready(http, triton)
        index = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc}").get_model_repository_index(as_json=True)
        # four models per export, four for the two embedding ones too (their encoder graphs pool, and a
        # second ensemble serves their token states): only the ensembles are served models
        assert len(index["models"]) == 16
        # the index is what answered: with the statistics API failing, the names still come
        assert _names(f"127.0.0.1:{grpc}", statistics=False) == {"names": sorted(m["name"] for m in index["models"])}
        open_gateway = start_gateway(f"127.0.0.1:{grpc}", log=tmp_path / "index.log")
        try:
            assert sorted(m.id for m in sdk(open_gateway).models.list()) == MODELS
            assert len(sdk(open_gateway).embeddings.create(model="minilm", input="x").data) == 1
        finally:
            open_gateway.stop()
    finally:
        serve.stop(triton)


# --- TEI's API ----------------------------------------------------------------------------------

def test_tei_embed(gateway, direct):
    status, _, body = tei(gateway, "/embed", {"inputs": TEXTS[:4], "normalize": True, "truncate": True,
                                              "model": "minilm"}, "EmbedRequest")
    assert status == 200 and schema_problems(body, tei_schema("EmbedResponse")) == []
    assert np.allclose(body, direct.embed(TEXTS[:4], model="minilm"), atol=PASSED_THROUGH)
    status, _, single = tei(gateway, "/embed", {"inputs": TEXTS[0], "model": "minilm"}, "EmbedRequest")
    assert status == 200 and np.array(single).shape == (1, 384)
    assert np.allclose(single[0], body[0], atol=1e-6)


def test_each_route_tokenizes_its_texts_once_and_usage_comes_from_the_same_call(gateway, served, reference):
    """/embed reports no usage and /v1/embeddings does: both send their texts through the tokenizer once
    (the ensemble's own step), the ensemble answering the token count with the vectors."""
    def tokenized() -> int:
        return step_counts(served["http"], "minilm", "tokenizer")[0]

    def counted(at_least: int) -> int:  # Triton may answer before a step has counted its execution
        wait_until(lambda: tokenized() >= at_least, f"the tokenizer to count {at_least} texts", timeout=30)
        return tokenized()

    def embed() -> None:
        assert tei(gateway, "/embed", {"inputs": TEXTS[:5], "model": "minilm"}, "EmbedRequest")[0] == 200

    before = tokenized()
    embed()
    after_embed = counted(before + 5)
    status, _, body = call(f"{gateway.url}/v1/embeddings", {"model": "minilm", "input": TEXTS[:5]})
    assert status == 200
    after_openai = counted(after_embed + 5)
    embed()  # once its texts are counted, so is any call the OpenAI request made before it
    assert (after_embed - before, after_openai - after_embed, counted(after_openai + 5) - after_openai) == (5, 5, 5)
    expected = _model_tokens(TEXTS[:5], reference.max_seq_length)
    assert body["usage"] == {"prompt_tokens": expected, "total_tokens": expected}


def test_tei_routes_need_a_model_only_where_several_serve_the_task(gateway, strict):
    status, _, body = tei(strict, "/embed", {"inputs": "x"}, "EmbedRequest")  # no --tei-model
    assert status == 422 and "several models serve 'embedding' (minilm, tiny_embedder)" in tei_error(body)["error"]
    assert call(f"{strict.url}/predict", {"inputs": "x"})[0] == 200  # one classifier: no name needed
    status, _, body = tei(gateway, "/embed", {"inputs": "x"}, "EmbedRequest")  # --tei-model minilm
    assert status == 200 and len(body[0]) == 384


def test_huggingface_hub_inference_client(gateway, direct):
    """huggingface_hub's client for TEI endpoints posts to the root URL, as TEI answers it."""
    got = InferenceClient(model=gateway.url).feature_extraction(TEXTS[:3])
    assert np.allclose(got, direct.embed(TEXTS[:3], model="minilm"), atol=PASSED_THROUGH)


def test_normalize_is_honoured_where_the_model_does_not_normalise(gateway, direct):
    raw = direct.embed(TEXTS[:4], model="tiny_embedder")
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0, atol=1e-3)  # the served model's own vectors
    unit = raw / np.linalg.norm(raw, axis=1, keepdims=True)
    _, _, normalized = tei(gateway, "/embed", {"inputs": TEXTS[:4], "model": "tiny_embedder"}, "EmbedRequest")
    assert np.allclose(normalized, unit, atol=1e-5)  # TEI's default: normalize=true
    _, _, as_is = tei(gateway, "/embed", {"inputs": TEXTS[:4], "model": "tiny_embedder", "normalize": False},
                      "EmbedRequest")
    assert np.allclose(as_is, raw, atol=1e-6)
    response = sdk(gateway).embeddings.create(model="tiny_embedder", input=TEXTS[:4], encoding_format="float")
    assert np.allclose([item.embedding for item in response.data], unit, atol=1e-5)  # OpenAI's are unit vectors


@pytest.mark.parametrize("return_text", [True, False])
def test_tei_rerank(gateway, direct, return_text):
    query, texts = TEXTS[0], TEXTS[1:9]
    status, _, body = tei(gateway, "/rerank", {"query": query, "texts": texts, "return_text": return_text},
                          "RerankRequest")
    assert status == 200 and schema_problems(body, tei_schema("RerankResponse")) == []
    expected = direct.rerank(query, texts, model="reranker")
    assert [r["index"] for r in body] == [r.index for r in expected]
    assert np.allclose([r["score"] for r in body], [r.score for r in expected], atol=1e-6)
    if return_text:
        assert [r["text"] for r in body] == [texts[r["index"]] for r in body]
    else:
        assert all("text" not in r for r in body)


def test_tei_rerank_raw_scores_are_the_logits_of_the_served_sigmoid(gateway, direct):
    query, texts = TEXTS[0], TEXTS[1:9]
    status, _, raw = tei(gateway, "/rerank", {"query": query, "texts": texts, "raw_scores": True}, "RerankRequest")
    assert status == 200 and schema_problems(raw, tei_schema("RerankResponse")) == []
    expected = direct.rerank(query, texts, model="reranker")
    assert [r["index"] for r in raw] == [r.index for r in expected]  # the same order: the logit is monotonic
    p = np.array([r.score for r in expected], dtype=np.float64)
    assert np.allclose([r["score"] for r in raw], np.log(p / (1 - p)), atol=1e-4)
    assert np.allclose(1 / (1 + np.exp(-np.array([r["score"] for r in raw]))), p, atol=1e-6)


def test_tei_predict_single_and_batch(gateway, direct):
    status, _, single = tei(gateway, "/predict", {"inputs": TEXTS[0]}, "PredictRequest")
    assert status == 200 and schema_problems(single, tei_schema("PredictResponse")) == []
    expected = direct.classify(TEXTS[:3], model="classifier", top_k=3)
    assert [p["label"] for p in single] == [lab.label for lab in expected[0]]
    # a one-string list is one input, answered as the string is: TEI's deserializer reads it so (types.rs
    # PredictInput), though its OpenAPI description lists only strings, pairs and batches
    assert call(f"{gateway.url}/predict", {"inputs": [TEXTS[0]]})[2] == single
    status, _, batch = tei(gateway, "/predict", {"inputs": [[t] for t in TEXTS[:3]]}, "PredictRequest")
    assert status == 200 and schema_problems(batch, tei_schema("PredictResponse")) == []
    assert [[p["label"] for p in row] for row in batch] == [[lab.label for lab in row] for row in expected]
    assert np.allclose([[p["score"] for p in row] for row in batch],
                       [[lab.score for lab in row] for row in expected], atol=1e-6)


# --- errors, each in its API's shape ------------------------------------------------------------

def openai_error(status: int, body) -> dict:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def tei_error(body) -> dict:
    assert schema_problems(body, tei_schema("ErrorResponse")) == [], body
    return body


@pytest.mark.parametrize("request_body, status, words", [
    ({"model": "nope", "input": "x"}, 404, "'nope' is not served"),
    ({"model": "classifier", "input": "x"}, 400, "serves task 'classification'"),
    ({"model": "minilm", "input": [[101, 2023, 102]]}, 400, "check_embedding_ctx_length=False"),
    ({"model": "minilm", "input": [101, 2023, 102]}, 400, "token ids"),
    ({"model": "minilm", "input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"model": "minilm", "input": "x", "dimensions": 385}, 400, "an integer from 1 to 384"),
    ({"model": "minilm", "input": "x", "prompt_name": "query"}, 400, "its prompts: none"),
    ({"input": "x"}, 400, "model is required"),
    ({"model": "minilm", "input": []}, 400, "empty"),
    ({"model": "minilm", "input": "lone \udc80 surrogate"}, 400, "cannot be sent as UTF-8"),
])
def test_openai_errors(gateway, request_body, status, words):
    got, _, body = call(f"{gateway.url}/v1/embeddings", request_body)
    assert got == status and words in openai_error(got, body)["message"]


def test_openai_sdk_raises_its_own_exceptions(gateway):
    with pytest.raises(openai.NotFoundError) as found:
        sdk(gateway).embeddings.create(model="nope", input="x")
    assert found.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="classification"):
        sdk(gateway).embeddings.create(model="classifier", input="x")


def test_teis_aliases_of_the_openai_route_and_the_health_probe(gateway, direct):
    """TEI serves OpenAI's route without /v1 (an SDK whose base_url is the server's root posts there) and answers
    its health on GET / and /ping too."""
    root = openai.OpenAI(base_url=gateway.url, api_key="unused", max_retries=0)
    response = root.embeddings.create(model="minilm", input=TEXTS[:2], encoding_format="float")
    vectors = np.array([d.embedding for d in response.data])
    assert np.allclose(vectors, direct.embed(TEXTS[:2], model="minilm"), atol=PASSED_THROUGH)
    with pytest.raises(openai.NotFoundError):  # in OpenAI's error shape, which the SDK reads
        root.embeddings.create(model="nope", input="x")
    for path in ("/", "/ping"):
        status, _, body = call(f"{gateway.url}{path}")
        assert status == 200 and body["status"] == "ok", path


@pytest.mark.parametrize("route, request_body, status, words", [
    ("/embed", {"inputs": "x", "model": "nope"}, 404, "'nope' is not served"),
    # TEI's statuses: a model of another kind is its Backend error (424), an invalid request its Validation (422)
    ("/rerank", {"query": "q", "texts": ["a"], "model": "minilm"}, 424, "serves task 'embedding'"),
    ("/predict", {"inputs": "x", "model": "reranker"}, 424, "serves task 'rerank'"),
    ("/embed", {"inputs": "x", "normalize": False, "model": "minilm"}, 422, "normalize=false"),
    ("/embed", {"inputs": [[101, 102]]}, 422, "token ids"),
    ("/predict", {"inputs": "x", "raw_scores": True}, 422, "raw_scores"),
    ("/embed", {"inputs": ["fine", "\ud800"]}, 422, "inputs[1] cannot be sent as UTF-8"),
    ("/predict", {"inputs": ["first", "second"]}, 422, "pair"),
    ("/embed", {"inputs": "x", "truncation_direction": "Left"}, 422, "truncation_direction"),
    ("/embed", {"inputs": []}, 400, "inputs is empty"),
])
def test_tei_errors(gateway, route, request_body, status, words):
    got, _, body = call(f"{gateway.url}{route}", request_body)
    assert got == status and words in tei_error(body)["error"]


def test_bad_json_is_a_400_in_each_shape(gateway):
    got, _, body = call(f"{gateway.url}/v1/embeddings", raw=b"{not json")
    assert got == 400 and "not valid JSON" in openai_error(got, body)["message"]
    got, _, body = call(f"{gateway.url}/embed", raw=b"{not json")
    assert got == 400 and "not valid JSON" in tei_error(body)["error"]
    got, _, body = call(f"{gateway.url}/embed", raw=b"[1, 2]")  # JSON, not TEI's request: its Validation
    assert got == 422 and "JSON object" in tei_error(body)["error"]
    # nested past the parser's recursion limit: still a 400, not a crash
    got, _, body = call(f"{gateway.url}/v1/embeddings", raw=b"[" * 100_000)
    assert got == 400 and "nested too deeply" in openai_error(got, body)["message"]
    got, _, body = call(f"{gateway.url}/rerank", raw=b'{"query": ' + b"[" * 100_000)
    assert got == 400 and "nested too deeply" in tei_error(body)["error"]


def test_unknown_routes_and_methods_answer_in_each_apis_shape(gateway):
    got, _, body = call(f"{gateway.url}/v1/nope", {"model": "minilm", "input": "x"})
    assert got == 404 and "/v1/embeddings" in openai_error(got, body)["message"]
    got, _, body = call(f"{gateway.url}/nope", {"inputs": "x"})
    assert got == 404 and "/embed" in tei_error(body)["error"]
    got, head, body = call(f"{gateway.url}/v1/embeddings")  # a GET
    assert got == 405 and "POST" in head["Allow"] and "GET /v1/embeddings" in openai_error(got, body)["message"]
    got, head, body = call(f"{gateway.url}/embed")
    assert got == 405 and "POST" in head["Allow"] and tei_error(body)["error_type"] == "Validation"
    with pytest.raises(openai.NotFoundError):
        sdk(gateway).completions.create(model="minilm", prompt="x")  # a route OpenAI has and the gateway does not


def test_limits_say_the_limit_with_each_apis_status(strict):
    """OpenAI answers too much input with a 400 (the SDK's BadRequestError), TEI with its batch-size Validation
    error (422); only a body past its limit is a 413."""
    got, _, body = call(f"{strict.url}/v1/embeddings", {"model": "minilm", "input": ["a"] * 5})
    assert got == 400 and "at most 4" in openai_error(got, body)["message"]
    assert body["error"]["code"] == "too_many_inputs"
    got, _, body = call(f"{strict.url}/embed", {"inputs": ["a"] * 5})
    assert got == 422 and "at most 4" in tei_error(body)["error"]
    got, _, body = call(f"{strict.url}/v1/embeddings", {"model": "minilm", "input": ["a" * 101]})
    assert got == 400 and "at most 100 per text" in openai_error(got, body)["message"]
    assert body["error"]["code"] == "input_too_long"
    with pytest.raises(openai.BadRequestError, match="at most 4"):
        sdk(strict).embeddings.create(model="minilm", input=["a"] * 5)
    got, _, body = call(f"{strict.url}/rerank", {"query": "q", "texts": ["a"] * 5})
    assert got == 422 and "at most 4" in tei_error(body)["error"]
    got, _, body = call(f"{strict.url}/v1/embeddings", {"model": "minilm", "input": ["a" * 90] * 4,
                                                        "user": "x" * 5000})
    assert got == 413 and "4096 bytes" in openai_error(got, body)["message"]
    got, _, body = call(f"{strict.url}/v1/embeddings", {"model": "minilm", "input": ["a" * 100] * 4})
    assert got == 200 and len(body["data"]) == 4  # at the limits, served


def test_a_chunked_body_past_the_limit_is_413_while_it_streams(strict):
    """No Content-Length to refuse it by: the limit is counted as the chunks arrive."""
    parts = [b'{"model": "minilm", "input": ["' + b"a" * 3000, b"a" * 3000 + b'"]}']
    connection = http.client.HTTPConnection("127.0.0.1", strict.port, timeout=120)
    try:
        connection.request("POST", "/v1/embeddings", body=iter(parts), encode_chunked=True,
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        status, body = response.status, json.loads(response.read())
    finally:
        connection.close()
    assert status == 413 and "4096 bytes" in openai_error(status, body)["message"]
    assert openai_error(status, body)["code"] == "body_too_large"


def test_api_key(keyed):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        got, head, body = call(f"{keyed.url}/v1/embeddings", {"model": "minilm", "input": "x"}, headers)
        assert got == 401 and openai_error(got, body)["code"] == "invalid_api_key"
        assert head["WWW-Authenticate"] == "Bearer"
    got, _, body = call(f"{keyed.url}/embed", {"inputs": "x"})
    assert got == 401 and "Authorization: Bearer" in tei_error(body)["error"]
    got, _, _ = call(f"{keyed.url}/metrics")
    assert got == 401
    for probe in ("/health", "/ping", "/"):  # probes carry no key
        assert call(f"{keyed.url}{probe}")[0] == 200, probe
    with pytest.raises(openai.AuthenticationError):
        sdk(keyed, "wrong").embeddings.create(model="minilm", input="x")
    assert len(sdk(keyed, "s3cret").embeddings.create(model="minilm", input="x").data) == 1
    got, _, body = call(f"{keyed.url}/embed", {"inputs": "x", "model": "minilm"}, {"Authorization": "Bearer s3cret"})
    assert got == 200 and len(body) == 1


def test_a_misspelt_tei_model_is_named_not_ignored(keyed):
    """The keyed gateway runs with --tei-model minlm (sic): a request naming no model is told so."""
    got, _, body = call(f"{keyed.url}/embed", {"inputs": "x"}, {"Authorization": "Bearer s3cret"})
    message = tei_error(body)["error"]
    assert got == 404 and "--tei-model 'minlm'" in message and "minilm, tiny_embedder" in message
    got, _, body = call(f"{keyed.url}/rerank", {"query": "q", "texts": ["a"]}, {"Authorization": "Bearer s3cret"})
    assert got == 404 and "--tei-model 'minlm'" in tei_error(body)["error"] and "reranker" in body["error"]


def test_a_triton_that_hangs_is_503_with_retry_after_and_the_gateway_stops_with_0(hung):
    """Its port accepts connections and never answers: every call's deadline (--triton-timeout 1) passes."""
    got, head, body = call(f"{hung.url}/v1/embeddings", {"model": "minilm", "input": "x"})
    assert got == 503 and int(head["Retry-After"]) > 0
    assert "did not answer within" in openai_error(got, body)["message"]
    got, head, body = call(f"{hung.url}/embed", {"inputs": "x"})
    assert got == 503 and int(head["Retry-After"]) > 0 and tei_error(body)["error_type"] == "Unhealthy"
    got, head, body = call(f"{hung.url}/health")
    assert got == 503 and int(head["Retry-After"]) > 0
    # SIGTERM, as a process manager stops it: a clean stop, exit code 0 (not death by the signal)
    assert hung.stop() == 0, hung.output()


def _metric(gateway: Gateway, name: str) -> float:
    """A gauge's value, or a counter's total over its labels, from the gateway's /metrics."""
    with urllib.request.urlopen(f"{gateway.url}/metrics") as response:
        families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
    return sum(s.value for s in families[name].samples if not s.name.endswith("_created"))


def test_a_burst_past_the_limit_is_refused_at_once_and_what_was_admitted_is_answered(admitting, served):
    """TEI's --max-concurrent-requests: a burst of 12 requests to a gateway that admits 2, half on OpenAI's
    route, half on TEI's.  The 2 admitted are held mid-body, so no place can free while the other 10 arrive
    at once: those are refused without waiting for one (429, Retry-After, each API's shape); the 2 admitted,
    sent whole, are answered; nothing refused reached Triton; and a query right after the burst is answered."""
    texts = (validation_texts() * 2)[:BURST_TEXTS]
    requests = [("/v1/embeddings", {"model": "minilm", "input": texts}), ("/embed", {"inputs": texts})] * (BURST // 2)
    before, tokenized = _metric(admitting, REFUSED), step_counts(served["http"], "minilm", "tokenizer")[0]
    admitted, burst = requests[:ADMITTED], requests[ADMITTED:]
    held = [_held_request(admitting, route, body) for route, body in admitted]
    try:
        wait_until(lambda: _metric(admitting, "nexus_sli_gateway_requests_in_flight") == ADMITTED,
                   "the gateway to hold the admitted requests", timeout=30)
        # a gateway that waited for a place instead would answer none of these while the admitted are held
        with ThreadPoolExecutor(len(burst)) as pool:
            refused = list(pool.map(lambda request: call(f"{admitting.url}{request[0]}", request[1]), burst))
        answers = _finished(held)
    finally:
        for connection, _ in held:
            connection.close()
    assert [status for status, *_ in refused] == [429] * len(burst), [status for status, *_ in refused]
    for (route, _), (status, head, body) in zip(burst, refused):
        assert int(head["Retry-After"]) >= 1 and "--max-concurrent-requests" in str(body), (route, dict(head))
        if route == "/embed":
            assert tei_error(body)["error_type"] == "Overloaded"
        else:
            error = openai_error(status, body)
            assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    assert _metric(admitting, REFUSED) - before == len(burst)
    assert [status for status, _ in answers] == [200] * ADMITTED, answers
    assert all(len(body["data"] if isinstance(body, dict) else body) == BURST_TEXTS for _, body in answers)
    # only the admitted texts were tokenized: nothing refused reached Triton, nor is left computing there
    wait_until(lambda: step_counts(served["http"], "minilm", "tokenizer")[0] >= tokenized + ADMITTED * BURST_TEXTS,
               "the tokenizer to count the admitted texts", timeout=30)
    assert step_counts(served["http"], "minilm", "tokenizer")[0] - tokenized == ADMITTED * BURST_TEXTS
    status, _, _ = call(f"{admitting.url}/v1/embeddings", {"model": "minilm", "input": "next"})
    assert status == 200  # the places freed: a query right after the burst is admitted


def _finished(held: list[tuple[http.client.HTTPConnection, bytes]]) -> list[tuple[int, object]]:
    """Each held request (:func:`_held_request`) sent whole: its status and JSON body."""
    answers = []
    for connection, rest in held:
        connection.send(rest)
        response = connection.getresponse()
        answers.append((response.status, json.loads(response.read())))
    return answers


def _held_request(gateway: Gateway, route: str, body: dict) -> tuple[http.client.HTTPConnection, bytes]:
    """A POST sent up to half its body: the gateway holds it in flight until the rest comes.
    (the connection, the rest of the body)."""
    data = json.dumps(body).encode()
    connection = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=120)
    connection.putrequest("POST", route)
    connection.putheader("Content-Type", "application/json")
    connection.putheader("Content-Length", str(len(data)))
    connection.endheaders(data[:len(data) // 2])
    return connection, data[len(data) // 2:]


def test_requests_in_flight_hold_their_places_and_the_sdk_reads_a_refusal_as_rate_limiting(admitting):
    """Two requests held mid-body fill the bound: the openai SDK's next call is its RateLimitError, while
    the routes that do not call Triton for inference still answer; once the two are answered, the
    SDK's calls are served again."""
    held = [_held_request(admitting, "/v1/embeddings", {"model": "minilm", "input": ["held"]}),
            _held_request(admitting, "/embed", {"inputs": ["held"]})]
    try:
        wait_until(lambda: _metric(admitting, "nexus_sli_gateway_requests_in_flight") == ADMITTED,
                   "the gateway to hold both requests", timeout=30)
        with pytest.raises(openai.RateLimitError) as refused:
            sdk(admitting).embeddings.create(model="minilm", input="x")
        assert refused.value.response.headers["retry-after"] == "1"
        assert refused.value.body["code"] == "rate_limit_exceeded"
        assert call(f"{admitting.url}/v1/models")[0] == 200 and call(f"{admitting.url}/health")[0] == 200
        got, _, info = call(f"{admitting.url}/info")
        assert got == 200 and info["max_concurrent_requests"] == ADMITTED
        answers = _finished(held)
    finally:
        for connection, _ in held:
            connection.close()
    assert [status for status, _ in answers] == [200, 200], answers
    assert len(sdk(admitting).embeddings.create(model="minilm", input="x").data) == 1


def test_triton_unavailable_is_503_with_retry_after(orphan):
    got, head, body = call(f"{orphan.url}/v1/embeddings", {"model": "minilm", "input": "x"})
    assert got == 503 and int(head["Retry-After"]) > 0
    assert "unreachable" in openai_error(got, body)["message"]
    got, head, body = call(f"{orphan.url}/embed", {"inputs": "x"})
    assert got == 503 and int(head["Retry-After"]) > 0 and tei_error(body)["error_type"] == "Unhealthy"
    got, head, body = call(f"{orphan.url}/health")
    assert got == 503 and int(head["Retry-After"]) > 0 and tei_error(body)["error_type"] == "Unhealthy"
    with pytest.raises(openai.InternalServerError) as raised:
        sdk(orphan).embeddings.create(model="minilm", input="x")
    assert raised.value.status_code == 503


# --- batching, metrics, serve -------------------------------------------------------------------

def test_32_concurrent_requests_are_merged_by_triton_and_answered_each(gateway, served, direct):
    def counts():
        return step_counts(served["http"], "minilm", "encoder")

    texts = validation_texts()[:32]

    async def send_all():
        async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0) as client:
            await client.models.list()  # connected before the burst
            answers = await asyncio.gather(*(client.embeddings.create(model="minilm", input=t, encoding_format="float")
                                             for t in texts))
        return np.array([a.data[0].embedding for a in answers], dtype=np.float32)

    before = counts()
    got = asyncio.run(send_all())

    # the encoder is the ensemble's last step: Triton may answer before it has counted the execution
    def all_counted():
        now = counts()
        return now if now[0] - before[0] >= len(texts) else None

    after = wait_until(all_counted, "the encoder to count every request", timeout=30)
    inferences, executions = after[0] - before[0], after[1] - before[1]
    assert inferences == 32 and executions < inferences, f"{executions} encoder executions for {inferences} requests"
    assert np.allclose(got, direct.embed(texts, model="minilm"), atol=PASSED_THROUGH)  # each got its own text's


def test_metrics_are_prometheus_text(gateway):
    assert call(f"{gateway.url}/v1/embeddings", {"model": "minilm", "input": "counted"})[0] == 200
    assert call(f"{gateway.url}/v1/embeddings", {"model": "nope", "input": "counted"})[0] == 404
    with urllib.request.urlopen(f"{gateway.url}/metrics") as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
    requests = {(s.labels["route"], s.labels["status"]): s.value
                for s in families["nexus_sli_gateway_requests"].samples if s.name.endswith("_total")}
    assert requests[("/v1/embeddings", "200")] >= 1 and requests[("/v1/embeddings", "404")] >= 1
    latency = families["nexus_sli_gateway_request_duration_seconds"]
    buckets = [s for s in latency.samples if s.name.endswith("_bucket") and s.labels["route"] == "/v1/embeddings"]
    assert buckets and max(s.value for s in buckets if s.labels["le"] == "+Inf") >= 2


@pytest.mark.parametrize("stopped", ["serve", "gateway", "killed"])
def test_serve_starts_the_gateway_beside_triton_and_stopping_one_stops_both(served, tmp_path, stopped):
    http, grpc, metrics, port = free_ports(4)
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "nexus_sli.cli.main", "serve", "--model-repository",
                                    str(served["repo"]), "--http-port", str(http), "--grpc-port", str(grpc),
                                    "--metrics-port", str(metrics), "--gateway-port", str(port)],
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        text = wait_for_line(process, log, READY_LINE, timeout=240)
        assert f"http://127.0.0.1:{port}/v1" in text and "Triton is ready" in text
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        assert len(client.embeddings.create(model="minilm", input="through make serve").data[0].embedding) == 384
        if stopped == "serve":  # what Ctrl-C or a process manager does
            process.send_signal(signal.SIGTERM)
            assert process.wait(60) == 0
        elif stopped == "gateway":  # the gateway ends on its own: Triton is not left running without it
            gateway_process = next(p for p in psutil.Process(process.pid).children()
                                   if "gateway" in p.cmdline())
            gateway_process.terminate()
            # the gateway's clean stop exits 0, and so does serve with it (not 241 from a code of -15)
            assert process.wait(60) == 0
            assert "the process beside Triton exited (code 0)" in log.read_text()
        else:  # kill -9: serve runs no clean-up, yet neither outlives it
            started = psutil.Process(process.pid).children()
            assert sorted("gateway" in p.cmdline() for p in started) == [False, True], started
            triton = next(p for p in started if "gateway" not in p.cmdline())
            made = [Path(a.split("=", 1)[1]) for a in triton.cmdline()  # its backend folder, its joined shadow
                    if a.startswith(("--backend-directory=", "--model-repository="))]
            assert len(made) == 2 and all(folder.is_dir() for folder in made), made
            process.kill()
            process.wait()
            wait_until(lambda: not any(running(p) for p in started), "Triton and the gateway to end with serve")
            for prefix in temporary_folders.SERVER_PREFIXES:  # as the next serve's start does
                temporary_folders.remove_abandoned(prefix)
            assert not any(folder.exists() for folder in made), made
    finally:
        end_serve(process)
    for url in (f"http://127.0.0.1:{port}/health", f"http://127.0.0.1:{http}/v2/health/ready"):
        with pytest.raises(OSError):  # both are gone
            urllib.request.urlopen(url, timeout=5)


def test_every_retryable_client_error_is_a_503():
    down = ServerUnavailableError("down")
    failed = ReplicasFailedError([("a:8001", down), ("b:8001", down)])
    for exc in (failed, ServerUnavailableError("down"), DeadlineExceededError("too slow")):  # a deadline as before
        error = from_client(exc, retry_after=5)
        assert (error.status("openai"), error.status("tei"), error.retry_after) == (503, 503, 5)


def test_a_fault_in_the_gateway_is_a_500_in_the_apis_shape():
    """No real request makes the gateway fail, so a route that raises is added to a real app."""
    from starlette.routing import Route
    from starlette.testclient import TestClient

    async def broken(request):
        raise RuntimeError("a bug")

    app = create_app(GatewayConfig())
    app.router.routes += [Route("/v1/broken", broken), Route("/broken", broken)]
    client = TestClient(app, raise_server_exceptions=False)  # no lifespan: Triton is not needed
    response = client.get("/v1/broken")
    error = openai_error(response.status_code, response.json())
    assert response.status_code == 500 and error["code"] == "internal_error" and "a bug" in error["message"]
    response = client.get("/broken")
    assert response.status_code == 424 and tei_error(response.json())["error_type"] == "Backend"


def test_one_triton_per_gateway():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["gateway", "--triton", "a:8001,b:8001"])
    with pytest.raises(ValueError, match="one Triton"):
        GatewayConfig(triton="a:8001,b:8001")


def test_the_concurrency_bound_is_a_count_or_0_for_none():
    assert build_parser().parse_args(["gateway"]).max_concurrent_requests == GatewayConfig().max_concurrent_requests
    assert build_parser().parse_args(["gateway", "--max-concurrent-requests", "0"]).max_concurrent_requests == 0
    for bad in ("-1", "many"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["gateway", "--max-concurrent-requests", bad])
    with pytest.raises(ValueError, match="max_concurrent_requests must be an integer >= 0"):
        GatewayConfig(max_concurrent_requests=-1)
    bounded = [m.cls.__name__ for m in create_app(GatewayConfig()).user_middleware]
    assert "AdmissionMiddleware" in bounded
    assert "AdmissionMiddleware" not in [m.cls.__name__ for m in
                                         create_app(GatewayConfig(max_concurrent_requests=0)).user_middleware]


def test_binding_beyond_loopback_without_a_key_is_warned():
    for host in ("0.0.0.0", "::", "10.1.2.3", "gateway.example"):
        warning = exposure_warning(GatewayConfig(host=host))
        assert warning is not None and "NEXUS_SLI_API_KEY" in warning and "process list" in warning
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert exposure_warning(GatewayConfig(host=host)) is None
    assert exposure_warning(GatewayConfig(host="0.0.0.0", api_key="k")) is None


def test_cli_defaults_are_loopback_and_the_documented_ports():
    args = build_parser().parse_args(["gateway"])
    assert (args.host, args.port, args.triton) == ("127.0.0.1", 8080, "127.0.0.1:8001")
    assert build_parser().parse_args(["serve"]).gateway_port == 8080


def test_the_cli_needs_no_asgi_stack_until_the_gateway_runs():
    # an install without the gateway extra still runs every other command
    code = "import sys, nexus_sli.cli.main; print(*(m in sys.modules for m in ('starlette', 'uvicorn', 'openai')))"
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert found == ["False", "False", "False"]


def test_the_discovery_ttl_is_the_gateways_option():
    from nexus_sli.cli.gateway_command import config_from

    assert config_from(build_parser().parse_args(["gateway"])).discovery_ttl_s == GatewayConfig().discovery_ttl_s
    assert config_from(build_parser().parse_args(["gateway", "--discovery-ttl", "2.5"])).discovery_ttl_s == 2.5
