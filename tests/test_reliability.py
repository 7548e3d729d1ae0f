"""Reliability on the served path: bad input, fuzzing, faults, and a safe posture.

One real Triton server (module scope, loopback, free ports) per serving path
(tests/helpers/serving_paths.py: ``nexus-sli serve``'s default, each batched
ensemble's steps joined in one process, and the steps as exported) serves a tiny
model per task, kept up as ``nexus-sli serve`` keeps it (started again if it dies:
exporter/serving/keeper.py); the fault tests kill parts of it.  Bad input is sent
through the ensembles and as raw tritonclient requests (HTTP and gRPC), and to the
tokenizer, encoder and post-processing models directly.  After every bad request
the same model must answer a valid one.  What does not depend on the path (the
steps' own models, which both paths serve, the reranking and question-answering
ensembles, which neither joins, exports, names) runs on the steps as exported only.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import random
import re
import signal
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import psutil
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.serving_paths import JOINED, PATHS, SEPARATE, joined_models, per_path, start_options
from helpers.waiting import wait_until
from helpers import task_models
from helpers.checkpoints import copy_checkpoint, edit_weights
from nexus_sli.client import (
    EncoderClient,
    InvalidInputError,
    ModelNotFoundError,
    RetryableError,
    ServerUnavailableError,
)
from nexus_sli.exporter.serving import server as serve
from nexus_sli.exporter.serving.keeper import KeptServer
from nexus_sli.exporter.serving.stub_supervisor import SHARED_MEMORY, orphaned_workers
from nexus_sli.exporter.triton import config as triton_config
from nexus_sli.cli.main import build_parser
from nexus_sli.exporter.errors import CheckpointError, NexusError
from nexus_sli.exporter.export.pipeline import ExportOptions, run_export
from nexus_sli.exporter.export.source import check_name
from nexus_sli.exporter.triton.config import MAX_BATCH_SIZE
from nexus_sli.bench.served import free_ports

TEXTS = ["the cat sat on the mat", "a storm is coming", "water boils at 100 degrees", "hello world",
         "they found water in the cellar", "short", "numbers 1 2 3", "the end"]
MB = "word " * 200_000  # 1,000,000 characters
HIDDEN, LABELS = 32, 3  # the tiny models' sizes
TIMEOUT_S = 60.0


#: The ensembles ``nexus-sli serve`` joins by default: the batched ones (not reranking, question answering)
JOINABLE = {"embedder", "classifier", "tagger", "legacy"}
#: Every ensemble of the repository, and the unknown name the bad-input matrix sends to
ENSEMBLES = [*sorted(JOINABLE), "reranker", "reader"]


@pytest.fixture(scope="module")
def repository(tmp_path_factory, tiny_tokenizer, tiny_checkpoint):
    """A tiny model per task, exported once for both serving paths: ``{"repo", "checkpoints", "root"}``."""
    root = tmp_path_factory.mktemp("reliability")
    repo = root / "repo"
    checkpoints = task_models.every_task(tiny_tokenizer, tiny_checkpoint, root)
    for name, path in checkpoints.items():  # the tiny bert is a BertModel: an embedding model
        # "legacy": the earlier embedding ensemble (tokenizer -> encoder -> python pooling), as a repository
        # exported before pooling moved into the graph; "embedder" pools in its encoder graph
        run_export(ExportOptions(model=str(path), name=name, out=repo, pool_in_graph=name != "legacy"))
    return {"repo": repo, "checkpoints": checkpoints, "root": root}


@pytest.fixture(scope="module")
def servers(repository):
    with per_path(lambda path: _serving(repository, path)) as server:
        yield server


@pytest.fixture(params=PATHS)
def served(request, servers):
    """The repository served on one path; ``served["kept"].process`` is the tritonserver running now (it changes
    when the server is started again) and ``served["start"]()`` starts it again after a test stopped it."""
    return servers(request.param)


@contextlib.contextmanager
def _serving(repository, path: str):
    ports = dict(zip(("http", "grpc", "metrics"), free_ports(3)))
    state = {**repository, "path": path, "ports": ports, "log": repository["root"] / f"{path}.log",
             "http": f"127.0.0.1:{ports['http']}", "grpc": f"127.0.0.1:{ports['grpc']}"}
    state["start"] = lambda: KeptServer(lambda: _start(state))
    state["kept"] = state["start"]()
    try:
        assert joined_models(state["http"], ENSEMBLES) == (JOINABLE if path == JOINED else set())
        yield state
    finally:
        state["kept"].stop(grace=0)  # at once: a graceful stop waits for the clients' idle connections


def _start(state):
    log = open(state["log"], "a")  # the server's whole output, checked for secrets
    try:
        return serve.start(state["repo"], state["ports"]["http"], state["ports"]["grpc"], state["ports"]["metrics"],
                           stdout=log, stderr=subprocess.STDOUT, **start_options(state["path"]))
    finally:
        log.close()


def _process(served) -> serve.TritonServer:
    """The tritonserver serving now (the keeper may have started another since the test began)."""
    return served["kept"].process


@pytest.fixture
def raw(served):
    """Plain tritonclient clients, one per protocol: no checks of ours in the way."""
    clients = {"http": httpclient.InferenceServerClient(served["http"], network_timeout=TIMEOUT_S,
                                                        connection_timeout=TIMEOUT_S),
               "grpc": grpcclient.InferenceServerClient(served["grpc"])}
    yield clients
    for client in clients.values():
        client.close()


_DATATYPES = {np.dtype(object): "BYTES", np.dtype(np.int64): "INT64", np.dtype(np.float32): "FP32",
              np.dtype(np.int32): "INT32"}


def _infer(raw, protocol, model, inputs: dict[str, np.ndarray]):
    """The response's outputs by name; tritonclient raises the server's error."""
    module = httpclient if protocol == "http" else grpcclient
    tensors = []
    for name, array in inputs.items():
        tensor = module.InferInput(name, list(array.shape), _DATATYPES[array.dtype])
        tensor.set_data_from_numpy(array, **({"binary_data": True} if protocol == "http" else {}))
        tensors.append(tensor)
    kwargs = {"client_timeout": TIMEOUT_S} if protocol == "grpc" else {}
    result = raw[protocol].infer(model, tensors, **kwargs)
    outputs = result.get_response()["outputs"] if protocol == "http" else result.get_response().outputs
    names = [o["name"] if protocol == "http" else o.name for o in outputs]
    return {name: result.as_numpy(name) for name in names}


def _bytes(items, shape=None):
    """A BYTES tensor of ``items`` (str as UTF-8, bytes as they are); ``[]`` gives shape [0]."""
    array = np.array([i if isinstance(i, bytes) else i.encode("utf-8") for i in items], dtype=object)
    return array.reshape(shape) if shape else array


def _texts(items):
    return {"TEXT": _bytes(items, (-1, 1))}


# ---------------------------------------------------------------- what a good answer looks like


def _ok_embedding(n):
    def check(out, inputs):
        assert out["EMBEDDING"].shape == (n, HIDDEN) and np.isfinite(out["EMBEDDING"]).all()
    return check


def _ok_scores(n):
    def check(out, inputs):
        scores = out["SCORES"]
        assert scores.shape == (n, LABELS) and np.allclose(scores.sum(axis=1), 1.0, atol=1e-5)
    return check


def _ok_entities(n):
    def check(out, inputs):
        texts = [t.decode("utf-8") for t in inputs["TEXT"].reshape(-1)]
        found = [json.loads(item) for item in out["ENTITIES"].reshape(-1)]
        assert len(found) == n
        for text, entities in zip(texts, found):
            assert all(e["text"] == text[e["start"]:e["end"]] for e in entities)
    return check


def _ok_answers(out, inputs):
    context = inputs["CONTEXT"].reshape(-1)[0].decode("utf-8")
    answers = json.loads(out["ANSWERS"].reshape(-1)[0])
    assert answers and all(a["text"] == context[a["start"]:a["end"]] for a in answers)


def _ok_ranking(n):
    def check(out, inputs):
        scores = out["SCORES"]
        assert scores.shape == (n,) and ((scores >= 0) & (scores <= 1)).all()
    return check


VALID = {
    "embedder": (_texts(["a valid text"]), _ok_embedding(1)),
    "classifier": (_texts(["a valid text"]), _ok_scores(1)),
    "tagger": (_texts(["Anna lives in Berlin"]), _ok_entities(1)),
    "reranker": ({"QUERY": _bytes(["q"]), "DOCUMENTS": _bytes(["doc a", "doc b"])}, _ok_ranking(2)),
    "reader": ({"QUESTION": _bytes(["what?"]), "CONTEXT": _bytes(["they found water"])}, _ok_answers),
}

# ---------------------------------------------------------------- the bad-input matrix


def _text_task_cases(model, ok):
    return [
        (model, "empty string", _texts([""]), ok(1)),
        (model, "whitespace only", _texts([" \t\n  "]), ok(1)),
        (model, "1 MB text", _texts([MB]), ok(1)),
        (model, "NUL bytes", _texts(["a\x00b\x00 c"]), ok(1)),
        (model, "invalid UTF-8", _texts([b"\xff\xfe bad"]), r"TEXT item 0 is not valid UTF-8"),
        (model, "one bad item in a batch", _texts(["fine", b"\xc3\x28", "ok"]), r"TEXT item 1 is not valid UTF-8"),
        (model, "wrong datatype", {"TEXT": np.array([[1]], dtype=np.int32)}, r"data-type is 'INT32'.*expects 'BYTES'"),
        (model, "wrong shape", {"TEXT": _bytes(["a", "b"])}, r"unexpected shape for input 'TEXT'"),
        (model, "more items than max_batch_size", _texts(["x"] * (MAX_BATCH_SIZE + 1)),
         rf"batch-size must be <= {MAX_BATCH_SIZE}"),
    ]


def _qa(question, context):
    return {"QUESTION": _bytes([question]), "CONTEXT": _bytes([context])}


def _rerank(query, documents):
    return {"QUERY": _bytes([query]), "DOCUMENTS": _bytes(documents)}


CASES = [
    *_text_task_cases("embedder", _ok_embedding),
    *_text_task_cases("classifier", _ok_scores),
    *_text_task_cases("tagger", _ok_entities),
    ("reader", "empty question", _qa("", "they found water"), _ok_answers),
    ("reader", "empty context", _qa("what?", ""), r"CONTEXT is empty"),
    ("reader", "whitespace-only context", _qa("what?", " \n\t "), r"CONTEXT is empty"),
    ("reader", "1 MB context", _qa("what?", MB),
     rf"CONTEXT is too long: it needs \d+ windows.*at most {MAX_BATCH_SIZE}"),
    ("reader", "1 MB question", _qa(MB, "water"), r"QUESTION has \d+ tokens.*at most \d+"),
    ("reader", "NUL bytes", _qa("wh\x00at?", "they\x00 found water"), _ok_answers),
    ("reader", "invalid UTF-8", {"QUESTION": _bytes(["q"]), "CONTEXT": _bytes([b"\xffwater"])},
     r"CONTEXT item 0 is not valid UTF-8"),
    ("reader", "invalid UTF-8 question", {"QUESTION": _bytes([b"\xc3\x28?"]), "CONTEXT": _bytes(["water"])},
     r"QUESTION item 0 is not valid UTF-8"),
    ("reader", "wrong datatype", {"QUESTION": np.array([1.0], dtype=np.float32), "CONTEXT": _bytes(["c"])},
     r"data-type is 'FP32'"),
    ("reader", "wrong shape", {"QUESTION": _bytes(["a", "b"]), "CONTEXT": _bytes(["c"])}, r"unexpected shape"),
    ("reranker", "no documents", _rerank("q", []), r"DOCUMENTS is empty"),
    ("reranker", "empty query and document", _rerank("", [""]), _ok_ranking(1)),
    ("reranker", "whitespace only", _rerank(" ", ["\n\t"]), _ok_ranking(1)),
    ("reranker", "1 MB document", _rerank("q", [MB, "short"]), _ok_ranking(2)),
    ("reranker", "1 MB query", _rerank(MB, ["doc"]), _ok_ranking(1)),
    ("reranker", "NUL bytes", _rerank("\x00", ["a\x00", "\x00\x00"]), _ok_ranking(2)),
    ("reranker", "invalid UTF-8 query", _rerank(b"\xff q", ["a"]), r"QUERY item 0 is not valid UTF-8"),
    ("reranker", "one bad document", _rerank("q", ["a", "b", b"\xe2\x82"]), r"DOCUMENTS item 2 is not valid UTF-8"),
    ("reranker", "more documents than max_batch_size", _rerank("q", ["d"] * (MAX_BATCH_SIZE + 1)),
     rf"DOCUMENTS has {MAX_BATCH_SIZE + 1} items and one request takes at most {MAX_BATCH_SIZE}"),
    ("reranker", "wrong datatype", {"QUERY": _bytes(["q"]), "DOCUMENTS": np.array([1, 2], dtype=np.int64)},
     r"data-type is 'INT64'"),
    ("reranker", "wrong shape", {"QUERY": _bytes(["a", "b"]), "DOCUMENTS": _bytes(["d"])}, r"unexpected shape"),
    ("no_such_model", "unknown model name", _texts(["x"]), r"unknown model: 'no_such_model' is not found"),
]


#: Each case on the paths where what answers it differs: a joinable ensemble's on both, the others' once
PATH_CASES = [(path, *case) for case in CASES for path in PATHS if path == SEPARATE or case[0] in JOINABLE]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("served, model, case, inputs, expect", PATH_CASES,
                         ids=[f"{m}: {c}-{p}" for p, m, c, _, _ in PATH_CASES], indirect=["served"])
def test_bad_input_gets_a_result_or_a_clear_error(raw, protocol, model, case, inputs, expect):
    if isinstance(expect, str):
        with pytest.raises(Exception, match=expect):
            _infer(raw, protocol, model, inputs)
    else:
        expect(_infer(raw, protocol, model, inputs), inputs)
    valid_model = model if model in VALID else "embedder"
    valid_inputs, check = VALID[valid_model]
    check(_infer(raw, protocol, valid_model, valid_inputs), valid_inputs)  # the server still serves


def _ids(rows, vocab_id=5):
    ids = np.full((1, rows), vocab_id, dtype=np.int64)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}


def _all_nan(name: str, shape: tuple):
    """The step answered ``name`` with this shape, every value NaN: NaN in, NaN out
    (docs/reliability.md: "NaN scores"), never a plausible-looking made-up value."""
    def check(outputs):
        assert list(outputs) == [name] and outputs[name].shape == shape, {k: v.shape for k, v in outputs.items()}
        assert np.isnan(outputs[name]).all(), outputs[name]
    return check


def _entities_sliced_from_hi(outputs):
    """Both real tokens are tagged B-PER, so each is its own entity; offsets outside
    "hi" give the text Python's slice gives (docs/reliability.md: "empty entity text")."""
    assert outputs["ENTITIES"].shape == (1, 1)
    found = json.loads(outputs["ENTITIES"].reshape(-1)[0])
    assert [(e["label"], e["text"]) for e in found] == [("PER", "hi"), ("PER", "")], found


