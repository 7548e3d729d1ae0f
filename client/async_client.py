"""``AsyncEncoderClient``: the same calls over asyncio; chunks are sent concurrently."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np

from . import calls
from . import protocol as p
from .client import client_kwargs, default_url
from .errors import ReplicasFailedError, RetryableError
from .replicas import Replicas, attempts_for, parse_urls, retryable


def _module(protocol: str):
    if protocol == "grpc":
        import tritonclient.grpc as sync
        import tritonclient.grpc.aio as aio
    elif protocol == "http":
        import tritonclient.http as sync
        import tritonclient.http.aio as aio
    else:
        raise ValueError(f"protocol must be 'grpc' or 'http', got {protocol!r}")
    return sync, aio


class AsyncEncoderClient:
    """``async with AsyncEncoderClient() as c: await c.embed(texts, model=...)``; a ``model``
    given here is used by every call that names none.  ``url`` may list replicas, with the
    same turns and retries as :class:`~nexus_sli.client.EncoderClient`.  ``timeout_s`` bounds
    every call to the server (None: no bound); a server that does not answer in time is a
    :class:`~nexus_sli.client.ServerUnavailableError`, retryable like one that is down."""

    def __init__(self, url: str | Sequence[str] | None = None, protocol: str = "grpc", model: str | None = None,
                 attempts: int | None = None, timeout_s: float | None = 60.0):
        self.protocol = protocol
        self.timeout_s = timeout_s
        self.model = model
        self._types, aio = _module(protocol)
        self.urls = parse_urls(url, default_url(protocol))
        self.url = self.urls[0]
        self.replicas = Replicas(self.urls)
        #: replicas one request may try (each at most once)
        self.attempts = attempts_for(attempts, self.urls)
        options = client_kwargs(self._types, protocol)
        if protocol == "http" and timeout_s is not None:
            options["conn_timeout"] = timeout_s  # aiohttp's total time per request
        # gRPC: a deadline on each call (tritonclient's client_timeout); HTTP: the session's timeout above
        self._deadline = {"client_timeout": timeout_s} if protocol == "grpc" else {}
        self._clients = {u: aio.InferenceServerClient(u, **options) for u in self.urls}
        self._client = self._clients[self.url]
        self._info: dict[str, p.ModelInfo] = {}

    async def _on_replicas(self, model: str, call):
        """``await call(tritonclient)`` on the replicas in turn until one answers or a non-retryable error."""
        tried: list[tuple[str, RetryableError]] = []
        for url in self.replicas.order()[:self.attempts]:
            try:
                result = await call(self._clients[url])
            except Exception as exc:
                tried.append((url, retryable(exc, model, self.attempts, self.replicas, url)))
                continue
            self.replicas.succeeded(url)
            return result
        raise ReplicasFailedError(tried)

    async def info(self, model: str) -> p.ModelInfo:
        if model not in self._info:
            kwargs = {"as_json": True, **self._deadline} if self.protocol == "grpc" else {}

            async def read(client):
                ready = await client.is_model_ready(model, **self._deadline)
                config = await client.get_model_config(model, **kwargs)
                if not ready:
                    raise p.not_ready(model)
                return config

            config = await self._on_replicas(model, read)
            self._info[model] = p.ModelInfo.from_config(model, config.get("config", config))
        return self._info[model]

    async def _run(self, model: str, plan: calls.Plan):
        (await self.info(model)).expect(plan.task)
        outputs = await asyncio.gather(*(self._infer(model, r, plan.output) for r in plan.requests))
        return plan.finish(list(outputs))

    async def _infer(self, model: str, request: calls.Request, output: str) -> np.ndarray:
        inputs = []
        for name, array in request.items():
            tensor = self._types.InferInput(name, list(array.shape), "BYTES")
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        outputs = [self._types.InferRequestedOutput(output)]
        try:
            result = await self._on_replicas(model, lambda client: client.infer(model, inputs, outputs=outputs,
                                                                              **self._deadline))
        except Exception:
            self._info.pop(model, None)
            raise
        return result.as_numpy(output)

    async def _call(self, model: str | None, plan):
        model = p.model_name(model, self.model)
        return await self._run(model, plan(await self.info(model)))

    async def embed(self, texts, model: str | None = None) -> np.ndarray:
        return await self._call(model, lambda info: calls.embed(texts, info))

    async def classify(self, texts, model: str | None = None, top_k: int = 1):
        return await self._call(model, lambda info: calls.classify(texts, info, top_k))

    async def ner(self, texts, model: str | None = None):
        return await self._call(model, lambda info: calls.ner(texts, info))

    async def answer(self, question: str, context: str, model: str | None = None, top_k: int = 1):
        return await self._call(model, lambda info: calls.answer(question, context, info, top_k))

    async def rerank(self, query: str, documents, model: str | None = None, top_k: int | None = None):
        return await self._call(model, lambda info: calls.rerank(query, documents, info, top_k))

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()

    async def __aenter__(self) -> "AsyncEncoderClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
