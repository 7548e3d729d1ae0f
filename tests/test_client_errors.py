"""The client sorts server errors by the code the server put on them, never by their wording."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from nexus_sli.client import (
    AsyncEncoderClient,
    DeadlineExceededError,
    EncoderClient,
    InferenceError,
    InvalidInputError,
    ModelNotFoundError,
    NoModelError,
    RetryableError,
    ServerBusyError,
    ServerUnavailableError,
)
from nexus_sli.client import calls, error_codes
from nexus_sli.client.model_info import ModelInfo
from nexus_sli.client.protocol import as_list, translate

pytestmark = pytest.mark.usefixtures("stand_in_servers")  # no server behind their URLs


def server_error(message: str, status: str = "StatusCode.INTERNAL") -> InferenceServerException:
    return InferenceServerException(msg=message, status=status)


@pytest.mark.parametrize("code, kind", [(error_codes.INVALID_INPUT, InvalidInputError),
                                        (error_codes.INFERENCE_FAILED, InferenceError)])
def test_each_code_maps_to_one_error_type_however_the_message_reads(code, kind):
    for wording in ("TEXT item 0 is not valid UTF-8", "a message reworded entirely", ""):
        # Triton's ensemble puts its own words in front of a step's message
        error = translate(server_error(f"in ensemble 'm', {error_codes.mark(code, wording)}"), "m")
        assert type(error) is kind


def test_every_code_has_a_client_error_type():
    for code in error_codes.CODES:
        assert isinstance(translate(server_error(error_codes.mark(code, "x")), "m"), (InvalidInputError, InferenceError))


def test_unmarked_messages_never_become_invalid_input_by_their_words():
    error = translate(server_error("TEXT item 0 is not valid UTF-8; text is empty; is too long"), "m")
    assert type(error) is InferenceError


def test_tritons_own_errors_are_sorted_by_transport_status():
    assert type(translate(server_error("whatever", "StatusCode.NOT_FOUND"), "m")) is ModelNotFoundError
    assert type(translate(server_error("whatever", "404"), "m")) is ModelNotFoundError
    assert type(translate(server_error("whatever", "StatusCode.INVALID_ARGUMENT"), "m")) is InvalidInputError
    assert type(translate(server_error("whatever", "400"), "m")) is InvalidInputError
    assert type(translate(server_error("whatever", "StatusCode.UNAVAILABLE"), "m")) is ServerUnavailableError
    assert type(translate(ConnectionRefusedError(111, "Connection refused"), "m")) is ServerUnavailableError
    # a server that does not answer within the client's deadline: its own error, caught where an outage is
    for slow in (server_error("Deadline Exceeded", "StatusCode.DEADLINE_EXCEEDED"), TimeoutError()):
        error = translate(slow, "m")
        assert type(error) is DeadlineExceededError and "did not answer within" in str(error)
        assert isinstance(error, ServerUnavailableError) and isinstance(error, RetryableError)


#: Triton's words for a request its model's queue policy refused (the queue full) or dropped unrun (its
#: timeout in the queue passed), as each protocol reports them, and inside an ensemble's message
QUEUE_REFUSALS = [("[request id: <id_unknown>] Exceeds maximum queue size", "StatusCode.UNAVAILABLE"),
                  ("Request timeout expired", "StatusCode.UNAVAILABLE"),
                  ("Exceeds maximum queue size", "503"),
                  ("in ensemble 'm', Request timeout expired", "503")]


@pytest.mark.parametrize("message, status", QUEUE_REFUSALS)
def test_a_full_queue_is_its_own_retryable_error_not_an_unreachable_server(message, status):
    error = translate(server_error(message, status), "m")
    assert type(error) is ServerBusyError and isinstance(error, RetryableError)
    assert "overloaded" in str(error) and "unreachable" not in str(error) and message in str(error)
    # once the call's deadline passed, a drop for the time in the queue was that deadline's (the client
    # sends it as the queue's timeout); a full queue stays a busy server
    late = translate(server_error(message, status), "m", deadline_passed=True)
    assert type(late) is (DeadlineExceededError if "timeout expired" in message else ServerBusyError)


class _Refusing:
    """A tritonclient stand-in whose server's queue is full: every call is refused."""

    def __init__(self):
        self.calls = 0

    def is_model_ready(self, *args, **kwargs):
        self.calls += 1
        raise server_error("Exceeds maximum queue size", "StatusCode.UNAVAILABLE")

    def close(self):
        pass


def test_a_refusal_for_a_full_queue_is_sent_again_until_the_retry_budget_is_spent():
    """The server kept no copy of a refused request, so sending it again adds no work (unlike a call
    whose deadline passed, which is not sent again: test_failover.py)."""
    with EncoderClient("127.0.0.1:1", retry_s=0.3) as client:
        refusing = client.fleet.clients["127.0.0.1:1"] = _Refusing()
        with pytest.raises(ServerBusyError):
            client.embed("a text", model="m")
    assert refusing.calls > 1