#: tagger logits that pick label 1 (B-PER in task_models.NER_LABELS) for every token
B_PER = np.tile(np.eye(len(task_models.NER_LABELS), dtype=np.float32)[task_models.NER_LABELS.index("B-PER")] * 10,
                (1, 3, 1))


STEP_CASES = [
    ("embedder_encoder", "token id outside the vocabulary", {**_ids(4), "input_ids": np.array([[2, 10**9, 3, 0]])},
     r"the encoder failed on this request"),
    ("embedder_encoder", "inputs of different lengths", {**_ids(4), "attention_mask": np.ones((1, 2), np.int64)},
     r"inputs must all have one shape"),
    ("embedder_tokenizer", "invalid UTF-8", _texts([b"ok", b"\x80"]), r"TEXT item 1 is not valid UTF-8"),
    ("legacy_postprocess", "mask for fewer tokens than the states",
     {"last_hidden_state": np.ones((1, 4, HIDDEN), np.float32), "attention_mask": np.ones((1, 2), np.int64)},
     r"embedding post-processing failed for this request"),
    ("legacy_postprocess", "NaN states", {"last_hidden_state": np.full((1, 4, HIDDEN), np.nan, np.float32),
                                            "attention_mask": np.ones((1, 4), np.int64)},
     _all_nan("EMBEDDING", (1, HIDDEN))),
    ("classifier_postprocess", "infinite logits", {"logits": np.array([[np.inf, -np.inf, np.nan]], np.float32)},
     _all_nan("SCORES", (1, 3))),
    ("tagger_postprocess", "offsets outside the text",
     {"TEXT": _texts(["hi"])["TEXT"], "logits": B_PER,
      "offsets": np.array([[[0, 0], [-7, 5000], [9, 2]]]), "attention_mask": np.ones((1, 3), np.int64),
      "special_tokens_mask": np.array([[1, 0, 0]])},
     _entities_sliced_from_hi),
    ("reader_postprocess", "more logit rows than offsets",
     {"CONTEXT": _bytes(["hello world"]), "start_logits": np.zeros((2, 3), np.float32),
      "end_logits": np.zeros((2, 3), np.float32), "offsets": np.zeros((1, 3, 2), np.int64),
      "context_mask": np.ones((1, 3), np.int64), "word_spans": np.zeros((1, 3, 2), np.int64)},
     r"question-answering post-processing failed for this request"),
    ("embedder_encoder", "negative token id", {**_ids(4), "input_ids": np.array([[2, -1, 3, 0]])},
     r"input_ids holds a negative token id \(-1\)"),
]


