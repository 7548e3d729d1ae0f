"""``EncoderClient``: a thin synchronous client for nexus-sli models on Triton."""

from __future__ import annotations

import importlib
import socket
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from nexus_sli.tasks.multi_vector import DOCUMENT

from . import calls, fan_out
from . import protocol as p
from .model_info import ModelInfo
from .replicas import (REFRESH_S, RETRY_S, Fleet, Resolve, Retries, attempts_for, check_attempts, check_timeout,
                       gave_up, probe, retry_budget, retryable, unresolved)


def _module(protocol: str):
    if protocol == "grpc":
        import tritonclient.grpc as module
    elif protocol == "http":
        import tritonclient.http as module
    else:
        raise ValueError(f"protocol must be 'grpc' or 'http', got {protocol!r}")
    return module


def default_url(protocol: str) -> str:
    return "127.0.0.1:8001" if protocol == "grpc" else "127.0.0.1:8000"


#: Longest wait between a gRPC channel's attempts to reconnect.  gRPC's default
#: grows to two minutes: a client would stay failed long after the server is back.
RECONNECT_BACKOFF_MS = 1000


def client_kwargs(module, protocol: str) -> dict:
    """tritonclient's defaults, plus a short reconnect backoff for gRPC."""
    if protocol != "grpc":
        return {}
    keepalive = module.KeepAliveOptions()
    return {"channel_args": [
        ("grpc.max_send_message_length", module.MAX_GRPC_MESSAGE_SIZE),
        ("grpc.max_receive_message_length", module.MAX_GRPC_MESSAGE_SIZE),
        ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
        ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
        ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
        ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
    ]}


