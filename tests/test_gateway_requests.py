"""The gateway's reading of requests and its answers' statuses, on both APIs, without Triton.

A real app (its routes, middleware and error handlers) over a backend that answers from configs:
the models are discovered from Triton-shaped configs (``ConfigTriton``), and the calls return fixed
results, recording what reached them.  What is checked is the gateway's side: which inputs it takes,
what it sends on, and the status and error type each API answers with (TEI's router/src/http/server.rs,
OpenAI's 400 for every invalid request).
"""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest
from starlette.routing import Route
from starlette.testclient import TestClient

from helpers.fake_triton import ConfigTriton
from helpers.http_api import schema_problems, tei_schema
from nexus_sli.client.error_codes import DECODED_OUTPUT, IDS_INPUT, TOKENS_OUTPUT
from nexus_sli.gateway import GatewayConfig, create_app
from nexus_sli.gateway import backend as gateway_backend
from nexus_sli.gateway import tei_tokens
from nexus_sli.gateway.admission import AdmissionMiddleware
from nexus_sli.gateway.discovery import Catalog
from nexus_sli.gateway.metrics import Metrics
from nexus_sli.tasks.results import Label, Ranked

MAX_LENGTH = 8


def _params(**values) -> dict:
    return {key: {"string_value": value} for key, value in values.items()}


def _tokenizer(truncate: bool = True, text_modes: bool = True) -> dict:
    """A tokenizer step's config: ``text_modes`` false as exports before /tokenize and /decode."""
    return {"backend": "python", "max_batch_size": 64,
            "parameters": _params(max_length=str(MAX_LENGTH), truncate=str(truncate).lower()),
            "input": [{"name": "TEXT"}, *([{"name": IDS_INPUT}] if text_modes else [])],
            "output": [{"name": "input_ids"}, *([{"name": TOKENS_OUTPUT}, {"name": DECODED_OUTPUT}] if text_modes
                                                 else [])]}


def _ensemble(name: str, task: str, output: str = "EMBEDDING", dims: int = 4, **params) -> dict:
    return {"platform": "ensemble", "max_batch_size": 64, "parameters": _params(task=task, **params),
            "output": [{"name": output, "dims": [dims]}],
            "ensemble_scheduling": {"step": [{"model_name": f"{name}_tokenizer"}]}}


CONFIGS = {
    "emb": _ensemble("emb", "embedding"), "emb_tokenizer": _tokenizer(),
    "whole": _ensemble("whole", "embedding"), "whole_tokenizer": _tokenizer(truncate=False),
    "older": _ensemble("older", "embedding"), "older_tokenizer": _tokenizer(text_modes=False),
    "cls": _ensemble("cls", "classification", "SCORES", 2, id2label=json.dumps({"0": "neg", "1": "pos"})),
    "cls_tokenizer": _tokenizer(),
    "ranker": _ensemble("ranker", "rerank", "SCORES", 1), "ranker_tokenizer": _tokenizer(),
}


def _tokens(text: str) -> dict:
    """The tokenizer step's TOKENS of ``text``: [CLS], one token per word, [SEP]; ``bytes`` as its UTF-8 offsets."""
    words, start = [], 0
    for word in text.split():
        start = text.index(word, start)
        words.append((word, start, start + len(word)))
        start += len(word)
    chars = [[a, b] for _, a, b in words]
    return {"ids": [101, *range(1000, 1000 + len(words)), 102], "text": ["[CLS]", *(w for w, _, _ in words), "[SEP]"],
            "special": [True, *[False] * len(words), True], "offsets": [[0, 0], *chars, [0, 0]],
            "bytes": [[0, 0], *([len(text[:a].encode()), len(text[:b].encode())] for a, b in chars), [0, 0]]}


class _Client:
    def __init__(self, sent: list):
        self.sent = sent

    async def classify(self, texts, model, top_k):
        self.sent.append(("classify", model, texts))
        return [[Label("pos", 0.75), Label("neg", 0.25)][:top_k] for _ in texts]

    async def rerank(self, query, texts, model):
        self.sent.append(("rerank", model, texts))
        return [Ranked(i, 0.5, text) for i, text in enumerate(texts)]

    async def embed_tokens(self, texts, model, prompt_name=None):
        self.sent.append(("embed_tokens", model, texts))
        return [np.ones((MAX_LENGTH, 4), np.float32) for _ in texts]