@pytest.mark.parametrize("served", [SEPARATE], indirect=True)  # the step models are served alike on both paths
@pytest.mark.parametrize("model, case, inputs, expect", STEP_CASES, ids=[f"{m}: {c}" for m, c, _, _ in STEP_CASES])
def test_step_models_answer_bad_raw_requests(raw, model, case, inputs, expect):
    """The ensemble's steps are reachable too: bad tensors get an error or a defined (if meaningless) result."""
    if callable(expect):
        expect(_infer(raw, "http", model, inputs))
    else:
        with pytest.raises(Exception, match=expect):
            _infer(raw, "http", model, inputs)
    valid_inputs, check = VALID["embedder"]
    check(_infer(raw, "grpc", "embedder", valid_inputs), valid_inputs)


def test_bad_requests_do_not_fail_the_requests_batched_with_them(served, raw):
    """Dynamic batching puts requests of different senders into one execution:
    only the bad ones may fail, and every good one gets its own text's answer.  The
    bad ones go to the steps, and to the ensemble the good ones go to (the joined
    model, on that path)."""
    with EncoderClient(served["grpc"]) as client:
        expected = {t: client.embed(t, model="embedder") for t in TEXTS}
    bad = [("embedder_encoder", STEP_CASES[0][2]), ("embedder_tokenizer", STEP_CASES[2][2]),
           ("legacy_postprocess", STEP_CASES[3][2]), ("embedder", _texts(["fine", b"\xc3\x28"]))]

    def send_bad(i):  # over gRPC: tritonclient's HTTP client is not for sharing between threads
        model, inputs = bad[i % len(bad)]
        with pytest.raises(Exception, match="this request|not valid UTF-8"):
            _infer(raw, "grpc", model, inputs)

    def send_good(i):
        with EncoderClient(served["grpc"]) as client:
            text = TEXTS[i % len(TEXTS)]
            return text, client.embed(text, model="embedder")

    with ThreadPoolExecutor(16) as pool:
        bad_futures = [pool.submit(send_bad, i) for i in range(60)]
        good = list(pool.map(send_good, range(160)))
    for future in bad_futures:
        future.result()
    for text, vector in good:
        assert np.allclose(vector, expected[text], atol=1e-5), text


