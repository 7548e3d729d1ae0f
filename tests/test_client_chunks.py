"""The synchronous client sends a call's requests (chunks) one after another by default, and at once up to
``fan_out.IN_FLIGHT`` where that is raised: answers in order, each request retried on
its own, the first failed request's error raised with its type.  A stand-in server here, so that which request
fails, and when each answers, is set; tests/test_serving.py calls the real one."""

from __future__ import annotations

import threading
import time
from collections import Counter

import gevent
import numpy as np
import pytest
from tritonclient.utils import InferenceServerException, deserialize_bytes_tensor

from nexus_sli.client import DeadlineExceededError, EncoderClient, InvalidInputError
from nexus_sli.client import error_codes, fan_out
from nexus_sli.client.model_info import ModelInfo

URL = "127.0.0.1:1"
#: the bound the sending at once is tested at (the client's default sends one at a time)
AT_ONCE = 8


@pytest.fixture(autouse=True)
def at_once(monkeypatch, request):
    if "one_at_a_time" not in request.node.name:
        monkeypatch.setattr(fan_out, "IN_FLIGHT", AT_ONCE)
#: texts per request (the stand-in model's max_batch_size)
CHUNK = 2


class _Answer:
    def __init__(self, rows: np.ndarray):
        self.rows = rows

    def as_numpy(self, name):
        return self.rows

    def get_response(self) -> dict:  # HTTP's JSON header (the version that answered)
        return {"model_version": "1"}


class _Server:
    """A tritonclient stand-in.  Texts are numbers; a request's answer is one row per text, ``[number, 1]``.
    Request ``i`` (the chunk starting at text ``CHUNK * i``) waits ``wait_s(i)``, then fails once with the
    error ``fails[i]`` where given (always, if ``always``).  ``sent`` counts each request's sends."""

    def __init__(self, protocol: str, wait_s=lambda index: 0.0, fails=None, always=False):
        self.sleep = gevent.sleep if protocol == "http" else time.sleep  # the HTTP client's requests are greenlets
        self.wait_s, self.fails, self.always = wait_s, dict(fails or {}), always
        self.sent, self.threads = Counter(), set()
        self.in_flight = self.most = 0
        self._lock = threading.Lock()

    def infer(self, model, inputs, outputs=None, **kwargs):
        # the request's texts, as the client serialised them (each protocol's InferInput keeps the bytes)
        tensor = inputs[0]
        raw = tensor._get_content() if hasattr(tensor, "_get_content") else tensor._get_binary_data()
        numbers = [int(text) for text in deserialize_bytes_tensor(raw)]
        index = numbers[0] // CHUNK
        with self._lock:
            self.sent[index] += 1
            self.threads.add(threading.current_thread())
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
        try:
            self.sleep(self.wait_s(index))
            if index in self.fails and (self.always or self.sent[index] == 1):
                raise self.fails[index]
            return _Answer(np.array([[n, 1.0] for n in numbers], np.float32))
        finally:
            with self._lock:
                self.in_flight -= 1

    def close(self):
        pass


def _client(protocol: str, server: _Server, **options) -> EncoderClient:
    client = EncoderClient(URL, protocol=protocol, model="m", **options)
    client.fleet.clients[URL] = server
    return _known(client)


def _known(client: EncoderClient) -> EncoderClient:
    """The model's description given (a failed call forgets it): no config request to stand in for."""
    client._info["m"] = ModelInfo("m", "embedding", CHUNK)
    return client


def _texts(requests: int) -> list[str]:
    return [str(n) for n in range(CHUNK * requests)]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_calls_requests_go_at_once_and_answer_in_order(protocol):
    requests = fan_out.IN_FLIGHT + 4

    def wait_s(index):  # later requests answer first
        return 0.3 - 0.02 * index

    server = _Server(protocol, wait_s)
    with _client(protocol, server) as client:
        started = time.monotonic()
        vectors = client.embed(_texts(requests))
        took = time.monotonic() - started
    assert vectors[:, 0].tolist() == list(range(CHUNK * requests))
    assert server.sent == Counter(range(requests))  # each request once
    assert server.most == fan_out.IN_FLIGHT  # at once, up to the bound
    assert took < sum(map(wait_s, range(requests))) / 2  # one after another: the sum of the waits (2.3 s)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_by_default_a_calls_requests_go_one_at_a_time(protocol):
    server = _Server(protocol, wait_s=lambda index: 0.02)
    with _client(protocol, server) as client:
        vectors = client.embed(_texts(4))
    assert fan_out.IN_FLIGHT == 1 and server.most == 1 and server.threads == {threading.current_thread()}
    assert vectors[:, 0].tolist() == list(range(CHUNK * 4))


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_one_request_is_sent_from_the_calling_thread_alone(protocol):
    server = _Server(protocol)
    with _client(protocol, server) as client:
        assert client.embed(["1"]).shape == (1, 2)
        assert server.threads == {threading.current_thread()}
        if client._workers is not None:
            assert not client._workers._threads  # no worker was started for it


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_failed_request_is_retried_alone(protocol):
    refused = InferenceServerException(msg="Exceeds maximum queue size", status="StatusCode.UNAVAILABLE")
    server = _Server(protocol, wait_s=lambda index: 0.01, fails={2: refused})
    with _client(protocol, server, retry_s=5) as client:
        vectors = client.embed(_texts(5))
    assert vectors[:, 0].tolist() == list(range(CHUNK * 5))
    assert server.sent == Counter({0: 1, 1: 1, 2: 2, 3: 1, 4: 1})  # the refused one again, the others once


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_the_first_failed_request_in_order_raises_its_own_error(protocol):
    """Request 1 passes its deadline (slowly), request 3 is refused as invalid (at once): the call raises
    request 1's DeadlineExceededError, as one sending them in turn would have, and sends it once."""
    late = InferenceServerException(msg="Deadline Exceeded", status="StatusCode.DEADLINE_EXCEEDED")
    invalid = InferenceServerException(msg=error_codes.mark(error_codes.INVALID_INPUT, "text 0 is bad"))
    server = _Server(protocol, wait_s=lambda index: 0.1 if index == 1 else 0.0, fails={1: late, 3: invalid},
                     always=True)
    with _client(protocol, server, retry_s=30) as client:
        with pytest.raises(DeadlineExceededError, match="did not answer within"):
            client.embed(_texts(5))
        assert server.sent[1] == 1  # a deadline that passed is never sent again
        with pytest.raises(InvalidInputError, match="text 0 is bad"):
            _known(client).embed(_texts(5)[CHUNK * 2:])  # requests 2, 3, 4: 3 is now the first to fail


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_no_request_starts_after_one_failed(protocol):
    invalid = InferenceServerException(msg=error_codes.mark(error_codes.INVALID_INPUT, "bad"))
    server = _Server(protocol, wait_s=lambda index: 0.01 if index == 0 else 0.1, fails={0: invalid}, always=True)
    with _client(protocol, server) as client:
        with pytest.raises(InvalidInputError):
            client.embed(_texts(3 * fan_out.IN_FLIGHT))
    # those in flight with the failed one finished; none after them was sent
    assert server.sent[0] == 1 and max(server.sent) < fan_out.IN_FLIGHT
