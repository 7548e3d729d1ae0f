"""The synchronous client sends a call's requests (chunks) one after another by default, and at once up to
``fan_out.IN_FLIGHT`` where that is raised: answers in order, each request retried on
its own, the first failed request's error raised with its type; the asynchronous client keeps the same bound and
order, and cancels the requests after a failed one.  How a call is cut into requests: rerank's documents by what the
model's tokenizer step takes, an empty list into none, an invalid item named by its place in the caller's list.
A stand-in server here, so that which request fails, and when each answers, is set; tests/test_serving.py calls
the real one."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

import gevent
import numpy as np
import pytest
from tritonclient.utils import InferenceServerException, deserialize_bytes_tensor

from nexus_sli.client import AsyncEncoderClient, DeadlineExceededError, EncoderClient, InvalidInputError
from nexus_sli.client import error_codes, fan_out
from nexus_sli.client.error_codes import TOKEN_COUNT_OUTPUT
from nexus_sli.client.errors import DimensionsError
from nexus_sli.client.model_info import UNSTATED_ROWS, ModelInfo

pytestmark = pytest.mark.usefixtures("stand_in_servers")  # no server behind their URLs

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
        vectors = client.embed(_texts(requests))
    assert vectors[:, 0].tolist() == list(range(CHUNK * requests))
    assert server.sent == Counter(range(requests))  # each request once
    assert server.most == fan_out.IN_FLIGHT  # at once, up to the bound


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


class _AsyncServer(_Server):
    """:class:`_Server` for the asyncio client: the same requests, waits and failures, awaited.  ``cancelled``
    counts the requests cancelled while the server held them."""

    def __init__(self, wait_s=lambda index: 0.0, fails=None, always=False):
        super().__init__("grpc", wait_s, fails, always)
        self.cancelled = Counter()

    async def infer(self, model, inputs, outputs=None, **kwargs):
        tensor = inputs[0]
        numbers = [int(text) for text in deserialize_bytes_tensor(tensor._get_content())]
        index = numbers[0] // CHUNK
        self.sent[index] += 1
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            await asyncio.sleep(self.wait_s(index))
            if index in self.fails and (self.always or self.sent[index] == 1):
                raise self.fails[index]
            return _Answer(np.array([[n, 1.0] for n in numbers], np.float32))
        except asyncio.CancelledError:
            self.cancelled[index] += 1
            raise
        finally:
            self.in_flight -= 1

    async def close(self):
        pass


def _async_client(server: _AsyncServer, **options) -> AsyncEncoderClient:
    client = AsyncEncoderClient(URL, model="m", **options)
    client.fleet.clients[URL] = server
    client._info["m"] = ModelInfo("m", "embedding", CHUNK)
    return client


def test_the_async_clients_requests_go_up_to_the_bound_and_answer_in_order():
    requests = fan_out.IN_FLIGHT + 4
    server = _AsyncServer(wait_s=lambda index: 0.1 - 0.005 * index)  # later requests answer first

    async def call():
        async with _async_client(server) as client:
            return await client.embed(_texts(requests))
    vectors = asyncio.run(call())
    assert vectors[:, 0].tolist() == list(range(CHUNK * requests))
    assert server.sent == Counter(range(requests)) and server.most == fan_out.IN_FLIGHT


def test_by_default_the_async_clients_requests_go_one_at_a_time():
    server = _AsyncServer(wait_s=lambda index: 0.01)

    async def call():
        async with _async_client(server) as client:
            return await client.embed(_texts(4))
    assert asyncio.run(call())[:, 0].tolist() == list(range(CHUNK * 4))
    assert fan_out.IN_FLIGHT == 1 and server.most == 1


def test_the_async_client_raises_the_first_failed_request_in_order_not_the_first_in_time():
    """As the synchronous client (test_the_first_failed_request_in_order_raises_its_own_error): request 1 fails
    slowly, request 3 at once; request 1's error is the call's."""
    late = InferenceServerException(msg="Deadline Exceeded", status="StatusCode.DEADLINE_EXCEEDED")
    invalid = InferenceServerException(msg=error_codes.mark(error_codes.INVALID_INPUT, "text 0 is bad"))
    server = _AsyncServer(wait_s=lambda index: 0.1 if index == 1 else 0.0, fails={1: late, 3: invalid}, always=True)

    async def call():
        async with _async_client(server, retry_s=30) as client:
            await client.embed(_texts(5))
    with pytest.raises(DeadlineExceededError, match="did not answer within"):
        asyncio.run(call())
    assert server.sent[1] == 1 and server.cancelled[1] == 0  # the earlier request was waited for, not cancelled


def test_the_async_client_cancels_a_failed_calls_later_requests_and_sends_nothing_after_it_raised():
    """Request 0 is refused as invalid at once; the others wait in a busy server's queue and are refused, which
    alone would be retried for the whole retry budget.  The call raises request 0's error, the others in
    flight were cancelled, and none is sent again later."""
    invalid = InferenceServerException(msg=error_codes.mark(error_codes.INVALID_INPUT, "bad"))
    busy = InferenceServerException(msg="Exceeds maximum queue size", status="StatusCode.UNAVAILABLE")
    server = _AsyncServer(wait_s=lambda index: 0.01 if index == 0 else 0.2,
                          fails={index: invalid if index == 0 else busy for index in range(12)}, always=True)

    async def call():
        async with _async_client(server, retry_s=5) as client:
            with pytest.raises(InvalidInputError, match="bad"):
                await client.embed(_texts(12))
            sent = sum(server.sent.values())
            await asyncio.sleep(0.5)
        return sent
    sent_when_raised = asyncio.run(call())
    assert sum(server.sent.values()) == sent_when_raised == fan_out.IN_FLIGHT  # the first bound's worth, once
    assert sum(server.cancelled.values()) == fan_out.IN_FLIGHT - 1 and server.in_flight == 0


class _Reranker:
    """A tritonclient stand-in for a cross-encoder exported with ``--max-batch-size ROWS``: an unbatched ensemble
    whose tokenizer step refuses more documents a request than its ``max_rows`` (tokenizer_model.py's words).
    ``max_rows=None``: a step config that states no bound (the client's default applies).  Each document's score
    is its number."""

    def __init__(self, max_rows: int | None, refuse_over: int):
        self.max_rows, self.refuse_over = max_rows, refuse_over
        self.documents: list[int] = []  # DOCUMENTS per request, in the order sent

    def is_model_ready(self, model, **kwargs):
        return True

    def get_model_config(self, model, **kwargs):
        if model == "reranker_tokenizer":
            bound = {} if self.max_rows is None else {"max_rows": {"string_value": str(self.max_rows)}}
            return {"config": {"name": model, "max_batch_size": 0, "parameters": bound}}
        return {"config": {"name": model, "platform": "ensemble", "max_batch_size": 0,
                           "parameters": {"task": {"string_value": "rerank"}},
                           "output": [{"name": "SCORES", "dims": ["-1"]}],
                           "ensemble_scheduling": {"step": [{"model_name": "reranker_tokenizer"},
                                                            {"model_name": "reranker_encoder"}]}}}

    def get_model_metadata(self, model, **kwargs):
        return {"versions": ["1"]}

    def infer(self, model, inputs, outputs=None, **kwargs):
        documents = [int(d) for d in deserialize_bytes_tensor(_content(inputs[1]))]
        self.documents.append(len(documents))
        if len(documents) > self.refuse_over:
            raise InferenceServerException(msg=error_codes.mark(
                error_codes.INVALID_INPUT, f"DOCUMENTS has {len(documents)} items and one request takes at most "
                                           f"{self.refuse_over}; send them in several requests (the client does)"))
        return _Answer(np.array(documents, np.float32))

    def close(self):
        pass


class _AsyncReranker(_Reranker):
    async def is_model_ready(self, model, **kwargs):
        return super().is_model_ready(model)

    async def get_model_config(self, model, **kwargs):
        return super().get_model_config(model)

    async def get_model_metadata(self, model, **kwargs):
        return super().get_model_metadata(model)

    async def infer(self, model, inputs, outputs=None, **kwargs):
        return super().infer(model, inputs, outputs)

    async def close(self):
        pass


def _content(tensor) -> bytes:
    return tensor._get_content() if hasattr(tensor, "_get_content") else tensor._get_binary_data()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_rerank_sends_as_many_documents_a_request_as_the_tokenizer_step_takes(protocol):
    server = _Reranker(max_rows=16, refuse_over=16)
    with EncoderClient(URL, protocol=protocol, model="reranker") as client:
        client.fleet.clients[URL] = server
        ranked = client.rerank("q", [str(n) for n in range(40)])
        assert client.info("reranker").rows_per_request == 16
    assert server.documents == [16, 16, 8]
    assert [r.index for r in ranked] == list(range(39, -1, -1))


def test_the_async_client_reranks_as_many_documents_a_request_as_the_tokenizer_step_takes():
    server = _AsyncReranker(max_rows=16, refuse_over=16)

    async def call():
        async with AsyncEncoderClient(URL, model="reranker") as client:
            client.fleet.clients[URL] = server
            return await client.rerank("q", [str(n) for n in range(40)])
    assert [r.index for r in asyncio.run(call())] == list(range(39, -1, -1))
    assert server.documents == [16, 16, 8]


def test_a_tokenizer_step_that_states_no_bound_gets_the_documents_every_export_took_before():
    server = _Reranker(max_rows=None, refuse_over=UNSTATED_ROWS)
    with EncoderClient(URL, model="reranker") as client:
        client.fleet.clients[URL] = server
        assert len(client.rerank("q", [str(n) for n in range(100)])) == 100
    assert server.documents == [UNSTATED_ROWS, 100 - UNSTATED_ROWS]


class _Embedder(_Server):
    """:class:`_Server` for an embedding model of ``DIMS`` values a vector that answers each text's tokens too."""

    def infer(self, model, inputs, outputs=None, **kwargs):
        rows = super().infer(model, inputs, outputs, **kwargs).rows
        return _Outputs({"EMBEDDING": np.tile(rows, (1, DIMS // 2)), TOKEN_COUNT_OUTPUT: np.ones((len(rows), 1))})


class _Outputs:
    def __init__(self, arrays: dict):
        self.arrays = arrays

    def as_numpy(self, name):
        return self.arrays[name]

    def get_response(self) -> dict:
        return {"model_version": "1"}


DIMS = 4


def _embedder() -> tuple[_Embedder, EncoderClient]:
    server = _Embedder("grpc")
    client = EncoderClient(URL, model="m")
    client.fleet.clients[URL] = server
    client._info["m"] = ModelInfo("m", "embedding", CHUNK, dimensions=DIMS, outputs=("EMBEDDING", TOKEN_COUNT_OUTPUT))
    return server, client


def test_no_text_is_no_vector_of_the_models_size_and_no_request():
    server, client = _embedder()
    with client:
        for vectors in (client.embed([]), client.embed_counted([])[0]):
            assert vectors.shape == (0, DIMS) and vectors.dtype == np.float32
        assert client.embed_counted([])[1] == 0
        assert client.embed([], dimensions=1).shape == (0, 1)
        assert client.embed(["1", "2"], dimensions=3).shape == (2, 3)
    assert sum(server.sent.values()) == 1


def test_dimensions_are_checked_before_anything_is_sent():
    server, client = _embedder()
    with client:
        for wrong in (DIMS + 1, 0, "2"):
            with pytest.raises(DimensionsError, match=f"from 1 to the model's {DIMS}"):
                client.embed(_texts(3), dimensions=wrong)
    assert not server.sent


class _TooLong(_Server):
    """:class:`_Server` whose tokenizer step (truncation off) refuses the text ``LONG``, numbered, as it numbers
    it, within the request; or, ``words``, refuses it in words that name no item."""

    def __init__(self, words: str | None = None):
        super().__init__("grpc")
        self.words = words

    def infer(self, model, inputs, outputs=None, **kwargs):
        texts = deserialize_bytes_tensor(_content(inputs[0])).tolist()
        if LONG in texts:
            said = self.words or f"text {texts.index(LONG)} has 600 tokens; the model takes at most 512"
            raise InferenceServerException(msg=error_codes.mark(error_codes.INVALID_INPUT, said))
        return _Answer(np.zeros((len(texts), 2), np.float32))


LONG = b"9" * 10


def test_an_invalid_text_is_named_by_its_place_in_the_callers_list():
    texts = _texts(5)
    texts[7] = LONG.decode()  # the fourth request's second text
    with EncoderClient(URL, model="m") as client:
        client.fleet.clients[URL] = _TooLong()
        with pytest.raises(InvalidInputError, match=r"\] texts\[7\] has 600 tokens; the model takes at most 512$"):
            _known(client).embed(texts)
        client.fleet.clients[URL] = _TooLong("a text is too long")  # words the client does not know
        with pytest.raises(InvalidInputError, match=r"a text is too long \(in texts\[6:8\]\)$"):
            _known(client).embed(texts)
        with pytest.raises(InvalidInputError, match=r"a text is too long$"):  # one request: numbered as the list
            _known(client).embed(texts[6:8])


@pytest.mark.parametrize("task, call", [
    ("classification", lambda c, top_k: c.classify(["1"], model="m", top_k=top_k)),
    ("rerank", lambda c, top_k: c.rerank("1", ["2", "3"], model="m", top_k=top_k)),
    ("question-answering", lambda c, top_k: c.answer("1", "2", model="m", top_k=top_k)),
])
def test_a_top_k_that_would_drop_results_is_refused_before_anything_is_sent(task, call):
    server = _Server("grpc")
    client = EncoderClient(URL, model="m")
    client.fleet.clients[URL] = server
    client._info["m"] = ModelInfo("m", task, CHUNK)
    with client:
        for wrong in (0, -1, 1.5, True):
            with pytest.raises(InvalidInputError, match=r"top_k must be a positive integer or None"):
                call(client, wrong)
    assert not server.sent