def test_client_reports_bad_input_clearly(served):
    with EncoderClient(served["grpc"]) as client, EncoderClient(served["http"], protocol="http") as http:
        for c in (client, http):
            assert c.embed(["", " \n ", MB, "a\x00b"], model="embedder").shape == (4, HIDDEN)
            assert c.embed(TEXTS * 20, model="embedder").shape == (len(TEXTS) * 20, HIDDEN)  # > max_batch_size: split
            with pytest.raises(InvalidInputError, match=r"texts\[1\] cannot be sent as UTF-8"):
                c.embed(["fine", "lone \ud800 surrogate"], model="embedder")
            with pytest.raises(InvalidInputError, match="context is empty"):
                c.answer("what?", " ", model="reader")
            with pytest.raises(InvalidInputError, match="CONTEXT is too long"):
                c.answer("what?", MB, model="reader")
            with pytest.raises(InvalidInputError, match="QUESTION has"):
                c.answer(MB, "water", model="reader")
            with pytest.raises(ModelNotFoundError, match="no_such_model"):
                c.embed("x", model="no_such_model")
            assert c.rerank("q", [], model="reranker") == []
            assert len(c.rerank("q", ["d"] * 150, model="reranker")) == 150  # chunked below max_batch_size
            assert c.answer("what?", "they found water", model="reader")[0].text == "water"


# ---------------------------------------------------------------- fuzzing