class _Backend:
    """The gateway's backend as its routes call it; ``sent`` records each call that would reach Triton."""

    def __init__(self, tokens=_tokens):
        self.catalog = Catalog(ConfigTriton(CONFIGS), ttl_s=60)
        self.sent: list = []
        self.client = _Client(self.sent)
        self._tokens = tokens

    async def ready(self) -> bool:
        return True

    async def embed(self, model, texts, prompt_name=None):
        self.sent.append(("embed", model.name, texts))
        return np.tile(np.array([0.6, 0.8, 0.0, 0.0], np.float32), (len(texts), 1))

    async def embed_counted(self, model, texts, prompt_name=None):
        return await self.embed(model, texts, prompt_name), 3 * len(texts)

    async def tokenize(self, model, texts, prompt_name, add_special_tokens):
        self.sent.append(("tokenize", model.name, texts))
        return [self._tokens(text) for text in texts]

    async def decode(self, model, rows, skip_special_tokens):
        gateway_backend._ids_tensor(rows)  # the tensor the real backend would send
        self.sent.append(("decode", model.name, rows))
        return ["text"] * len(rows)


def _gateway(config: GatewayConfig | None = None, backend: _Backend | None = None) -> TestClient:
    app = create_app(config or GatewayConfig(max_inputs=4, max_input_chars=100))
    app.state.backend = backend or _Backend()
    return TestClient(app, raise_server_exceptions=False)  # no lifespan: Triton is not needed


def _tei(response, status: int, error_type: str, words: str = "") -> str:
    body = response.json()
    assert response.status_code == status and schema_problems(body, tei_schema("ErrorResponse")) == [], body
    assert body["error_type"] == error_type and words in body["error"], body
    return body["error"]


def _openai(response, status: int, code: str | None = None, words: str = "") -> str:
    body = response.json()
    assert response.status_code == status and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["type"] == "invalid_request_error" and words in body["error"]["message"], body
    assert code is None or body["error"]["code"] == code, body
    return body["error"]["message"]


# --- /tokenize's offsets ---------------------------------------------------------------------------

def test_tokenize_answers_utf8_byte_offsets_as_tei_does():
    """TEI's SimpleToken start/stop are UTF-8 byte offsets (its into_tokens; "这" is (0, 3))."""
    text = "这 Grüße café"
    found = _gateway().post("/tokenize", json={"inputs": text, "model": "emb"}).json()[0]
    words = [t for t in found if not t["special"]]
    assert [(t["start"], t["stop"]) for t in words] == [(0, 3), (4, 11), (12, 17)]
    assert all(text.encode()[t["start"]:t["stop"]].decode() == t["text"] for t in words)
    assert [(t["start"], t["stop"]) for t in found if t["special"]] == [(None, None)] * 2


def test_tokenize_of_an_export_without_bytes_falls_back_to_character_offsets():
    def older(text: str) -> dict:
        tokens = _tokens(text)
        del tokens["bytes"]
        return tokens

    found = _gateway(backend=_Backend(older)).post("/tokenize", json={"inputs": "这 café", "model": "emb"}).json()[0]
    assert [(t["start"], t["stop"]) for t in found if not t["special"]] == [(0, 1), (2, 6)]



def test_tokenize_refuses_an_answer_past_max_token_vectors_before_building_it(monkeypatch):
    """/tokenize answers a dict per token, built on the event loop: bounded as /embed_all's vectors are, by the
    tokens the step made (untruncated: no model's length bounds them)."""
    built = []
    monkeypatch.setattr(tei_tokens, "_simple_tokens", lambda tokens: built.append(tokens) or [])
    gateway = _gateway(GatewayConfig(max_inputs=4, max_input_chars=100, max_token_vectors=8))
    six_words = "a b c d e f"  # [CLS], six words, [SEP]: 8 tokens
    assert gateway.post("/tokenize", json={"inputs": six_words, "model": "emb"}).status_code == 200
    built.clear()
    _tei(gateway.post("/tokenize", json={"inputs": [six_words, "g"], "model": "emb"}), 422, "Validation",
         "/tokenize would answer 11 tokens for these texts, more than this gateway's --max-token-vectors 8")
    assert built == []


