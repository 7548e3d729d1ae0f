"""The gateway's bounds on what one caller can make it hold (its metrics' label sets, the tensors /decode sends
the tokenizer step), its retries of a Triton that is not there, and how ``nexus-sli serve`` starts it.  Without
Triton: a real app over test_gateway_requests' stand-in backend; the real backend's decode over a stand-in
tokenizer call; and the real backend over a port nothing listens on, or a gRPC stand-in of the tokenizer step."""

from __future__ import annotations

import argparse
import ast
import asyncio
import importlib.util
import json
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
from starlette.testclient import TestClient
from test_gateway_requests import _Backend, _gateway, _tokens
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

import nexus_sli.gateway
from nexus_sli.client import ServerUnavailableError
from nexus_sli.client.error_codes import TOKENS_OUTPUT
from nexus_sli.gateway import REQUIRED_MODULES, GatewayConfig, create_app
from nexus_sli.gateway import backend as gateway_backend
from nexus_sli.gateway.discovery import Catalog


def test_a_method_no_route_has_is_counted_as_other_so_callers_cannot_grow_the_label_set():
    """A method is any token a client sends; before the key is checked, each new one would be a new series."""
    gateway = _gateway(GatewayConfig(api_key="k"))
    for index in range(3):
        assert gateway.request(f"SCAN{index}", "/embed").status_code == 401  # refused, and still counted
    assert gateway.post("/embed", json={"inputs": "x", "model": "emb"}).status_code == 401
    scraped = gateway.get("/metrics", headers={"Authorization": "Bearer k"}).text
    assert "SCAN" not in scraped
    counted = [line for line in scraped.splitlines() if line.startswith("nexus_sli_gateway_requests_total{")]
    assert 'nexus_sli_gateway_requests_total{method="other",route="/embed",status="401"} 3.0' in counted
    assert 'nexus_sli_gateway_requests_total{method="POST",route="/embed",status="401"} 1.0' in counted


def test_a_route_with_a_parameter_is_counted_by_its_pattern_and_an_unknown_path_as_other():
    """Each model asked of GET /v1/models/{model} would be a series of its own, or all of them "other"."""
    gateway = _gateway()
    assert gateway.get("/v1/models/emb").status_code == 200
    assert gateway.get("/v1/models/nope").status_code == 404
    assert gateway.get("/no/such/route").status_code == 404
    scraped = gateway.get("/metrics").text
    counted = [line for line in scraped.splitlines() if line.startswith("nexus_sli_gateway_requests_total{")]
    assert 'nexus_sli_gateway_requests_total{method="GET",route="/v1/models/{model:path}",status="200"} 1.0' in counted
    assert 'nexus_sli_gateway_requests_total{method="GET",route="/v1/models/{model:path}",status="404"} 1.0' in counted
    assert 'nexus_sli_gateway_requests_total{method="GET",route="other",status="404"} 1.0' in counted
    assert "/v1/models/emb" not in scraped and "/no/such" not in scraped


def test_decode_pads_no_short_row_to_a_long_one_and_answers_in_the_request_order(monkeypatch):
    """One request's rows share a width: a long row among short ones must not widen them all (64 rows padded to a
    row of millions of ids is gigabytes), and each text still answers its own row."""
    made, shapes, real = {}, [], gateway_backend._ids_tensor

    def recording(rows):
        tensor = real(rows)
        made[id(tensor)] = rows
        return tensor

    async def tokenizer_step(tokenizer, tensor, output, parameters):
        shapes.append(tuple(tensor.shape()))
        return np.array([f"{len(row)}:{row[0]}".encode() for row in made[id(tensor)]], dtype=object)

    monkeypatch.setattr(gateway_backend, "_ids_tensor", recording)
    backend = gateway_backend.Backend.__new__(gateway_backend.Backend)  # no Triton: its one call is the stand-in
    backend._tokenizer_call = tokenizer_step
    rows = [[index] for index in range(100)]
    rows.insert(10, [7] * 300_000)
    texts = asyncio.run(backend.decode(SimpleNamespace(tokenizer="emb_tokenizer", max_batch_size=64), rows, True))
    assert texts == [f"{len(row)}:{row[0]}" for row in rows]
    assert sum(height * width for height, width in shapes) == sum(map(len, rows))  # not one id of padding
    assert max(height for height, _ in shapes) <= 64  # the model's rows a request, as before


def test_a_gateway_whose_port_is_taken_says_so_in_one_line_and_exits_1():
    """uvicorn ends its task with SystemExit(3) where it cannot bind: the gateway (and so ``make serve`` with
    its port busy) printed a traceback and exited 3, where its docs say 1."""
    import socket
    import subprocess
    import sys

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "nexus_sli.cli.main", "gateway", "--port", str(port),
                               "--triton", "127.0.0.1:1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "address already in use" in done.stderr and "Traceback" not in done.stderr, done.stderr


#: The gateway's --triton-retry in the tests of a Triton that is not there: long against a refused connection's
#: milliseconds, short for a test.
RETRY_S = 3.0


def _unused_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as unused:
        return unused.getsockname()[1]