_ANY_TEXT = st.one_of(st.binary(max_size=400), st.text(max_size=400))
#: Errors the tokenizer may give a random input; anything else is a bug.
_CLEAR_ERRORS = re.compile(r"is not valid UTF-8|CONTEXT is empty|QUESTION has \d+ tokens|CONTEXT is too long")
FUZZ_SETTINGS = settings(max_examples=260, deadline=None, database=None,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _first_invalid(items):
    for index, item in enumerate(items):
        if isinstance(item, bytes):
            try:
                item.decode("utf-8")
            except UnicodeDecodeError:
                return index
    return None


def _expect_clear(raw, model, inputs, invalid: tuple[str, int] | None):
    """A success, or one of the tokenizer's clear errors; invalid UTF-8 must be refused, and named."""
    try:
        out = _infer(raw, "http", model, inputs)
    except Exception as exc:  # noqa: BLE001 - what it says is what is checked
        message = str(exc)
        assert _CLEAR_ERRORS.search(message), message
        if invalid is not None:
            assert f"{invalid[0]} item {invalid[1]} is not valid UTF-8" in message, message
        return None
    assert invalid is None, f"{invalid[0]} item {invalid[1]}, not valid UTF-8, was accepted"
    return out


@pytest.mark.parametrize("served", [SEPARATE], indirect=True)  # the tokenizer models, served alike on both paths
def test_fuzz_tokenizer_models(served, raw):
    """Random bytes and random Unicode, eight items per request, to the three tokenizer modes."""
    sent = []

    @FUZZ_SETTINGS
    @given(st.lists(_ANY_TEXT, min_size=8, max_size=8))
    def check(items):
        bad = _first_invalid(items)
        out = _expect_clear(raw, "embedder_tokenizer", _texts(items), ("TEXT", bad) if bad is not None else None)
        if bad is None:
            assert out["input_ids"].shape[0] == len(items) and out["attention_mask"].shape == out["input_ids"].shape
        query, documents = items[0], items[1:]
        bad_query, bad_doc = _first_invalid([query]), _first_invalid(documents)
        named = ("QUERY", 0) if bad_query is not None else ("DOCUMENTS", bad_doc) if bad_doc is not None else None
        _expect_clear(raw, "reranker_tokenizer", _rerank(query, documents), named)
        bad_q, bad_c = _first_invalid([items[0]]), _first_invalid([items[1]])
        named = ("QUESTION", 0) if bad_q is not None else ("CONTEXT", 0) if bad_c is not None else None
        _expect_clear(raw, "reader_tokenizer", _qa(items[0], items[1]), named)
        sent.append(len(items))

    check()
    assert sum(sent) >= 2000, f"only {sum(sent)} fuzz cases ran"
    _assert_no_worker_died(served)


def test_fuzz_ensembles_and_post_processing(served, raw):
    """Random Unicode through the ensembles, and random bytes with random logits and
    offsets straight into the post-processing models that read text."""
    sent = []

    @FUZZ_SETTINGS
    @given(st.lists(st.text(max_size=400), min_size=8, max_size=8), st.lists(_ANY_TEXT, min_size=8, max_size=8),
           st.integers(0, 2**32 - 1))
    def check(texts, any_texts, seed):
        inputs = _texts(texts)
        _ok_embedding(8)(_infer(raw, "grpc", "embedder", inputs), inputs)
        _ok_entities(8)(_infer(raw, "grpc", "tagger", inputs), inputs)
        rng = np.random.default_rng(seed)
        length = int(rng.integers(1, 40))
        tagged = _infer(raw, "http", "tagger_postprocess", {
            "TEXT": _texts(any_texts)["TEXT"], "logits": rng.normal(0, 5, (8, length, 5)).astype(np.float32),
            "offsets": rng.integers(-3, 420, (8, length, 2)), "attention_mask": rng.integers(0, 2, (8, length)),
            "special_tokens_mask": rng.integers(0, 2, (8, length))})
        assert len(tagged["ENTITIES"].reshape(-1)) == 8
        assert all(isinstance(json.loads(item), list) for item in tagged["ENTITIES"].reshape(-1))
        windows = int(rng.integers(1, 4))
        answered = _infer(raw, "http", "reader_postprocess", {
            "CONTEXT": _bytes([any_texts[0]]),
            "start_logits": rng.normal(0, 5, (windows, length)).astype(np.float32),
            "end_logits": rng.normal(0, 5, (windows, length)).astype(np.float32),
            "offsets": rng.integers(-3, 420, (windows, length, 2)),
            "context_mask": rng.integers(0, 2, (windows, length)),
            "word_spans": rng.integers(-3, 420, (windows, length, 2))})
        assert isinstance(json.loads(answered["ANSWERS"].reshape(-1)[0]), list)
        sent.append(len(texts) + len(any_texts))

    check()
    assert sum(sent) >= 2000, f"only {sum(sent)} fuzz cases ran"
    _assert_no_worker_died(served)


def _assert_no_worker_died(served):
    supervisor = _process(served).supervisor
    assert not supervisor.restarts, f"a python-backend worker died and was restarted: {supervisor.restarts}"
    assert not served["kept"].restarts and _process(served).poll() is None


# ---------------------------------------------------------------- faults


def _kill_export_at(command, delay):
    """Run an export and SIGKILL it ``delay`` seconds after it started (or let it finish first)."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        process.wait(delay)
        return False
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGKILL)
        process.wait()
        return True


class _Prober(threading.Thread):
    """Embeds ``TEXTS`` again and again through one client; records what came back."""

    def __init__(self, url, protocol="grpc", model="embedder", **options):
        super().__init__(daemon=True)
        self.client = EncoderClient(url, protocol=protocol, **options)
        self.model = model
        self.stopping = threading.Event()
        #: (when the call was sent, its vectors or exception): a call sent before a fault was mended may fail
        #: after it, having met the fault (a slow machine answers it late); one sent after it must not
        self.results: list[tuple[float, object]] = []
        #: the longest call, in seconds
        self.slowest = 0.0

    def run(self):
        while not self.stopping.is_set():
            started = time.monotonic()
            try:
                self.results.append((started, self.client.embed(TEXTS, model=self.model)))
            except Exception as exc:  # noqa: BLE001 - recorded and checked by the test
                self.results.append((started, exc))
                time.sleep(0.05)
            self.slowest = max(self.slowest, time.monotonic() - started)

    def finish(self):
        self.stopping.set()
        self.join(TIMEOUT_S)
        self.client.close()
        return self.results


def _snapshot(repo):
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in repo.rglob("*")}


@pytest.mark.parametrize("served", [JOINED], indirect=True)  # exports and a restart: alike on both paths
def test_killed_exports_while_serving_then_restart_on_the_same_ports(served):
    """SIGKILLed re-exports of a served model: it keeps answering, the repository
    still loads when the server restarts on the same ports, and clients created
    before the restart work again (with retryable errors while it is down)."""
    repo, checkpoint = served["repo"], served["checkpoints"]["embedder"]
    with EncoderClient(served["grpc"]) as client:
        reference = client.embed(TEXTS, model="embedder")
    command = [sys.executable, "-m", "nexus_sli.cli.main", "export", "--model", str(checkpoint),
               "--name", "embedder", "--task", "embedding", "--backend", "onnxruntime", "--precision", "fp32",
               "--out", str(repo)]  # the served model's configuration, whatever this CPU's default is
    prober = _Prober(served["grpc"])
    prober.start()
    started = time.monotonic()
    assert not _kill_export_at(command, 600), "a complete re-export while serving"
    duration = time.monotonic() - started
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    delays, killed = [], []
    for _ in range(3):
        delays.append(rng.uniform(0.2, duration))
        begun = time.monotonic()
        killed.append(_kill_export_at(command, delays[-1]))
        if not killed[-1]:  # it finished first (a less loaded machine): the next kill is drawn inside its time
            duration = time.monotonic() - begun
    results = prober.finish()
    failures = [r for _, r in results if isinstance(r, Exception)]
    assert not failures, f"the served model failed while exports were killed (seed {seed}): {failures[:3]}"
    assert len(results) > 10 and all(np.allclose(r, reference, atol=1e-5) for _, r in results)
    assert any(killed), f"no export was killed (delays {delays}, seed {seed})"
    for model in ("embedder", "embedder_tokenizer", "embedder_encoder"):
        triton_config.read(repo / model / "config.pbtxt")
    assert not (repo / "embedder_postprocess").exists()  # its encoder graph pools
    assert not [p for p in repo.iterdir() if p.name.startswith(".")], "nothing of a dead export inside OUT"

    grpc_client, http_client = EncoderClient(served["grpc"]), EncoderClient(served["http"], protocol="http")
    assert np.allclose(grpc_client.embed(TEXTS, model="embedder"), reference, atol=1e-5)
    served["kept"].stop()
    for client in (grpc_client, http_client):
        client.retry_s = 1.0  # a server that stays down: the error once the retry budget is spent
        started = time.monotonic()
        with pytest.raises(ServerUnavailableError, match="unreachable.*retry") as caught:
            client.embed(TEXTS, model="embedder")
        assert isinstance(caught.value, RetryableError) and time.monotonic() - started >= 1.0
    served["kept"] = served["start"]()  # same repository, same ports
    for client in (grpc_client, http_client):  # gRPC reconnects on its own within about a second
        vectors = wait_until(lambda: _embedded_or_none(client), "the client to recover after the server came back",
                             timeout=30)
        assert np.allclose(vectors, reference, atol=1e-5)
        client.close()


def _embedded_or_none(client):
    """The client's answer, or None while the server it reconnects to is not back yet."""
    try:
        return client.embed(TEXTS, model="embedder")
    except RetryableError:
        return None


#: The workers the fault tests kill, per path (path, ensemble, the model the worker serves): with the steps
#: separate, every python-backend step of an ensemble (the legacy export has the post-processing step); joined,
#: the one process that runs all of the embedder's steps
VICTIMS = [(SEPARATE, "embedder", "embedder_tokenizer"), (SEPARATE, "embedder", "embedder_encoder"),
           (SEPARATE, "legacy", "legacy_postprocess"), (JOINED, "embedder", "embedder")]
#: The worker that runs the embedder's encoder, per path
ENCODER_WORKER = {SEPARATE: "embedder_encoder", JOINED: "embedder"}
#: Concurrent clients while a worker is killed
CLIENTS = 16
#: A retry budget that outlasts tritonserver started again (the keeper) on a loaded machine.  A worker's SIGKILL
#: can abort the whole server, on either path (Triton 2.51's python backend: docs/reliability.md, and the rate in
#: bench/data/tried.md, "A killed joined worker under load"; a separate tokenizer's did once in a fresh-clone
#: run, whose restart outlasted the client's default 15 s), so the fault tests' clients retry this long: a call
#: then fails neither way, and the tests hold whichever way the server went.
OUTLAST_RESTART_S = 90.0


def _kill_under_load(served, model: str, probers: list) -> tuple[list, float, float]:
    """Start ``probers``, SIGKILL a worker of ``model`` once they all got answers, wait for the supervisor's
    reload (or for the keeper to start tritonserver again, where the kill aborted it) and for every prober to be
    answered after it; (results, killed, recovered)."""
    kept = served["kept"]
    supervisor = kept.process.supervisor
    for prober in probers:
        prober.start()
    wait_until(lambda: all(prober.results for prober in probers), "every prober to get an answer", TIMEOUT_S)
    reloads, starts = len(supervisor.restarts), len(kept.restarts)
    victim = supervisor.stub_processes()[model][0]
    killed_at = time.monotonic()
    victim.kill()
    wait_until(lambda: len(supervisor.restarts) > reloads or len(kept.restarts) > starts,
               f"{model} to be reloaded (or tritonserver started again)", OUTLAST_RESTART_S)
    recovered_at = time.monotonic()
    wait_until(lambda: all(any(t > recovered_at + 1.0 and not isinstance(r, Exception) for t, r in prober.results)
                           for prober in probers), "every prober to be answered again after the reload", TIMEOUT_S)
    results = [r for prober in probers for r in prober.finish()]
    assert [m for _, m in supervisor.restarts[reloads:]] == ([model] if len(kept.restarts) == starts else [])
    assert not victim.is_running() or victim.status() == psutil.STATUS_ZOMBIE
    return results, killed_at, recovered_at


def _probers(served, model: str, count: int, **options) -> list:
    return [_Prober(served["grpc" if i % 2 else "http"], "grpc" if i % 2 else "http", model, **options)
            for i in range(count)]


@pytest.mark.parametrize("served, ensemble, model", VICTIMS, indirect=["served"],
                         ids=[f"{m}-{p}" for p, _, m in VICTIMS])
def test_killed_worker_costs_latency_not_failed_calls(served, ensemble, model):
    """A python-backend process killed under 16 concurrent clients that retry for as long as a restart takes
    (:data:`OUTLAST_RESTART_S`): no call fails; the calls that met the dead worker are answered after the reload,
    correctly."""
    with EncoderClient(served["grpc"]) as client:
        reference = client.embed(TEXTS, model=ensemble)
    probers = _probers(served, ensemble, CLIENTS, retry_s=OUTLAST_RESTART_S)
    results, killed_at, recovered_at = _kill_under_load(served, model, probers)
    errors = [r for _, r in results if isinstance(r, Exception)]
    assert not errors, f"{len(errors)} calls failed, first: {errors[0]!r}"
    assert all(np.allclose(r, reference, atol=1e-5) for _, r in results)
    slowest = max(p.slowest for p in probers)
    # the calls that met the dead worker waited for the reload: the fault cost them latency
    assert slowest >= (recovered_at - killed_at) * 0.5, (slowest, recovered_at - killed_at)
    print(f"{model}: killed, served again after {recovered_at - killed_at:.1f} s; {len(results)} calls, "
          f"0 failed, slowest {slowest:.1f} s; tritonserver started again {len(served['kept'].restarts)} times")


@pytest.mark.parametrize("served, ensemble, model", VICTIMS, indirect=["served"],
                         ids=[f"{m}-{p}" for p, _, m in VICTIMS])
def test_killed_worker_without_retries_gives_clear_retryable_errors(served, ensemble, model, caplog):
    """The same fault with retries off (``retry_s=0``): requests meanwhile fail with a clear,
    retryable error, the server reloads the model, and answers are right again."""
    caplog.set_level(logging.INFO, logger="nexus_sli")
    with EncoderClient(served["grpc"]) as client:
        reference = client.embed(TEXTS, model=ensemble)
    probers = _probers(served, ensemble, 6, retry_s=0)
    results, killed_at, recovered_at = _kill_under_load(served, model, probers)
    errors = [r for _, r in results if isinstance(r, Exception)]
    assert errors, "no request met the dead worker"
    for error in errors:
        assert isinstance(error, RetryableError) and "retry" in str(error), repr(error)
    later = [r for t, r in results if t > recovered_at + 1.0]
    assert later and not [r for r in later if isinstance(r, Exception)]
    differences = [float(np.abs(r - reference).max()) for r in later]
    assert all(np.allclose(r, reference, atol=1e-5) for r in later), f"largest differences: {sorted(differences)[-3:]}"
    print(f"{model}: killed, served again after {recovered_at - killed_at:.1f} s; {len(errors)} retryable "
          f"errors, {len(results) - len(errors)} answers")
    process = _process(served)
    secret = process.supervisor._key
    assert secret not in served["log"].read_text() and secret not in caplog.text
    assert secret not in repr(process) and secret not in " ".join(process.args)


class _SdkProber(threading.Thread):
    """Embeds through the gateway with the official ``openai`` SDK; records each call's status."""

    def __init__(self, url: str, max_retries: int):
        super().__init__(daemon=True)
        import openai

        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=max_retries,
                                    timeout=OUTLAST_RESTART_S + TIMEOUT_S)
        self.stopping = threading.Event()
        self.results: list[tuple[float, object]] = []  # (when sent, 200 or the exception), as _Prober's

    def run(self):
        while not self.stopping.is_set():
            started = time.monotonic()
            try:
                response = self.client.embeddings.create(model="embedder", input=TEXTS)
                self.results.append((started, 200 if len(response.data) == len(TEXTS) else "short"))
            except Exception as exc:  # noqa: BLE001 - recorded and checked by the test
                self.results.append((started, exc))
                time.sleep(0.05)

    def finish(self):
        self.stopping.set()
        self.join(TIMEOUT_S)
        return self.results