# --- /predict's inputs -----------------------------------------------------------------------------

def test_predict_reads_a_one_string_list_as_one_input_and_refuses_a_pair_or_more():
    gateway = _gateway()
    single = gateway.post("/predict", json={"inputs": "one text"}).json()
    assert gateway.post("/predict", json={"inputs": ["one text"]}).json() == single  # flat, as for a string
    assert single == [{"label": "pos", "score": 0.75}, {"label": "neg", "score": 0.25}]
    assert gateway.post("/predict", json={"inputs": [["one"], ["two"]]}).json() == [single, single]
    _tei(gateway.post("/predict", json={"inputs": ["first", "second"]}), 422, "Validation", "a pair of strings")
    _tei(gateway.post("/predict", json={"inputs": [["one"], ["a", "b"]]}), 422, "Validation", "a pair of strings")
    _tei(gateway.post("/predict", json={"inputs": ["a", "b", "c"]}), 422, "Validation", "a sequence of 3 strings")


# --- bodies and ids --------------------------------------------------------------------------------

def test_an_integer_too_long_for_python_is_a_400_not_a_gateway_failure():
    gateway = _gateway()
    long_number = b"9" * 5000
    response = gateway.post("/v1/embeddings", content=b'{"model": "emb", "input": "x", "dimensions": ' + long_number
                            + b"}", headers={"Content-Type": "application/json"})
    _openai(response, 400, words="more than 4300 digits")
    response = gateway.post("/embed", content=b'{"inputs": "x", "extra": ' + long_number + b"}",
                            headers={"Content-Type": "application/json"})
    _tei(response, 400, "Validation", "not valid JSON")


@pytest.mark.parametrize("ids", [[2**32], [[1, 2], [2**63]], [2**64], [[-1]]])
def test_decode_refuses_ids_outside_teis_u32(ids):
    backend = _Backend()
    _tei(_gateway(backend=backend).post("/decode", json={"ids": ids, "model": "emb"}), 422, "Validation",
         "integers from 0 to 4294967295")
    assert backend.sent == []


def test_decode_takes_the_largest_u32():
    backend = _Backend()
    assert _gateway(backend=backend).post("/decode", json={"ids": [2**32 - 1], "model": "emb"}).json() == ["text"]
    assert backend.sent == [("decode", "emb", [[2**32 - 1]])]



@pytest.mark.parametrize("ids, words", [
    ([], "ids is empty"), ([[]], "ids[0] is empty"), ([[1], []], "ids[1] is empty"),
])
def test_decode_of_no_ids_is_teis_empty_error_as_tokenize_of_no_inputs_is(ids, words):
    backend = _Backend()
    _tei(_gateway(backend=backend).post("/decode", json={"ids": ids, "model": "emb"}), 400, "Empty", words)
    assert backend.sent == []


# --- statuses: TEI's own on its routes, OpenAI's 400 on its ----------------------------------------

@pytest.mark.parametrize("route, body", [
    ("/embed", {"inputs": "x", "model": "cls"}),
    ("/predict", {"inputs": "x", "model": "emb"}),
    ("/rerank", {"query": "q", "texts": ["a"], "model": "emb"}),
    ("/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"]}, "model": "cls"}),
])
def test_a_model_of_another_task_is_teis_backend_error(route, body):
    _tei(_gateway().post(route, json=body), 424, "Backend", "serves task")


def test_a_model_of_another_task_stays_a_400_on_openais_route():
    _openai(_gateway().post("/v1/embeddings", json={"model": "cls", "input": "x"}), 400, "wrong_task")