@pytest.mark.parametrize("discovered", [True, False])
def test_a_triton_not_listening_is_retried_for_the_retry_budget_before_the_503(discovered):
    """--triton-retry holds for every call to Triton a request makes: discovery's, and the tokenizer step's (/tokenize,
    /decode, truncate=false's count, older exports' token counts), not the inference calls alone.  ``discovered``:
    the models are known (the stand-in's list), so the tokenizer step's call is the one that fails."""
    app = create_app(GatewayConfig(triton=f"127.0.0.1:{_unused_port()}", triton_retry_s=RETRY_S))
    with TestClient(app, raise_server_exceptions=False) as gateway:  # with its lifespan: the real backend
        if discovered:
            app.state.backend.catalog = _Backend().catalog
        started = time.monotonic()
        response = gateway.post("/tokenize", json={"inputs": "hello world", "model": "emb"})
        elapsed = time.monotonic() - started
    assert response.status_code == 503 and response.json()["error_type"] == "Unhealthy", response.json()
    assert elapsed >= RETRY_S * 0.8  # its passes, with pauses, for the budget: not one try


def test_requests_waiting_on_a_discovery_that_failed_share_its_error_rather_than_retry_in_turn():
    """One discovery at a time: were each request behind a failed one to read again, the n-th would wait n retry
    budgets.  The next request after them reads again."""
    reads = []

    async def failing(read):
        reads.append(read)
        await asyncio.sleep(0.2)  # its retries
        raise ServerUnavailableError("Triton server unreachable")

    async def requests():
        catalog = Catalog(None, ttl_s=10, on_replicas=failing)
        waited = await asyncio.gather(*(catalog.models() for _ in range(5)), return_exceptions=True)
        later = await asyncio.gather(catalog.models(), return_exceptions=True)
        return waited, later

    waited, later = asyncio.run(requests())
    assert all(isinstance(error, ServerUnavailableError) for error in waited + later), waited + later
    assert len(reads) == 2


class _TokenizerStep(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Triton's gRPC service answering only ModelInfer, as a tokenizer step's TOKENS mode: the stand-in's tokens."""

    def ModelInfer(self, request, context):
        texts = deserialize_bytes_tensor(request.raw_input_contents[0])
        tokens = np.array([json.dumps(_tokens(text.decode())).encode() for text in texts], dtype=np.object_)
        response = service_pb2.ModelInferResponse(model_name=request.model_name)
        response.outputs.add(name=TOKENS_OUTPUT, datatype="BYTES", shape=[len(texts), 1])
        response.raw_output_contents.append(serialize_byte_tensor(tokens).item())
        return response


def test_a_triton_back_within_the_retry_budget_answers_the_request_that_waited():
    port = _unused_port()
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(_TokenizerStep(), server)

    def come_back():  # the port bound only now: bound, the kernel would take connections before the server starts
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()

    back = threading.Timer(1.0, come_back)
    app = create_app(GatewayConfig(triton=f"127.0.0.1:{port}", triton_retry_s=10 * RETRY_S))
    try:
        with TestClient(app, raise_server_exceptions=False) as gateway:
            app.state.backend.catalog = _Backend().catalog
            back.start()
            response = gateway.post("/tokenize", json={"inputs": "hello world", "model": "emb"})
    finally:
        back.cancel()
        server.stop(None)
    assert response.status_code == 200, response.json()
    assert [token["text"] for token in response.json()[0]] == ["[CLS]", "hello", "world", "[SEP]"]


def test_serve_starts_no_gateway_without_a_package_the_gateway_imports(monkeypatch, capsys):
    """``nexus-sli serve`` looks for the gateway's packages before starting it: a gateway that cannot import one
    would exit at once, and serve with it.  The list is every package the gateway's modules import beyond the
    client's (numpy, tritonclient)."""
    from nexus_sli.cli.serve_command import gateway_command

    imported = set()
    for path in Path(nexus_sli.gateway.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported.add(node.module.split(".")[0])
    assert imported - set(sys.stdlib_module_names) - {"nexus_sli", "numpy", "tritonclient"} == set(REQUIRED_MODULES)
    args = argparse.Namespace(gateway_port=8080, host="127.0.0.1", grpc_port=8001)
    assert gateway_command(args) is not None
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "orjson" else real(name, *a))
    assert gateway_command(args) is None
    assert "missing (orjson;" in capsys.readouterr().err


class _Failing(_Backend):
    async def embed(self, model, texts, prompt_name=None):
        raise RuntimeError("a bug")


def test_an_unforeseen_failure_is_counted_with_the_status_it_is_answered_with():
    """Starlette answers an exception no route foresaw outside the metrics' middleware: TEI's 424, OpenAI's 500."""
    gateway = _gateway(backend=_Failing())
    assert gateway.post("/embed", json={"inputs": "x", "model": "emb"}).status_code == 424
    assert gateway.post("/v1/embeddings", json={"input": "x", "model": "emb"}).status_code == 500
    counted = [line for line in gateway.get("/metrics").text.splitlines()
               if line.startswith("nexus_sli_gateway_requests_total{")]
    assert 'nexus_sli_gateway_requests_total{method="POST",route="/embed",status="424"} 1.0' in counted
    assert 'nexus_sli_gateway_requests_total{method="POST",route="/v1/embeddings",status="500"} 1.0' in counted


def test_a_405_names_every_method_the_path_takes():
    """``/`` is TEI's POST and a GET probe: a PUT must learn both."""
    response = _gateway().put("/")
    assert response.status_code == 405 and response.headers["Allow"] == "GET, HEAD, POST"
    assert "GET, HEAD, POST" in response.json()["error"]