class _DroppedFromTheQueue:
    """A tritonclient stand-in whose request waits ``wait_s`` in a step's queue, then is dropped there."""

    def __init__(self, wait_s: float):
        self.wait_s, self.calls = wait_s, 0

    def is_model_ready(self, *args, **kwargs):
        self.calls += 1
        time.sleep(self.wait_s)
        raise server_error("in ensemble 'm', Request timeout expired", "StatusCode.UNAVAILABLE")

    def close(self):
        pass


class _AsyncDroppedFromTheQueue(_DroppedFromTheQueue):
    async def is_model_ready(self, *args, **kwargs):
        self.calls += 1
        await asyncio.sleep(self.wait_s)
        raise server_error("Request timeout expired", "StatusCode.UNAVAILABLE")

    async def close(self):
        pass


def test_a_request_dropped_from_the_queue_at_the_calls_deadline_is_that_deadline_and_not_sent_again():
    with EncoderClient("127.0.0.1:1", timeout_s=0.05, retry_s=5) as client:
        dropped = client.fleet.clients["127.0.0.1:1"] = _DroppedFromTheQueue(wait_s=0.05)
        with pytest.raises(DeadlineExceededError, match="Request timeout expired"):
            client.embed("a text", model="m")
    assert dropped.calls == 1
    # dropped sooner, at a queue policy's own shorter timeout: an overloaded server, whose request is sent again
    with EncoderClient("127.0.0.1:1", timeout_s=60, retry_s=0.3) as client:
        dropped = client.fleet.clients["127.0.0.1:1"] = _DroppedFromTheQueue(wait_s=0.0)
        with pytest.raises(ServerBusyError):
            client.embed("a text", model="m")
    assert dropped.calls > 1

    async def late_async_call():
        async with AsyncEncoderClient("127.0.0.1:1", timeout_s=0.05, retry_s=5) as client:
            client.fleet.clients["127.0.0.1:1"] = dropped_async
            await client.embed("a text", model="m")
    dropped_async = _AsyncDroppedFromTheQueue(wait_s=0.05)
    with pytest.raises(DeadlineExceededError):
        asyncio.run(late_async_call())
    assert dropped_async.calls == 1


def test_marking_refuses_unknown_codes_and_finds_none_in_plain_text():
    with pytest.raises(ValueError, match="unknown error code"):
        error_codes.mark("oops", "x")
    assert error_codes.code_of("[nexus:oops] x") is None and error_codes.code_of("plain") is None


def test_a_call_without_a_model_needs_the_clients_default():
    with EncoderClient("127.0.0.1:1") as client:  # nothing is sent before the model is known
        with pytest.raises(NoModelError, match="pass model=..."):
            client.embed("a text")
    assert EncoderClient("127.0.0.1:1", model="m").model == "m"


def _refused_once():
    """A send that is refused for a full queue once, then answers."""
    refusals = iter([server_error("Exceeds maximum queue size", "StatusCode.UNAVAILABLE")])

    def send(tritonclient):
        error = next(refusals, None)
        if error is not None:
            raise error
        return "answer"
    return send


def test_the_first_pass_goes_at_once_and_only_retries_pause(monkeypatch):
    """A call that succeeds at once never sleeps (a sleep of 0 still gives the CPU away); a retry
    pauses first."""
    import nexus_sli.client.client as sync_client

    pauses = []
    monkeypatch.setattr(sync_client.time, "sleep", pauses.append)
    with EncoderClient("127.0.0.1:1", retry_s=5) as client:
        assert client.on_replicas("m", lambda tritonclient: "answer") == "answer"
        assert pauses == []
        assert client.on_replicas("m", _refused_once()) == "answer"
    assert len(pauses) == 1 and pauses[0] > 0


def test_the_async_clients_first_pass_goes_at_once_and_only_retries_pause(monkeypatch):
    import asyncio

    import nexus_sli.client.async_client as async_client
    from nexus_sli.client import AsyncEncoderClient

    pauses = []

    async def pause(seconds):
        pauses.append(seconds)

    monkeypatch.setattr(async_client.asyncio, "sleep", pause)

    async def calls():
        async def answer(tritonclient):
            return "answer"

        async def refused_once(tritonclient, send=_refused_once()):
            return send(tritonclient)

        async with AsyncEncoderClient("127.0.0.1:1", retry_s=5) as client:
            assert await client.on_replicas("m", answer) == "answer"
            assert pauses == []
            assert await client.on_replicas("m", refused_once) == "answer"

    asyncio.run(calls())
    assert len(pauses) == 1 and pauses[0] > 0