@pytest.mark.parametrize("route, body, status, error_type, words", [
    ("/embed", {"inputs": []}, 400, "Empty", "inputs is empty"),
    ("/tokenize", {"inputs": [], "model": "emb"}, 400, "Empty", "inputs is empty"),
    ("/rerank", {"query": "q", "texts": []}, 400, "Empty", "texts is empty"),
    ("/similarity", {"inputs": {"source_sentence": "a", "sentences": []}}, 400, "Empty", "inputs.sentences is empty"),
    ("/decode", {"ids": [[1]] * 5, "model": "emb"}, 422, "Validation", "at most 4"),
    ("/embed", {"inputs": ["a"] * 5}, 422, "Validation", "at most 4"),
    ("/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"] * 4}}, 422, "Validation", "at most 4"),
    ("/embed", {"inputs": "a" * 101}, 422, "Validation", "at most 100 per text"),
    ("/embed", {"inputs": "x", "prompt_name": "nope"}, 422, "Validation", "unknown prompt_name"),
    ("/embed", {"inputs": "x", "truncation_direction": "Left"}, 422, "Validation", "truncation_direction"),
    ("/embed", [1, 2], 422, "Validation", "JSON object"),
])
def test_tei_answers_validation_with_422_and_no_inputs_with_400_empty(route, body, status, error_type, words):
    gateway = _gateway(GatewayConfig(max_inputs=4, max_input_chars=100, tei_model="emb"))
    _tei(gateway.post(route, json=body), status, error_type, words)



@pytest.mark.parametrize("method, route, body", [
    ("GET", "/info", None), ("POST", "/tokenize", {"inputs": "a"}), ("POST", "/decode", {"ids": [1]}),
    ("POST", "/embed", {"inputs": "a"}),
])
def test_a_tei_model_that_is_not_served_is_a_404_naming_the_flag_on_every_route(method, route, body):
    gateway = _gateway(GatewayConfig(tei_model="nope"))
    _tei(gateway.request(method, route, json=body), 404, "Validation",
         "the gateway's --tei-model 'nope' is not served here")


class _NonFiniteClient(_Client):
    async def classify(self, texts, model, top_k):
        return [[Label("pos", float("nan")), Label("neg", float("nan"))][:top_k] for _ in texts]

    async def rerank(self, query, texts, model):
        return [Ranked(i, float("nan"), text) for i, text in enumerate(texts)]


class _NonFiniteBackend(_Backend):
    """A model that overflowed: NaN in its vectors and scores."""

    def __init__(self):
        super().__init__()
        self.client = _NonFiniteClient(self.sent)

    async def embed(self, model, texts, prompt_name=None):
        return np.full((len(texts), 4), np.nan, np.float32)


@pytest.mark.parametrize("route, body, model", [
    ("/embed", {"inputs": "x", "model": "emb"}, "emb"),
    ("/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"]}, "model": "emb"}, "emb"),
    ("/predict", {"inputs": "x", "model": "cls"}, "cls"),
    ("/rerank", {"query": "q", "texts": ["a"], "model": "ranker", "raw_scores": True}, "ranker"),
])
def test_a_model_answering_nan_is_teis_backend_error_naming_it(route, body, model):
    message = _tei(_gateway(backend=_NonFiniteBackend()).post(route, json=body), 424, "Backend",
                   "not a finite number")
    assert repr(model) in message and "--precision fp32" in message


def test_a_model_answering_nan_is_openais_server_error_and_base64_carries_it():
    gateway = _gateway(backend=_NonFiniteBackend())
    response = gateway.post("/v1/embeddings", json={"model": "emb", "input": "x"})
    error = response.json()["error"]
    assert response.status_code == 500 and error["type"] == "server_error", error
    assert error["code"] == "non_finite_output" and "'emb'" in error["message"], error
    response = gateway.post("/v1/embeddings", json={"model": "emb", "input": "x", "encoding_format": "base64"})
    assert response.status_code == 200
    assert np.isnan(np.frombuffer(base64.b64decode(response.json()["data"][0]["embedding"]), "<f4")).all()


def test_embed_all_takes_at_most_the_texts_whose_longest_answers_fit_max_token_vectors():
    """Each text counted at its model's max_length (8 here): 20 vectors take 2 texts, refused before any call."""
    backend = _Backend()
    gateway = _gateway(GatewayConfig(max_inputs=4, max_input_chars=100, max_token_vectors=20), backend)
    assert np.asarray(gateway.post("/embed_all", json={"inputs": ["a", "b"], "model": "emb"}).json()).shape == (2, 8, 4)
    _tei(gateway.post("/embed_all", json={"inputs": ["a", "b", "c"], "model": "emb"}), 422, "Validation",
         "up to 8 vectors a text for model 'emb', so a request takes at most 2 texts here (--max-token-vectors 20)")
    assert backend.sent == [("embed_tokens", "emb", ["a", "b"])]
    one = _gateway(GatewayConfig(max_token_vectors=7), backend).post("/embed_all", json={"inputs": "a", "model": "emb"})
    _tei(one, 422, "Validation", "more than this gateway's --max-token-vectors 7: start it with a larger one")


