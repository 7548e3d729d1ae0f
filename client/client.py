"""``EncoderClient``: a thin synchronous client for nexus-sli models on Triton."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from . import calls
from . import protocol as p
from .errors import ReplicasFailedError, RetryableError
from .replicas import Replicas, attempts_for, parse_urls, retryable


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
    replica, each replica at most once (``attempts`` caps the tries: None, every replica;
    1, no retry; below 1, a ValueError); when every try fails, :class:`ReplicasFailedError`
    lists them.  With one try (one URL, or ``attempts=1``) the error itself is raised.

    >>> client = EncoderClient()                 # gRPC on 127.0.0.1:8001
    >>> client.embed(["a text", "another"], model="all_minilm_l6_v2").shape
    (2, 384)
    >>> EncoderClient(model="all_minilm_l6_v2").embed("one text").shape
    (384,)
    >>> EncoderClient(["10.0.0.5:8001", "10.0.0.6:8001"]).embed("one text", model="all_minilm_l6_v2").shape
    (384,)
    """

    def __init__(self, url: str | Sequence[str] | None = None, protocol: str = "grpc", timeout_s: float = 60.0,
                 model: str | None = None, attempts: int | None = None):
        self.protocol = protocol
        #: the model calls use when they name none
        self.model = model
        self._triton = _module(protocol)
        #: every replica's URL; ``url`` is the first
        self.urls = parse_urls(url, default_url(protocol))
        self.url = self.urls[0]
        self.timeout_s = timeout_s
        #: the replica choice, with the requests each replica answered (``replicas.served``)
        self.replicas = Replicas(self.urls)
        #: replicas one request may try (each at most once)
        self.attempts = attempts_for(attempts, self.urls)
        self._clients = {u: self._triton.InferenceServerClient(u, **client_kwargs(self._triton, protocol))
                         for u in self.urls}
        self._client = self._clients[self.url]
        self._info: dict[str, p.ModelInfo] = {}

    def _on_replicas(self, model: str, call):
        """``call(tritonclient)`` on the replicas in turn until one answers or a non-retryable error."""
        tried: list[tuple[str, RetryableError]] = []
        for url in self.replicas.order()[:self.attempts]:
            try:
                result = call(self._clients[url])
            except Exception as exc:
                tried.append((url, retryable(exc, model, self.attempts, self.replicas, url)))
                continue
            self.replicas.succeeded(url)
            return result
        raise ReplicasFailedError(tried)

    def info(self, model: str) -> p.ModelInfo:
        """The model's task and batch limit, read once from its Triton config."""
        if model not in self._info:
            deadline = {"client_timeout": self.timeout_s} if self.protocol == "grpc" else {}
            kwargs = {"as_json": True, **deadline} if self.protocol == "grpc" else {}

            def read(client):
                ready = client.is_model_ready(model, **deadline)
                # Not ready: the config request says why (unknown, or known but loading again).
                config = client.get_model_config(model, **kwargs)
                if not ready:
                    raise p.not_ready(model)
                return config

            config = self._on_replicas(model, read)
            self._info[model] = p.ModelInfo.from_config(model, config.get("config", config))
        return self._info[model]

    def _run(self, model: str, plan: calls.Plan):
        self.info(model).expect(plan.task)
        outputs = [self._infer(model, request, plan.output) for request in plan.requests]
        return plan.finish(outputs)

    def _infer(self, model: str, request: calls.Request, output: str) -> np.ndarray:
        inputs = []
        for name, array in request.items():
            tensor = self._triton.InferInput(name, list(array.shape), "BYTES")
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        kwargs = {"client_timeout": self.timeout_s} if self.protocol == "grpc" else {}
        outputs = [self._triton.InferRequestedOutput(output)]
        try:
            result = self._on_replicas(model, lambda client: client.infer(model, inputs, outputs=outputs, **kwargs))
        except Exception:
            self._info.pop(model, None)  # the model may come back changed
            raise
        return result.as_numpy(output)

    def _call(self, model: str | None, plan):
        """Run the plan ``plan(info)`` makes for the model named, or the client's default."""
        model = p.model_name(model, self.model)
        return self._run(model, plan(self.info(model)))

    def embed(self, texts, model: str | None = None) -> np.ndarray:
        """Embeddings ``[n, hidden]`` for a list, ``[hidden]`` for one string."""
        return self._call(model, lambda info: calls.embed(texts, info))

    def classify(self, texts, model: str | None = None, top_k: int = 1):
        """Top ``top_k`` labels (label, score) per text."""
        return self._call(model, lambda info: calls.classify(texts, info, top_k))

    def ner(self, texts, model: str | None = None):
        """Entities (text, label, start, end, score) per text, offsets into that text."""
        return self._call(model, lambda info: calls.ner(texts, info))

    def answer(self, question: str, context: str, model: str | None = None, top_k: int = 1):
        """Best answer spans (text, start, end, score) in ``context``."""
        return self._call(model, lambda info: calls.answer(question, context, info, top_k))

    def rerank(self, query: str, documents, model: str | None = None, top_k: int | None = None):
        """Documents by relevance to ``query``: (index, score, document), best first."""
        return self._call(model, lambda info: calls.rerank(query, documents, info, top_k))

    def close(self) -> None:
        for client in self._clients.values():
            client.close()

    def __enter__(self) -> "EncoderClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