@pytest.mark.parametrize("message, status", [("Request for unknown model: 'm' version 1 is not at ready state", "503"),
                                             ("<html>502 Bad Gateway</html>", "502")])
def test_an_http_503_is_the_outage_grpcs_unavailable_is_and_is_sent_again(message, status):
    """Triton answers UNAVAILABLE (a model version reloading) as HTTP 503; a proxy in front answers 502 when
    it cannot reach Triton.  Both are the same retryable error as gRPC's UNAVAILABLE, and sent again."""
    grpc = translate(server_error(message, "StatusCode.UNAVAILABLE"), "m")
    assert type(translate(server_error(message, status), "m")) is type(grpc) is ServerUnavailableError
    refusals = iter([server_error(message, status)])

    def send(tritonclient):
        if (refusal := next(refusals, None)) is not None:
            raise refusal
        return "answer"
    with EncoderClient("127.0.0.1:1", protocol="http", retry_s=5) as client:
        assert client.on_replicas("m", send) == "answer"


def test_a_proxys_504_is_a_passed_deadline_not_sent_again():
    error = translate(server_error("<html>504 Gateway Time-out</html>", "504"), "m")
    assert type(error) is DeadlineExceededError and "proxy" in str(error)
    sent = []

    def send(tritonclient):
        sent.append(tritonclient)
        raise server_error("<html>504 Gateway Time-out</html>", "504")
    with EncoderClient("127.0.0.1:1", protocol="http", retry_s=5) as client:
        with pytest.raises(DeadlineExceededError):
            client.on_replicas("m", send)
    assert len(sent) == 1


@pytest.mark.parametrize("texts, words", [(None, "texts is NoneType, expected a str or a list of str"),
                                          (5, "texts is int"), (b"abc", "texts is bytes.*decode bytes first"),
                                          (bytearray(b"abc"), "texts is bytearray"), ({"a": 1}, "texts is dict")])
def test_texts_that_are_no_str_nor_list_of_str_are_invalid_input_before_anything_is_sent(texts, words):
    with EncoderClient("127.0.0.1:1", model="m") as client:
        client._info["m"] = ModelInfo("m", "embedding", 64, dimensions=2)  # nothing is asked of the server
        with pytest.raises(InvalidInputError, match=words):
            client.embed(texts)
        with pytest.raises(InvalidInputError, match=words.replace("texts", "documents")):
            calls.rerank("q", texts, ModelInfo("r", "rerank", 0))


def test_texts_may_be_any_iterable_of_str():
    assert as_list(text for text in ("a", "b")) == (["a", "b"], False)
    assert as_list(np.array(["a", "b"])) == (["a", "b"], False)
    assert as_list(np.str_("a")) == (["a"], True)


class _DroppedAfterEachRead(dict):
    """The client's cache of descriptions as threads interleave at their worst: each read of it is followed by
    another thread's failed call dropping the entry read (``_infer`` drops it)."""

    def __contains__(self, key):
        found = super().__contains__(key)
        self.pop(key, None)
        return found

    def get(self, key, default=None):
        found = super().get(key, default)
        self.pop(key, None)
        return found

    def __getitem__(self, key):
        found = super().__getitem__(key)
        self.pop(key, None)
        return found


def test_a_description_dropped_by_another_thread_after_the_check_is_still_returned():
    info = ModelInfo("m", "embedding", 64, dimensions=2)
    with EncoderClient("127.0.0.1:1", model="m") as client:
        client._info = _DroppedAfterEachRead(m=info)
        assert client.info("m") is info


def test_the_async_http_client_without_a_timeout_has_no_bound():
    """``timeout_s=None`` is no bound, not tritonclient's default of 60 s for each aiohttp request."""
    async def session_timeouts():
        found = []
        for timeout_s in (None, 5.0):
            async with AsyncEncoderClient("127.0.0.1:1", protocol="http", timeout_s=timeout_s) as client:
                found.append(client.fleet.clients["127.0.0.1:1"]._stub.timeout.total)
        return found
    assert asyncio.run(session_timeouts()) == [None, 5.0]


@pytest.mark.parametrize("client", ["EncoderClient", "AsyncEncoderClient"])
def test_both_clients_take_only_the_url_and_protocol_by_position(client):
    """The two clients' other arguments differ in order: by position, a timeout would silently become a model."""
    import inspect

    import nexus_sli.client as package

    parameters = inspect.signature(getattr(package, client)).parameters.values()
    positional = [p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == ["url", "protocol"]
    with pytest.raises(TypeError, match="positional argument"):
        getattr(package, client)("127.0.0.1:8001", "grpc", 30.0)