@pytest.mark.parametrize("route, body, words", [
    ("/embed", {"inputs": ["a", ""], "model": "emb"}, "inputs[1] is empty"),
    ("/embed_all", {"inputs": "", "model": "emb"}, "inputs[0] is empty"),
    ("/predict", {"inputs": "", "model": "cls"}, "inputs[0] is empty"),
    ("/tokenize", {"inputs": [""], "model": "emb"}, "inputs[0] is empty"),
    ("/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b", ""]}, "model": "emb"},
     "inputs.sentences[1] is empty"),
    ("/rerank", {"query": "", "texts": ["a", ""], "model": "ranker"}, "query and texts[1] are both empty"),
])
def test_an_empty_text_is_teis_empty_error_and_nothing_is_sent(route, body, words):
    """TEI refuses an empty input (its ``Empty``, a 400), and a pair only where both sides are empty."""
    backend = _Backend()
    _tei(_gateway(backend=backend).post(route, json=body), 400, "Empty", words)
    assert backend.sent == []


def test_an_empty_text_is_openais_400_and_a_pair_with_one_empty_side_is_ranked():
    backend = _Backend()
    gateway = _gateway(backend=backend)
    _openai(gateway.post("/v1/embeddings", json={"model": "emb", "input": ["a", ""]}), 400, words="input[1] is empty")
    assert backend.sent == []
    ranked = gateway.post("/rerank", json={"query": "", "texts": ["a"], "model": "ranker"})
    assert ranked.status_code == 200 and backend.sent == [("rerank", "ranker", ["a"])]
    ranked = gateway.post("/rerank", json={"query": "q", "texts": ["a", ""], "model": "ranker"})
    assert ranked.status_code == 200 and len(ranked.json()) == 2


def test_only_a_body_past_its_limit_is_a_413():
    gateway = _gateway(GatewayConfig(max_body_bytes=4096))
    _tei(gateway.post("/embed", json={"inputs": "x" * 5000}), 413, "Validation", "4096 bytes")
    _openai(gateway.post("/v1/embeddings", json={"model": "emb", "input": "x" * 5000}), 413, "body_too_large")


@pytest.mark.parametrize("body, code, words", [
    ({"model": "emb", "input": ["a"] * 5}, "too_many_inputs", "at most 4"),
    ({"model": "emb", "input": ["a" * 101]}, "input_too_long", "at most 100 per text"),
    ({"model": "emb", "input": []}, None, "input is empty"),
    ({"model": "emb", "input": "a", "encoding_format": ""}, None, "encoding_format must be one of"),
    ({"model": "emb", "input": "a", "encoding_format": False}, None, "encoding_format must be one of"),
])
def test_openai_answers_every_invalid_input_with_400(body, code, words):
    """The openai SDK raises BadRequestError for a 400; a 413 would be a bare APIStatusError."""
    _openai(_gateway().post("/v1/embeddings", json=body), 400, code, words)


def test_token_ids_on_tei_routes_get_teis_advice_and_on_openais_langchains():
    gateway = _gateway()
    for route, body in (("/embed", {"inputs": [101, 2023]}), ("/embed_all", {"inputs": [[101, 2023]]}),
                        ("/embed_sparse", {"inputs": [[101]]}), ("/tokenize", {"inputs": [101]})):
        message = _tei(gateway.post(route, json=body), 422, "Validation", "unlike TEI, it takes no token-id inputs")
        assert "LangChain" not in message and "/decode" in message
    _openai(gateway.post("/v1/embeddings", json={"model": "emb", "input": [[101, 2023]]}), 400,
            "token_ids_not_supported", "check_embedding_ctx_length=False")


# --- truncate --------------------------------------------------------------------------------------