def _gateway_calls_under_fault(served, log, max_retries: int, *gateway_args: str) -> list:
    """SIGKILL of the worker that runs the embedder's encoder under 16 clients of the ``openai`` SDK through a
    gateway: every call's result (200, or the SDK's exception)."""
    from nexus_sli.bench.served import Gateway

    with Gateway(served["grpc"], *gateway_args, timeout_s=120, log=log) as gateway:
        probers = [_SdkProber(gateway.url, max_retries) for _ in range(CLIENTS)]
        results, _, _ = _kill_under_load(served, ENCODER_WORKER[served["path"]], probers)
    return [r for _, r in results]


def test_killed_encoder_worker_through_the_gateway_is_503s_never_404s(served, tmp_path):
    """Every retry off (the SDK's and the gateway's): the gateway's own answers while the model reloads
    are 503s with Retry-After, never the 404 ``model_not_found`` no client retries."""
    import openai

    failed = [r for r in _gateway_calls_under_fault(served, tmp_path / "gw.log", 0, "--triton-retry", "0")
              if r != 200]
    assert failed, "no request met the dead worker"
    for error in failed:
        assert isinstance(error, openai.APIStatusError) and error.status_code == 503, repr(error)
        assert error.response.headers.get("retry-after") == "5", dict(error.response.headers)