class EncoderClient:
    """Calls one server, or several replicas of it; each method names the model it uses, or
    uses the client's ``model``.

    ``url`` may list replicas (a sequence, or comma-separated): requests take turns over
    them, and one that fails with a :class:`RetryableError` is sent again to the next
    replica, each replica at most once per pass (``attempts`` caps the tries of a pass: None,
    every replica; 1, one try and no retry at all; below 1, a ValueError).  When a whole pass
    fails, the call passes over the replicas again after a pause (growing from 50 ms to 1 s)
    while ``retry_s`` seconds from its start last, one URL as well as several (0: no retry);
    then :class:`ReplicasFailedError` lists the last pass's tries, or, where that pass had one
    try (one URL, ``attempts=1``), the error itself is raised.

    ``timeout_s`` is each request's deadline: gRPC's, the HTTP connection's timeouts, and Triton's
    queue timeout for it (None: no bound).  A request that outlives it raises
    :class:`~nexus_sli.client.DeadlineExceededError` and is not sent again.

    A list larger than the model's ``max_batch_size`` is sent as several requests, up to
    :data:`~nexus_sli.client.fan_out.IN_FLIGHT` at once (one: one after another), each retried on its own;
    the answers come back in order, and a failure raises the error of the first request, in order, that failed.

    ``url="dns:///NAME:PORT"`` (a Kubernetes headless Service) makes every address of ``NAME``
    a replica, resolved again every ``refresh_s`` seconds and after a pass that failed
    everywhere, so pods that come and go are followed within ``refresh_s`` plus the DNS
    answer's time to live; ``resolve(host, port)`` replaces the system's resolver.

    >>> client = EncoderClient()                 # gRPC on 127.0.0.1:8001
    >>> client.embed(["a text", "another"], model="all_minilm_l6_v2").shape
    (2, 384)
    >>> EncoderClient(model="all_minilm_l6_v2").embed("one text").shape
    (384,)
    >>> EncoderClient(["10.0.0.5:8001", "10.0.0.6:8001"]).embed("one text", model="all_minilm_l6_v2").shape
    (384,)
    >>> EncoderClient("dns:///triton-headless.default.svc.cluster.local:8001", model="all_minilm_l6_v2")
    """

    def __init__(self, url: str | Sequence[str] | None = None, protocol: str = "grpc", *,
                 timeout_s: float | None = 60.0, model: str | None = None, attempts: int | None = None,
                 retry_s: float = RETRY_S, resolve: Resolve | None = None, refresh_s: float = REFRESH_S):
        self.protocol = protocol
        #: the model calls use when they name none
        self.model = model
        self._triton = _module(protocol)
        # the arguments are checked before any connection is made (an asyncio one needs a running loop)
        retry_s = retry_budget(retry_s, check_attempts(attempts))
        self.timeout_s = check_timeout(timeout_s)
        options = client_kwargs(self._triton, protocol)
        if protocol == "http":
            # a connection for each request of a call in flight (tritonclient's default, one, would send a
            # call's chunks one after another all the same)
            options["concurrency"] = fan_out.IN_FLIGHT
            # tritonclient's HTTP calls take no deadline of their own: the connection's timeouts bound the wait to
            # connect and each wait for the server's answer.  None is no bound, given explicitly, as over gRPC and
            # in the asyncio client (tritonclient's default is 60 s)
            options.update(connection_timeout=timeout_s, network_timeout=timeout_s)
        # gRPC: the threads that send a call's other chunks (started when first needed); HTTP sends them
        # as greenlets instead (fan_out says why)
        self._workers = (ThreadPoolExecutor(max(fan_out.IN_FLIGHT - 1, 1), thread_name_prefix="nexus-sli-chunks")
                         if protocol == "grpc" else None)
        # a replica's probe (replicas.probe): gevent's over HTTP, so that the call's other requests go on meanwhile
        self._create_connection = (importlib.import_module("gevent.socket").create_connection if protocol == "http"
                                   else socket.create_connection)
        #: the replicas and a connection to each (kept current for a ``dns:///`` name)
        self.fleet = Fleet(url, default_url(protocol), lambda u: self._triton.InferenceServerClient(u, **options),
                           resolve, refresh_s)
        #: the replica choice, with the requests each replica answered (``replicas.served``)
        self.replicas = self.fleet.replicas
        #: replicas one request may try per pass (each at most once)
        self.attempts = attempts_for(attempts, self.fleet)
        #: how long one call keeps retrying retryable failures
        self.retry_s = retry_s
        self._info: dict[str, ModelInfo] = {}
        #: the version each model last answered with: another one drops its description (:func:`p.note_version`)
        self._versions: dict[str, str] = {}

    def on_replicas(self, model: str, send):
        """``send(tritonclient)`` on the replicas in turn until one answers or a non-retryable error;
        passes over them again, after pauses, while the call's retry budget lasts.  The typed calls are made
        through it, and so can any raw tritonclient call; ``model`` names the model in errors ("" for none)."""
        retries, tried = Retries(self.retry_s), []
        while (pause := retries.next_pause()) is not None:
            if pause:  # the first pass goes at once: even sleep(0) gives up the CPU
                self._pause(pause)
            self.fleet.refresh(failed=bool(tried))
            # the pass's replicas and their connections at once: a refresh meanwhile may retire some
            order = self.fleet.turn(self.attempts)
            tried = [] if order else unresolved(self.fleet)
            try:
                for url, connection in order:
                    started = time.monotonic()
                    try:
                        if not self.replicas.answering(url):
                            probe(url, self.timeout_s, self._create_connection)
                        result = send(connection)
                    except Exception as exc:
                        late = p.past_deadline(started, self.timeout_s)
                        tried.append((url, retryable(exc, model, self.replicas, url, late)))
                        continue
                    self.replicas.succeeded(url)
                    return result
            finally:
                for gone in self.fleet.done(order):
                    gone.close()
        raise gave_up(tried) from None

    def _pause(self, seconds: float) -> None:
        if self._workers is None:  # HTTP: a call's other requests are greenlets of this thread: let them run
            import gevent

            gevent.sleep(seconds)
        else:
            time.sleep(seconds)

    def info(self, model: str) -> ModelInfo:
        """The model's task and batch limit, read once from its Triton config (and its tokenizer step's, where
        that step bounds a request's rows: :attr:`ModelInfo.bound_by_step`)."""
        # one read of the cache: another thread's failed call may drop the entry after any check of it
        info = self._info.get(model)
        if info is None:
            deadline = {"client_timeout": self.timeout_s} if self.protocol == "grpc" else {}
            kwargs = {"as_json": True, **deadline} if self.protocol == "grpc" else {}

            def read(client):
                ready = client.is_model_ready(model, **deadline)
                # Not ready: the config request says why (unknown, or known but loading again).
                config = client.get_model_config(model, **kwargs)
                if not ready:
                    raise p.not_ready(model)
                found = ModelInfo.from_config(model, config)
                if found.bound_by_step:
                    found = found.with_tokenizer_step(client.get_model_config(found.tokenizer, **kwargs))
                return found, client.get_model_metadata(model, **kwargs)

            info, metadata = self.on_replicas(model, read)
            self._info[model] = info
            if version := p.newest_version(metadata):  # the version described: an answer from another drops it
                self._versions[model] = version
        return info

    def _run(self, model: str, call: calls.Call):
        model = call.model or model
        self.info(model).expect(call.task)
        return call.read(self._send_all(len(call.requests), lambda index: self._infer(model, call, index)))

    def _send_all(self, count: int, send) -> list:
        """``send(i)`` for each of a call's ``count`` requests, at once (:mod:`fan_out`); the answers in order."""
        if count <= 1:  # one request goes from this thread as it is: no worker to start or wait for
            return [send(index) for index in range(count)]
        if self._workers is None:
            return fan_out.in_greenlets(count, send)
        return fan_out.in_threads(self._workers, count, send)

    def _infer(self, model: str, call: calls.Call, index: int) -> tuple[np.ndarray, ...]:
        inputs = []
        for name, array in call.requests[index].items():
            tensor = self._triton.InferInput(name, list(array.shape), "BYTES")
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        kwargs = {"client_timeout": self.timeout_s} if self.protocol == "grpc" else {}
        kwargs.update(p.queue_timeout(self.timeout_s))
        if parameters := call.parameters_of(index):
            kwargs["parameters"] = parameters
        outputs = [self._triton.InferRequestedOutput(output) for output in call.outputs]
        try:
            result = self.on_replicas(model, lambda client: client.infer(model, inputs, outputs=outputs, **kwargs))
        except Exception as exc:
            self._info.pop(model, None)  # the model may come back changed
            raise call.located(index, exc) from None
        p.note_version(self._versions, self._info, model, result)
        return tuple(result.as_numpy(output) for output in call.outputs)

    def _call(self, model: str | None, make):
        """Run the :class:`~calls.Call` ``make(info)`` builds for the model named, or the client's default."""
        model = p.model_name(model, self.model)
        return self._run(model, make(self.info(model)))

    def embed(self, texts, model: str | None = None, prompt_name: str | None = None,
              dimensions: int | None = None) -> np.ndarray:
        """Embeddings ``[n, hidden]`` for a list, ``[hidden]`` for one string.

        ``prompt_name``: one of the model's prompts (``info(model).prompts``), put in front of each
        text by the server; None: the model's default prompt, if it has one.  ``dimensions``: a
        shorter (Matryoshka) size from 1 to the model's, each vector cut to it and L2-normalised."""
        return self._call(model, lambda info: calls.embed(texts, info, prompt_name, dimensions))

    def embed_counted(self, texts, model: str | None = None,
                      prompt_name: str | None = None) -> tuple[np.ndarray, int]:
        """(embeddings ``[n, hidden]``, the tokens the model read: special tokens and the prompt included, after
        truncation), from the same requests; a model exported before it served the count is a WrongTaskError."""
        return self._call(model, lambda info: calls.embed_counted(texts, info, prompt_name))

    def embed_sparse(self, texts, model: str | None = None, prompt_name: str | None = None,
                     top_k: int | None = None, threshold: float = 0.0):
        """Sparse (SPLADE) embeddings of a ``sparse-embedding`` model, or a BGE-M3 model's lexical weights (per
        token id its largest weight): a :class:`SparseEmbedding` (term ids ascending, their weights) per text,
        or one for one string.  ``top_k``: only the largest
        terms (sentence-transformers' ``max_active_dims``); ``threshold``: only terms above it."""
        return self._call(model, lambda info: calls.embed_sparse(texts, info, prompt_name, top_k, threshold))

    def embed_tokens(self, texts, model: str | None = None, prompt_name: str | None = None):
        """Each token's vector, unpooled: ``[tokens, hidden]`` per text (special tokens included, after
        truncation), a list for a list, one array for one string; ``model`` is the embedding model."""
        return self._call(model, lambda info: calls.embed_tokens(texts, info, prompt_name))

    def embed_multi_vector(self, texts, model: str | None = None, input_type: str = DOCUMENT,
                           prompt_name: str | None = None):
        """A late-interaction (multi-vector) model's vectors: ``[n_i, dim]`` per text, one per token it scores,
        a list for a list, one array for one string.  ``input_type``: ``query`` or ``document``, the side
        (its marker, length, query expansion and skiplist); score them with
        :func:`~nexus_sli.client.late_interaction.score` and ``info(model).similarity``."""
        return self._call(model, lambda info: calls.embed_multi_vector(texts, info, input_type, prompt_name))

    def embed_m3(self, texts, model: str | None = None, dense: bool = True, sparse: bool = True,
                 multi_vector: bool = True):
        """A BGE-M3 model's outputs from one pass: an :class:`M3Embedding` per text (one for one string) with its
        dense vector, its lexical weights (a :class:`SparseEmbedding`) and its ColBERT vectors ``[n_i, dim]``
        (score them with ``late_interaction.score``, the model's ``meanmaxsim``); those not asked for are None."""
        return self._call(model, lambda info: calls.embed_m3(texts, info, dense, sparse, multi_vector))

    def classify(self, texts, model: str | None = None, top_k: int = 1):
        """Top ``top_k`` labels (label, score) per text."""
        return self._call(model, lambda info: calls.classify(texts, info, top_k))

    def ner(self, texts, model: str | None = None):
        """Entities (text, label, start, end, score) per text, offsets into that text."""
        return self._call(model, lambda info: calls.ner(texts, info))

    def answer(self, question: str, context: str, model: str | None = None, top_k: int = 1):
        """Best answer spans (text, start, end, score) in ``context``, at most ``top_k``: the server's
        post-processing keeps its 20 best (``TOP_ANSWERS``), so a larger ``top_k``, or None, gives at most 20."""
        return self._call(model, lambda info: calls.answer(question, context, info, top_k))

    def rerank(self, query: str, documents, model: str | None = None, top_k: int | None = None):
        """Documents by relevance to ``query``: (index, score, document), best first.  A cross-encoder's score,
        or a late-interaction model's own (MaxSim or MeanMaxSim of the query's and each document's vectors)."""
        return self._call(model, lambda info: calls.rerank(query, documents, info, top_k))

    def close(self) -> None:
        if self._workers is not None:
            self._workers.shutdown()
        for client in self.fleet.connections():
            client.close()

    def __enter__(self) -> "EncoderClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