LONG = " ".join(["word"] * MAX_LENGTH)  # with [CLS] and [SEP]: past MAX_LENGTH tokens


def test_truncate_false_on_a_truncating_export_refuses_only_a_text_it_would_cut():
    backend = _Backend()
    gateway = _gateway(backend=backend)
    assert gateway.post("/embed", json={"inputs": ["short text"], "model": "emb", "truncate": False}).status_code == 200
    assert backend.sent[-1] == ("embed", "emb", ["short text"])
    backend.sent.clear()
    _tei(gateway.post("/embed", json={"inputs": ["short", LONG], "model": "emb", "truncate": False}), 422,
         "Validation", f"inputs[1] has {MAX_LENGTH + 2} tokens, more than model 'emb' takes ({MAX_LENGTH})")
    assert [call[0] for call in backend.sent] == ["tokenize"]  # counted, and nothing embedded
    _tei(gateway.post("/predict", json={"inputs": LONG, "model": "cls", "truncate": False}), 422, "Validation",
         "truncate is false")
    body = {"inputs": {"source_sentence": "a", "sentences": [LONG]}, "parameters": {"truncate": False}, "model": "emb"}
    _tei(gateway.post("/similarity", json=body), 422, "Validation", "inputs.sentences[0] has")
    for truncate in (True, None):  # as the export does, or its choice: nothing to check, nothing counted
        backend.sent.clear()
        assert gateway.post("/embed", json={"inputs": LONG, "model": "emb", "truncate": truncate}).status_code == 200
        assert [call[0] for call in backend.sent] == ["embed"]


def test_truncate_false_where_the_tokens_cannot_be_counted_is_refused_outright():
    gateway = _gateway()
    _tei(gateway.post("/embed", json={"inputs": "short", "model": "older", "truncate": False}), 422, "Validation",
         "truncate=false is not available for model 'older'")
    _tei(gateway.post("/rerank", json={"query": "q", "texts": ["a"], "truncate": False}), 422, "Validation",
         "truncate=false is not available for model 'ranker'")
    assert gateway.post("/rerank", json={"query": "q", "texts": ["a"], "truncate": True}).status_code == 200


def test_truncate_on_an_export_that_does_not_truncate_is_sent_on_and_truncate_must_be_a_flag():
    backend = _Backend()
    gateway = _gateway(backend=backend)
    for truncate in (True, False):  # a longer text is refused by the export itself: never a different result
        assert gateway.post("/embed", json={"inputs": LONG, "model": "whole", "truncate": truncate}).status_code == 200
    assert [call[0] for call in backend.sent] == ["embed", "embed"]
    _tei(gateway.post("/embed", json={"inputs": "x", "model": "emb", "truncate": "no"}), 422, "Validation",
         "truncate must be true or false")


# --- TEI's aliases ---------------------------------------------------------------------------------

def test_teis_aliases_embeddings_ping_and_get_root():
    gateway = _gateway()
    answer = gateway.post("/embeddings", json={"model": "emb", "input": ["a", "b"]}).json()
    assert answer["object"] == "list" and [d["index"] for d in answer["data"]] == [0, 1]
    _openai(gateway.post("/embeddings", json={"model": "nope", "input": "x"}), 404, "model_not_found")
    _openai(gateway.post("/embeddings", json={"model": "emb", "input": ["a"] * 5}), 400, "too_many_inputs")
    for path in ("/", "/ping", "/health"):
        response = gateway.get(path)
        assert response.status_code == 200 and response.json()["status"] == "ok", path
    # float32 values in their shortest form, as TEI's serde writes an f32 (the same float32 when read back)
    assert gateway.post("/", json={"inputs": "x", "model": "emb"}).json() == [[0.6, 0.8, 0.0, 0.0]]


def test_the_probes_are_open_without_the_key_and_post_root_is_not():
    gateway = _gateway(GatewayConfig(api_key="s3cret"))
    for path in ("/", "/ping", "/health"):
        assert gateway.get(path).status_code == 200, path
    _tei(gateway.post("/", json={"inputs": "x", "model": "emb"}), 401, "Validation", "no API key")
    response = gateway.post("/embeddings", json={"model": "emb", "input": "x"})
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"



