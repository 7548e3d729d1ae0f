"""The gateway's bounds on what one caller can make it hold: its metrics' label sets, and the tensors /decode sends
the tokenizer step.  Without Triton: a real app over test_gateway_requests' stand-in backend, and the real
backend's decode over a stand-in tokenizer call."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
from test_gateway_requests import _gateway

from nexus_sli.gateway import GatewayConfig
from nexus_sli.gateway import backend as gateway_backend


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
