"""Client defects found in review, each held by a test: the asyncio HTTP client's lost connections, a timeout of
None over the synchronous HTTP client, and a call to a model of another task refused for that, not for an
option only that other task would take.  Stand-ins for the server: nothing here starts Triton."""

from __future__ import annotations

import asyncio
import socket
import threading

import aiohttp
import numpy as np
import pytest

from nexus_sli.client import AsyncEncoderClient, EncoderClient, ServerUnavailableError, WrongTaskError
from nexus_sli.client.model_info import ModelInfo
from nexus_sli.client.protocol import translate

pytestmark = pytest.mark.usefixtures("stand_in_servers")  # no server behind their URLs


@pytest.mark.parametrize("error", [aiohttp.ServerDisconnectedError(),
                                   aiohttp.ClientPayloadError("Response payload is not completed")])
def test_the_async_http_clients_lost_connection_is_an_unreachable_server(error):
    """aiohttp's words for a server that closed the connection before or while answering: no OSError, yet the
    same outage as the synchronous client's HTTPConnectionClosed (tests/test_failover.py)."""
    assert type(translate(error, "m")) is ServerUnavailableError


class _HangsUp:
    """A server that reads each request and closes the connection without an answer (one killed mid-request)."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.requests = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:  # closed: the test is over
                return
            with connection:
                if connection.recv(65536):
                    self.requests += 1


def test_the_async_http_client_sends_a_request_again_after_the_server_hung_up():
    server = _HangsUp()

    async def call():
        async with AsyncEncoderClient(server.url, protocol="http", model="m", retry_s=0.3) as client:
            client._info["m"] = ModelInfo("m", "embedding", 4)  # no config request to stand in for
            await client.embed("a text")
    try:
        with pytest.raises(ServerUnavailableError, match="unreachable"):
            asyncio.run(call())
    finally:
        server.listener.close()
    assert server.requests > 1  # retried within the budget, as the synchronous client does


def test_the_sync_http_client_without_a_timeout_has_no_bound():
    """``timeout_s=None`` is no bound over HTTP too, as over gRPC and in the asyncio client
    (tests/test_client_errors.py), not tritonclient's default of 60 s."""
    found = []
    for timeout_s in (None, 5.0):
        with EncoderClient("127.0.0.1:1", protocol="http", timeout_s=timeout_s) as client:
            pool = client.fleet.clients["127.0.0.1:1"]._client_stub._connection_pool
            found.append((pool.connection_timeout, pool.network_timeout))
    assert found == [(None, None), (5.0, 5.0)]


class _Unused:
    def infer(self, *args, **kwargs):
        raise AssertionError("nothing is sent for a call to a model of another task")

    def close(self):
        pass


@pytest.mark.parametrize("task, call", [
    ("classification", lambda c: c.embed("a text", dimensions=128)),  # over its 3 labels
    ("classification", lambda c: c.embed("a text", prompt_name="query")),
    ("embedding", lambda c: c.embed_sparse("a text", prompt_name="query")),
    ("embedding", lambda c: c.embed_multi_vector("a text", input_type="passage")),
    ("classification", lambda c: c.embed_multi_vector("a text", prompt_name="query")),
])
def test_a_model_of_another_task_is_the_error_not_an_option_it_would_refuse(task, call):
    with EncoderClient("127.0.0.1:1", model="m") as client:
        client.fleet.clients["127.0.0.1:1"] = _Unused()
        client._info["m"] = ModelInfo("m", task, 4, dimensions=3)
        with pytest.raises(WrongTaskError, match=f"serves task '{task}', not"):
            call(client)


def test_a_late_interaction_rerank_of_no_documents_sends_nothing():
    """As a cross-encoder's: the query's vectors are not asked for when there is nothing to rank them against."""
    from nexus_sli.tasks.model_parameters import SIMILARITY

    with EncoderClient("127.0.0.1:1", model="colbert") as client:
        client.fleet.clients["127.0.0.1:1"] = _Unused()
        client._info["colbert"] = ModelInfo("colbert", "multi-vector", 4, params={SIMILARITY.key: "maxsim"})
        assert client.rerank("a query", []) == []


@pytest.mark.parametrize("bad", [0, -1, True, "5"])
def test_a_timeout_that_is_not_a_positive_number_is_refused_when_the_client_is_made(bad):
    with pytest.raises(ValueError, match="timeout_s must be a number of seconds > 0"):
        EncoderClient("127.0.0.1:1", timeout_s=bad)

    async def made():
        AsyncEncoderClient("127.0.0.1:1", timeout_s=bad)

    with pytest.raises(ValueError, match="timeout_s must be a number of seconds > 0"):
        asyncio.run(made())


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_an_async_client_made_outside_an_event_loop_says_where_to_make_it(protocol):
    # gRPC's connections, made outside, would fail every call in asyncio.run's loop as a server error
    with pytest.raises(RuntimeError, match="made inside the event loop that uses it"):
        AsyncEncoderClient("127.0.0.1:1", protocol=protocol)


def test_top_k_may_be_a_numpy_integer():
    from nexus_sli.tasks.spec import check_top_k

    check_top_k(np.int64(2), "every label")
    with pytest.raises(ValueError, match="top_k must be a positive integer"):
        check_top_k(np.int64(0), "every label")