@pytest.mark.parametrize("header, status", [
    ("Bearer k", 200), ("bearer k", 200), ("Bearer   k", 200), ("bEaReR  k", 200),  # RFC 9110: any case, 1*SP
    ("Bearer k2", 401), ("Bearer kk", 401), ("Basic k", 401), ("Bearerk", 401), ("k", 401), ("Bearer", 401),
])
def test_the_bearer_scheme_is_read_in_any_case_and_the_key_exactly(header, status):
    response = _gateway(GatewayConfig(api_key="k")).get("/v1/models", headers={"Authorization": header})
    assert response.status_code == status, response.json()


def test_admission_bounds_post_root_and_never_a_probe_on_the_same_path():
    answered = []

    async def app(scope, receive, send):
        answered.append((scope["method"], scope["path"]))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def call(method: str) -> int:
        sent = []

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": method, "path": "/", "headers": []}
        await admission(scope, None, send)
        return sent[0]["status"]

    metrics = Metrics([Route("/", app, methods=["GET", "POST"])])
    admission = AdmissionMiddleware(app, limit=1, paths=frozenset({"/"}), metrics=metrics)
    admission.in_flight = 1  # one inference request being answered
    assert asyncio.run(call("GET")) == 200 and asyncio.run(call("POST")) == 429
    assert answered == [("GET", "/")]


@pytest.mark.parametrize("model, raw_scores, score", [
    ("ranker", False, 0.5), ("ranker", True, 0.0),  # a sigmoid's score, and the logit recovered from it
    ("logit_ranker", False, 1 / (1 + np.exp(-0.5))), ("logit_ranker", True, 0.5),  # the logit served as it is
])
def test_tei_rerank_scores_are_teis_whatever_the_cross_encoders_activation(model, raw_scores, score):
    """TEI answers sigmoid(logit), or the logit with raw_scores; the stand-in serves 0.5 for every text."""
    backend = _Backend()
    # a cross-encoder whose activation is none (CrossEncoder's Identity): its served score is the logit
    backend.catalog = Catalog(ConfigTriton({**CONFIGS, "logit_ranker": _ensemble(
        "logit_ranker", "rerank", "SCORES", 1, function_to_apply="none"), "logit_ranker_tokenizer": _tokenizer()}),
        ttl_s=60)
    response = _gateway(backend=backend).post("/rerank", json={"query": "q", "texts": ["a", "b"], "model": model,
                                                "raw_scores": raw_scores})
    assert response.status_code == 200, response.json()
    assert [r["score"] for r in response.json()] == pytest.approx([score, score], abs=1e-7)


def test_similarity_names_a_too_long_sentence_by_its_own_list():
    """The source sentence counts against the inputs limit, but an error names each text in its own field."""
    long = "x" * 101
    gateway = _gateway()
    _tei(gateway.post("/similarity", json={"inputs": {"source_sentence": "a", "sentences": ["b", long]}}), 422,
         "Validation", "inputs.sentences[1] has 101 characters")
    _tei(gateway.post("/similarity", json={"inputs": {"source_sentence": long, "sentences": ["b"]}}), 422,
         "Validation", "inputs.source_sentence[0] has 101 characters")  # check_texts numbers a list of one
    _tei(gateway.post("/similarity", json={"inputs": {"source_sentence": "a", "sentences": ["b", "c", "d", "e"]}}),
         422, "Validation", "inputs has 5 items; this gateway takes at most 4")



@pytest.mark.parametrize("parameters", [0, "", [], False, 1, "x", [{"truncate": True}]])
def test_similarity_parameters_are_an_object_or_none_and_no_falsy_value_passes_as_one(parameters):
    body = {"inputs": {"source_sentence": "a", "sentences": ["b"]}, "model": "emb"}
    gateway = _gateway()
    _tei(gateway.post("/similarity", json={**body, "parameters": parameters}), 422, "Validation",
         "parameters must be an object")
    for fine in ({}, {"parameters": None}, {"parameters": {}}):
        assert gateway.post("/similarity", json={**body, **fine}).status_code == 200, fine


def test_rerank_texts_must_be_a_list_as_in_tei():
    _tei(_gateway().post("/rerank", json={"query": "q", "texts": "one document"}), 422, "Validation",
         "texts is required: a list of strings")
