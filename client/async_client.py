"""``AsyncEncoderClient``: the same calls over asyncio; chunks are sent concurrently."""

from __future__ import annotations

import asyncio

import numpy as np

from . import calls
from . import protocol as p
from .client import client_kwargs, default_url


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
    given here is used by every call that names none."""

    def __init__(self, url: str | None = None, protocol: str = "grpc", model: str | None = None):
        self.protocol = protocol
        self.model = model
        self._types, aio = _module(protocol)
        self.url = url or default_url(protocol)
        self._client = aio.InferenceServerClient(self.url, **client_kwargs(self._types, protocol))
        self._info: dict[str, p.ModelInfo] = {}

    async def info(self, model: str) -> p.ModelInfo:
        if model not in self._info:
            kwargs = {"as_json": True} if self.protocol == "grpc" else {}
            try:
                ready = await self._client.is_model_ready(model)
                config = await self._client.get_model_config(model, **kwargs)
            except Exception as exc:
                raise p.translate(exc, model) from None
            if not ready:
                raise p.not_ready(model)
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
        try:
            result = await self._client.infer(model, inputs, outputs=[self._types.InferRequestedOutput(output)])
        except Exception as exc:
            self._info.pop(model, None)
            raise p.translate(exc, model) from None
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
        await self._client.close()

    async def __aenter__(self) -> "AsyncEncoderClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