def test_killed_encoder_worker_through_the_gateway_fails_no_call_with_retries(served, tmp_path):
    """The SDK's default retries (``max_retries=2``) and the gateway's, for as long as a restart takes
    (:data:`OUTLAST_RESTART_S`): the fault costs latency only."""
    import openai

    results = _gateway_calls_under_fault(served, tmp_path / "gw.log", openai.DEFAULT_MAX_RETRIES,
                                         "--triton-retry", str(OUTLAST_RESTART_S))
    failed = [r for r in results if r != 200]
    assert results and not failed, f"{len(failed)} of {len(results)} calls failed, first: {failed[0]!r}"


@pytest.mark.parametrize("served", [JOINED], indirect=True)  # the keeper is the same on both paths
def test_an_aborted_tritonserver_is_started_again_and_retrying_clients_carry_over(served):
    """tritonserver ended by SIGABRT (as the python backend's abort ends it) under 8 clients that retry longer
    than a start takes: the keeper starts it again on the same ports and repository, no call fails, answers are
    right, and nothing of the dead server is left: its workers, their shared memory, its dead workers."""
    kept, old = served["kept"], _process(served)
    # every worker killed before (the tests above) is still a zombie of this server: one per reload
    assert old.supervisor.dead_workers() == len(old.supervisor.restarts)
    with EncoderClient(served["grpc"]) as client:
        reference = client.embed(TEXTS, model="embedder")
    probers = _probers(served, "embedder", 8, retry_s=OUTLAST_RESTART_S)
    for prober in probers:
        prober.start()
    wait_until(lambda: all(prober.results for prober in probers), "every prober to get an answer", TIMEOUT_S)
    starts, regions = len(kept.restarts), set(old.supervisor.regions)
    aborted_at = time.monotonic()
    os.kill(old.pid, signal.SIGABRT)
    wait_until(lambda: len(kept.restarts) > starts, "tritonserver to be started again", OUTLAST_RESTART_S)
    started_at = time.monotonic()
    wait_until(lambda: all(any(t > started_at and not isinstance(r, Exception) for t, r in prober.results)
                           for prober in probers), "every prober to be answered by the new server", TIMEOUT_S)
    results = [r for prober in probers for r in prober.finish()]
    errors = [r for _, r in results if isinstance(r, Exception)]
    assert not errors, f"{len(errors)} calls failed, first: {errors[0]!r}"
    assert all(np.allclose(r, reference, atol=1e-5) for _, r in results)
    assert "exited by itself" in kept.restarts[-1][1] and _process(served).pid != old.pid
    assert regions and not [r for r in regions if (SHARED_MEMORY / r).exists()], "the dead server's shared memory"
    assert not orphaned_workers(old.pid)
    assert _process(served).supervisor.dead_workers() == 0
    print(f"tritonserver aborted, started again after {started_at - aborted_at:.1f} s; {len(results)} calls, "
          f"0 failed, slowest {max(p.slowest for p in probers):.1f} s")


class _Sleeper(subprocess.Popen):
    """A stand-in for tritonserver: a process that waits, with a supervisor that counts ``dead`` zombies."""

    def __init__(self, dead: list[int]):
        super().__init__(["sleep", "600"])
        self.supervisor = type("Counts", (), {"dead_workers": lambda _: dead[0], "stop": lambda _: None})()


def test_the_keeper_starts_the_server_again_when_it_dies_or_holds_too_many_dead_workers_within_a_limit():
    dead, launched = [0], []
    kept = KeptServer(lambda: launched.append(_Sleeper(dead)) or launched[-1], max_dead_workers=3,
                      max_restarts=3, interval=0.05)
    try:
        launched[0].kill()  # dies by itself
        wait_until(lambda: len(kept.restarts) == 1, "a start after the server died", 10)
        assert kept.restarts[-1][1] == "exited by itself (signal 9)" and kept.process is launched[1]
        dead[0] = 3  # the supervisor of the new one counts 3 zombies: stopped cleanly, then started again
        wait_until(lambda: len(kept.restarts) == 2, "a start after too many dead workers", 10)
        assert "holds 3 dead" in kept.restarts[-1][1] and launched[1].returncode == -signal.SIGTERM
        dead[0] = 0
        kept.process.kill()  # the third start within the window: allowed
        wait_until(lambda: len(kept.restarts) == 3, "a third start", 10)
        dead[0] = 3  # a fourth start is not allowed within the window: it serves on with its dead workers
        time.sleep(0.5)
        assert len(kept.restarts) == 3 and kept.process.poll() is None and kept.poll() is None
        kept.process.kill()  # and when it dies, it is left down, and its exit code is the keeper's
        assert kept.wait(10) == -signal.SIGKILL and len(launched) == 4
    finally:
        kept.stop(grace=0)
    assert all(process.poll() is not None for process in launched)


def _truncate(directory):
    """Cut model.safetensors in the middle of its tensor data; the tensors cut off, by name."""
    path = directory / "model.safetensors"
    data = path.read_bytes()
    (header_length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + header_length])
    keep = (len(data) - 8 - header_length) // 2
    path.write_bytes(data[:8 + header_length + keep])
    return sorted(k for k, v in header.items() if k != "__metadata__" and v["data_offsets"][1] > keep)


