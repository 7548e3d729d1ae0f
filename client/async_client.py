"""``AsyncEncoderClient``: the same calls over asyncio; a call's chunks are sent as the synchronous client
sends them (:func:`fan_out.in_tasks`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import numpy as np

from nexus_sli.tasks.multi_vector import DOCUMENT

from . import calls, fan_out
from . import protocol as p
from .client import client_kwargs, default_url
from .model_info import ModelInfo
from .replicas import (REFRESH_S, RETRY_S, Fleet, Resolve, Retries, attempts_for, check_attempts, check_timeout,
                       gave_up, probe_async, retry_budget, retryable, unresolved)


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
    same turns and retries as :class:`~nexus_sli.client.EncoderClient` (``attempts``,
    ``retry_s``).  ``timeout_s`` bounds every call to the server (None: no bound); a server
    that does not answer in time is a :class:`~nexus_sli.client.DeadlineExceededError` (a
    :class:`~nexus_sli.client.ServerUnavailableError`), not sent again.  A list larger than the model's
    ``max_batch_size`` is sent as several requests, with the synchronous client's bound, order and error
    (:func:`~nexus_sli.client.fan_out.in_tasks`)."""

    def __init__(self, url: str | Sequence[str] | None = None, protocol: str = "grpc", *, model: str | None = None,
                 attempts: int | None = None, timeout_s: float | None = 60.0, retry_s: float = RETRY_S,
                 resolve: Resolve | None = None, refresh_s: float = REFRESH_S):
        self.protocol = protocol
        self.model = model
        self._types, aio = _module(protocol)
        # the arguments are checked before any connection is made (an asyncio one needs a running loop)
        self.timeout_s = check_timeout(timeout_s)
        retry_s = retry_budget(retry_s, check_attempts(attempts))
        try:  # the connections belong to the loop they are made in: gRPC's, made outside, fail every call later
            asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError("AsyncEncoderClient is made inside the event loop that uses it (in an async function: "
                               "`async with AsyncEncoderClient(...) as c:`); outside one, use EncoderClient") from None
        options = client_kwargs(self._types, protocol)
        if protocol == "http":
            # aiohttp's total time per request; None is no bound, given explicitly (tritonclient's default is 60 s)
            options["conn_timeout"] = timeout_s
        # gRPC: a deadline on each call (tritonclient's client_timeout); HTTP: the session's timeout above
        self._deadline = {"client_timeout": timeout_s} if protocol == "grpc" else {}
        self.fleet = Fleet(url, default_url(protocol), lambda u: aio.InferenceServerClient(u, **options),
                           resolve, refresh_s)
        self.replicas = self.fleet.replicas
        #: replicas one request may try per pass (each at most once)
        self.attempts = attempts_for(attempts, self.fleet)
        #: how long one call keeps retrying retryable failures
        self.retry_s = retry_s
        self._info: dict[str, ModelInfo] = {}
        #: the version each model last answered with: another one drops its description (:func:`p.note_version`)
        self._versions: dict[str, str] = {}

    async def on_replicas(self, model: str, send):
        """``await send(tritonclient)`` on the replicas in turn until one answers or a non-retryable
        error; passes over them again, after pauses, while the call's retry budget lasts.  The typed calls
        are made through it, and so can any raw tritonclient call (the gateway's discovery, its tokenizer
        calls); ``model`` names the model in errors ("" for none)."""
        retries, tried = Retries(self.retry_s), []
        while (pause := retries.next_pause()) is not None:
            if pause:  # the first pass goes at once, without a turn of the event loop
                await asyncio.sleep(pause)
            self.fleet.refresh(failed=bool(tried))
            # the pass's replicas and their connections at once: a refresh meanwhile may retire some
            order = self.fleet.turn(self.attempts)
            tried = [] if order else unresolved(self.fleet)
            try:
                for url, connection in order:
                    started = time.monotonic()
                    try:
                        if not self.replicas.answering(url):
                            await probe_async(url, self.timeout_s)
                        result = await send(connection)
                    except Exception as exc:
                        late = p.past_deadline(started, self.timeout_s)
                        tried.append((url, retryable(exc, model, self.replicas, url, late)))
                        continue
                    self.replicas.succeeded(url)
                    return result
            finally:
                for gone in self.fleet.done(order):
                    await gone.close()
        raise gave_up(tried) from None

    async def info(self, model: str) -> ModelInfo:
        """As :meth:`EncoderClient.info`."""
        # one read of the cache: another call's failure may drop the entry while this one awaits
        info = self._info.get(model)
        if info is None:
            kwargs = {"as_json": True, **self._deadline} if self.protocol == "grpc" else {}

            async def read(client):
                ready = await client.is_model_ready(model, **self._deadline)
                config = await client.get_model_config(model, **kwargs)
                if not ready:
                    raise p.not_ready(model)
                found = ModelInfo.from_config(model, config)
                if found.bound_by_step:
                    found = found.with_tokenizer_step(await client.get_model_config(found.tokenizer, **kwargs))
                return found, await client.get_model_metadata(model, **kwargs)

            info, metadata = await self.on_replicas(model, read)
            self._info[model] = info
            if version := p.newest_version(metadata):  # the version described: an answer from another drops it
                self._versions[model] = version
        return info

    async def _run(self, model: str, call: calls.Call):
        model = call.model or model
        (await self.info(model)).expect(call.task)
        return call.read(await fan_out.in_tasks(len(call.requests), lambda index: self._infer(model, call, index)))

    async def _infer(self, model: str, call: calls.Call, index: int) -> tuple[np.ndarray, ...]:
        inputs = []
        for name, array in call.requests[index].items():
            tensor = self._types.InferInput(name, list(array.shape), "BYTES")
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        outputs = [self._types.InferRequestedOutput(output) for output in call.outputs]
        kwargs = {**self._deadline, **p.queue_timeout(self.timeout_s),
                  **({"parameters": parameters} if (parameters := call.parameters_of(index)) else {})}
        try:
            result = await self.on_replicas(model, lambda client: client.infer(model, inputs, outputs=outputs,
                                                                              **kwargs))
        except Exception as exc:
            self._info.pop(model, None)  # the model may come back changed
            raise call.located(index, exc) from None
        p.note_version(self._versions, self._info, model, result)
        return tuple(result.as_numpy(output) for output in call.outputs)

    async def _call(self, model: str | None, make):
        model = p.model_name(model, self.model)
        return await self._run(model, make(await self.info(model)))

    async def embed(self, texts, model: str | None = None, prompt_name: str | None = None,
                    dimensions: int | None = None) -> np.ndarray:
        return await self._call(model, lambda info: calls.embed(texts, info, prompt_name, dimensions))

    async def embed_counted(self, texts, model: str | None = None,
                            prompt_name: str | None = None) -> tuple[np.ndarray, int]:
        """As :meth:`EncoderClient.embed_counted`: the vectors and the tokens the model read, from one call."""
        return await self._call(model, lambda info: calls.embed_counted(texts, info, prompt_name))

    async def embed_sparse(self, texts, model: str | None = None, prompt_name: str | None = None,
                           top_k: int | None = None, threshold: float = 0.0):
        return await self._call(model, lambda info: calls.embed_sparse(texts, info, prompt_name, top_k, threshold))

    async def embed_tokens(self, texts, model: str | None = None, prompt_name: str | None = None):
        return await self._call(model, lambda info: calls.embed_tokens(texts, info, prompt_name))

    async def embed_multi_vector(self, texts, model: str | None = None, input_type: str = DOCUMENT,
                                 prompt_name: str | None = None):
        """As :meth:`EncoderClient.embed_multi_vector`: each text's vectors, on the side ``input_type`` names."""
        return await self._call(model, lambda info: calls.embed_multi_vector(texts, info, input_type, prompt_name))

    async def embed_m3(self, texts, model: str | None = None, dense: bool = True, sparse: bool = True,
                       multi_vector: bool = True):
        """As :meth:`EncoderClient.embed_m3`: a BGE-M3 model's outputs per text, from one pass."""
        return await self._call(model, lambda info: calls.embed_m3(texts, info, dense, sparse, multi_vector))

    async def classify(self, texts, model: str | None = None, top_k: int = 1):
        return await self._call(model, lambda info: calls.classify(texts, info, top_k))

    async def ner(self, texts, model: str | None = None):
        return await self._call(model, lambda info: calls.ner(texts, info))

    async def answer(self, question: str, context: str, model: str | None = None, top_k: int = 1):
        return await self._call(model, lambda info: calls.answer(question, context, info, top_k))

    async def rerank(self, query: str, documents, model: str | None = None, top_k: int | None = None):
        return await self._call(model, lambda info: calls.rerank(query, documents, info, top_k))

    async def close(self) -> None:
        for client in self.fleet.connections():
            await client.close()

    async def __aenter__(self) -> "AsyncEncoderClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