BAD_CHECKPOINTS = {
    "missing": (lambda d: edit_weights(d, lambda t: t.pop("encoder.layer.1.output.dense.bias")),
                r"missing encoder\.layer\.1\.output\.dense\.bias"),
    "mismatched": (lambda d: edit_weights(d, lambda t: t.update({"encoder.layer.0.intermediate.dense.bias": torch.zeros(7)})),
                   r"encoder\.layer\.0\.intermediate\.dense\.bias: checkpoint \(7,\)"),
    "truncated": (_truncate, r"model\.safetensors is not a readable safetensors file"),
}


@pytest.mark.parametrize("served", [SEPARATE], indirect=True)  # an export: alike on both paths
@pytest.mark.parametrize("kind", BAD_CHECKPOINTS)
def test_bad_checkpoint_fails_the_export_and_changes_nothing_in_out(served, kind, tmp_path):
    """Exported into the served repository under the served model's name: the
    export fails with an error naming what is wrong, and OUT is untouched."""
    repo = served["repo"]
    before = _snapshot(repo)
    damage, named = BAD_CHECKPOINTS[kind]
    directory = copy_checkpoint(served["checkpoints"]["embedder"], tmp_path)
    damage(directory)
    with pytest.raises(CheckpointError, match=named):
        run_export(ExportOptions(model=str(directory), name="embedder", task="embedding", out=repo))
    assert _snapshot(repo) == before
    assert not list(repo.parent.glob(f".{repo.name}.staging-{os.getpid()}-*")), "the failed export's staging is gone"
    with EncoderClient(served["grpc"]) as client:
        assert client.embed("still served", model="embedder").shape == (HIDDEN,)


def test_truncated_checkpoint_error_names_the_tensors_cut_off(repository, tmp_path):
    directory = copy_checkpoint(repository["checkpoints"]["embedder"], tmp_path)
    cut_off = _truncate(directory)
    with pytest.raises(CheckpointError) as caught:
        run_export(ExportOptions(model=str(directory), name="truncated", task="embedding", out=tmp_path / "out"))
    assert cut_off[-1] in str(caught.value)


# ---------------------------------------------------------------- safe posture

TRAVERSAL_NAMES = ["../escape", "..", ".", "a/b", "/etc/passwd", "a\\b", "", " ", "two words", "x\x00y", "-rf",
                   ".hidden", "~user", "n\u00e4me", "a" * 101, "name.with.dots", "$(touch pwned)"]


@pytest.mark.parametrize("name", [
    *TRAVERSAL_NAMES,
    "trailing\n",
])
def test_unsafe_model_names_are_rejected(name):
    with pytest.raises(NexusError, match="invalid model name"):
        check_name(name)


@pytest.mark.parametrize("name", ["../escape", "/tmp/escape", "a/../../escape"])
def test_export_with_a_path_for_a_name_writes_nothing(name, tmp_path):
    out = tmp_path / "deep" / "repo"
    with pytest.raises(NexusError, match="invalid model name"):
        run_export(ExportOptions(name=name, out=out))
    assert not (tmp_path / "deep").exists() and not (tmp_path / "escape").exists()


@pytest.mark.parametrize("served", [SEPARATE], indirect=True)  # the same flags on both paths
def test_server_binds_loopback_and_model_control_is_off_for_users(served):
    assert build_parser().parse_args(["serve"]).host == "127.0.0.1"
    listening = {c.laddr for c in psutil.Process(_process(served).pid).net_connections("inet")
                 if c.status == psutil.CONN_LISTEN}
    assert {port for _, port in listening} == set(served["ports"].values())
    assert all(ipaddress.ip_address(ip.removeprefix("::ffff:")).is_loopback for ip, _ in listening), listening
    base = f"http://{served['http']}/v2"
    closed = [("POST", "/repository/index"), ("POST", "/repository/models/embedder_tokenizer/unload"),
              ("POST", "/repository/models/embedder/load"), ("GET", "/systemsharedmemory/status"),
              ("POST", "/systemsharedmemory/region/r/register"), ("GET", "/trace/setting"), ("POST", "/logging")]
    for method, path in closed:
        for headers in ({}, {serve.ADMIN_HEADER: "guess"}):
            request = urllib.request.Request(base + path, data=b"{}" if method == "POST" else None, method=method,
                                             headers=headers)
            with pytest.raises(urllib.error.HTTPError) as caught:
                urllib.request.urlopen(request, timeout=10)
            assert caught.value.code == 403, path
    with grpcclient.InferenceServerClient(served["grpc"]) as client:
        for call in (lambda: client.unload_model("embedder_tokenizer"), client.get_model_repository_index,
                     client.get_system_shared_memory_status, client.get_log_settings):
            with pytest.raises(Exception, match="restricted"):
                call()
        assert client.get_inference_statistics("embedder")  # what the client and the benchmarks use stays open
    with EncoderClient(served["grpc"]) as client:
        assert client.embed("still served", model="embedder").shape == (HIDDEN,)
    plain = serve.server_command(served["repo"], 1, 2, 3, backend_dir=served["repo"].parent / "backends").argv
    assert "--model-control-mode=none" in plain
    with pytest.raises(ValueError, match="admin key"):
        serve.server_command(served["repo"], 1, 2, 3, reload_models=True)


def test_remote_code_in_a_checkpoint_is_never_run(repository, tmp_path):
    directory = copy_checkpoint(repository["checkpoints"]["embedder"], tmp_path)
    marker = tmp_path / "remote-code-ran"
    (directory / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    config = json.loads((directory / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel",
                          "AutoTokenizer": ["evil.EvilTokenizer", None]}
    (directory / "config.json").write_text(json.dumps(config))
    run_export(ExportOptions(model=str(directory), name="no_remote_code", task="embedding", out=tmp_path / "out"))
    assert not marker.exists()


def test_hub_token_never_reaches_the_output(tmp_path):
    token = "hf_nexusSliTestToken0123456789abcdef"
    result = subprocess.run(
        [sys.executable, "-m", "nexus_sli.cli.main", "export", "--model", "nexus-sli-test/no-such-model",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "HF_TOKEN": token})
    assert result.returncode == 2 and "nexus-sli: error" in result.stderr
    assert token not in result.stdout + result.stderr
