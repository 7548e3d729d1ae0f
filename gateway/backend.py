"""The gateway's connection to Triton: task calls through ``AsyncEncoderClient``, and the
few server calls that client does not make (discovery, readiness, older exports' token counts).

Token counts (OpenAI's ``usage``) come from the served tokenizer, the ensemble's
first step: it answers each text's token count beside its token tensors, and an
embedding ensemble maps it to an output (``TOKEN_COUNT``), so one call answers
the vectors and their count (special tokens and the prompt included, after the
model's truncation: what the encoder saw).  An ensemble exported before that
output (``ModelInfo.counts_tokens`` false) is counted as before: its tokenizer
step, ``<name>_tokenizer``, a normal Triton model, is called with the same texts
at the same time as the ensemble, and each row's attention-mask ones are its
tokens, at the cost of one more python-backend execution per request.  A
tokenizer in the gateway would need the repository's tokenizer.json on the
gateway's machine.  TEI's ``/tokenize`` and ``/decode`` ask the same step for
its text modes (its ``TOKENS`` and ``DECODED`` outputs).
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import tritonclient.grpc as grpc_types

from nexus_sli.client import AsyncEncoderClient, ServerUnavailableError
from nexus_sli.client.error_codes import (
    ADD_SPECIAL_TOKENS_PARAMETER,
    DECODED_OUTPUT,
    IDS_INPUT,
    NO_TOKEN,
    PROMPT_PARAMETER,
    SKIP_SPECIAL_TOKENS_PARAMETER,
    TOKENS_OUTPUT,
)
from nexus_sli.client.model_info import ModelInfo
from nexus_sli.client.protocol import chunks, strings
from nexus_sli.client.replicas import Fleet, Resolve

from .discovery import Catalog

#: The longest the small calls (readiness, discovery) wait, whatever the inference timeout:
#: a health probe must not hang as long as a large batch may take.
CONTROL_TIMEOUT_S = 10.0


class AnyReplica:
    """tritonclient's asyncio gRPC client calls (readiness) made on the first replica of ``fleet`` that
    answers, each replica tried once, without pauses: a health probe must answer fast, not retry for
    ``--triton-retry``.  The last replica's exception is raised as tritonclient raised it."""

    def __init__(self, fleet: Fleet):
        self._fleet = fleet

    def __getattr__(self, method: str):
        async def call(*args, **kwargs):
            self._fleet.refresh()
            failure: Exception = ServerUnavailableError(f"{self._fleet.resolved and self._fleet.resolved.name} "
                                                        "has no server to ask")
            order = self._fleet.turn()  # with their connections: a refresh meanwhile may retire some
            try:
                for _, connection in order:
                    try:
                        return await getattr(connection, method)(*args, **kwargs)
                    except Exception as exc:  # noqa: BLE001 - the next replica may answer; the last error is raised
                        failure = exc
            finally:
                for gone in self._fleet.done(order):
                    await gone.close()
            raise failure
        return call


class Backend:
    """Triton over gRPC: one server, or every address of a ``dns:///NAME:PORT`` name (a headless
    Service), the inference calls spread over them by the client.  Made inside the running event
    loop (gRPC's asyncio channels belong to the loop that made them).  Every call has a deadline
    (``timeout_s``; the control calls at most :data:`CONTROL_TIMEOUT_S`): a Triton that hangs is
    answered like one that is down, with a 503."""

    def __init__(self, url: str, ttl_s: float, timeout_s: float = 60.0, retry_s: float = 0.0,
                 resolve: Resolve | None = None):
        self.url = url
        self.timeout_s = timeout_s
        self.control_timeout_s = min(timeout_s, CONTROL_TIMEOUT_S)
        self.client = AsyncEncoderClient(url, protocol="grpc", timeout_s=timeout_s, retry_s=retry_s, resolve=resolve)
        self.triton = AnyReplica(self.client.fleet)
        # discovery's reads (the model list, then each config) on one replica at a time, retried as the client
        # retries an inference (--triton-retry): a Triton restarting costs a request latency, not a 503.  The
        # client's own loop, shared rather than written twice: its replica turns, probes, pauses and budget
        self.catalog = Catalog(self.triton, ttl_s, self.control_timeout_s,
                               on_replicas=lambda read: self.client.on_replicas("", read))

    async def ready(self) -> bool:
        try:
            return bool(await self.triton.is_server_ready(client_timeout=self.control_timeout_s))
        except Exception:  # noqa: BLE001 - unreachable or too slow is not ready
            return False

    async def embed(self, model: ModelInfo, texts: list[str], prompt_name: str | None = None) -> np.ndarray:
        """Embeddings [n, dims], with the named prompt (None: the model's default prompt, if any)."""
        return await self.client.embed(texts, model=model.name, prompt_name=prompt_name)

    async def embed_counted(self, model: ModelInfo, texts: list[str],
                            prompt_name: str | None = None) -> tuple[np.ndarray, int]:
        """(embeddings [n, dims], tokens the model read, the prompt's included): one call where the ensemble
        answers the count, else the ensemble and its tokenizer step asked at once."""
        if model.counts_tokens:
            return await self.client.embed_counted(texts, model=model.name, prompt_name=prompt_name)
        vectors, tokens = await asyncio.gather(self.embed(model, texts, prompt_name),
                                               self.count_tokens(model, texts, prompt_name))
        return vectors, tokens

    async def count_tokens(self, model: ModelInfo, texts: list[str], prompt_name: str | None = None) -> int:
        """The tokens the tokenizer step makes of ``texts``, asked of it directly (an ensemble without the count)."""
        if model.tokenizer is None:
            return 0
        parameters = {PROMPT_PARAMETER: prompt_name} if prompt_name is not None else None
        counts = await asyncio.gather(*(self._tokens(model.tokenizer, chunk, parameters)
                                        for chunk in chunks(texts, model.max_batch_size)))
        return int(sum(counts))

    async def _tokens(self, tokenizer: str, texts: list[str], parameters: dict | None) -> int:
        """The tokens the tokenizer step makes of ``texts``: it applies the same prompt as the ensemble."""
        mask = await self._tokenizer_call(tokenizer, _text_tensor(texts), "attention_mask", parameters)
        return int(mask.sum())

    async def tokenize(self, model: ModelInfo, texts: list[str], prompt_name: str | None,
                       add_special_tokens: bool) -> list[dict]:
        """Each text's tokens, ``{"ids", "text", "special", "offsets", "bytes"}`` (error_codes.TOKENS_OUTPUT), from the
        model's tokenizer step, prompted as the ensemble prompts (None: the model's default prompt, if any)."""
        parameters = {ADD_SPECIAL_TOKENS_PARAMETER: add_special_tokens,
                      **({PROMPT_PARAMETER: prompt_name} if prompt_name is not None else {})}
        found = await asyncio.gather(*(self._tokenizer_call(model.tokenizer, _text_tensor(chunk), TOKENS_OUTPUT,
                                                            parameters)
                                       for chunk in chunks(texts, model.max_batch_size)))
        return [json.loads(item) for part in found for item in part.reshape(-1)]

    async def decode(self, model: ModelInfo, rows: list[list[int]], skip_special_tokens: bool) -> list[str]:
        """The text of each row of token ids, from the model's tokenizer step, in the order of ``rows``."""
        parameters = {SKIP_SPECIAL_TOKENS_PARAMETER: skip_special_tokens}
        groups = _id_groups(rows, model.max_batch_size)
        found = await asyncio.gather(*(self._tokenizer_call(model.tokenizer, _ids_tensor([rows[i] for i in group]),
                                                            DECODED_OUTPUT, parameters)
                                       for group in groups))
        texts = [""] * len(rows)
        for group, part in zip(groups, found):
            for index, item in zip(group, part.reshape(-1)):
                texts[index] = item.decode("utf-8")
        return texts

    async def _tokenizer_call(self, tokenizer: str, tensor: grpc_types.InferInput, output: str,
                              parameters: dict | None) -> np.ndarray:
        """``output`` of the tokenizer step for ``tensor``, on the replicas with the client's own passes and
        retries (--triton-retry), its errors the client's: as the inference calls beside it."""
        outputs = [grpc_types.InferRequestedOutput(output)]
        result = await self.client.on_replicas(tokenizer, lambda triton: triton.infer(
            tokenizer, [tensor], client_timeout=self.timeout_s, parameters=parameters, outputs=outputs))
        return result.as_numpy(output)

    async def close(self) -> None:
        await self.client.close()  # its connections are the control calls' too


def _text_tensor(texts: list[str]) -> grpc_types.InferInput:
    tensor = grpc_types.InferInput("TEXT", [len(texts), 1], "BYTES")
    tensor.set_data_from_numpy(strings(texts).reshape(-1, 1))
    return tensor


#: The most int64 cells one /decode request to the tokenizer step is padded to (several rows; a longer row goes
#: alone).  Its rows share one width: a long row padding a batch of short ones would make a request body of a
#: few megabytes of ids gigabytes of tensor, in the gateway and in the step.
DECODE_CELLS = 1 << 20


def _id_groups(rows: list[list[int]], max_rows: int) -> list[list[int]]:
    """The indices of ``rows`` grouped into tokenizer requests: shortest rows first, so that each row is padded
    to rows of about its own length, at most ``max_rows`` rows and :data:`DECODE_CELLS` cells a request."""
    groups: list[list[int]] = []
    for index in sorted(range(len(rows)), key=lambda i: len(rows[i])):
        width = max(len(rows[index]), 1)  # the widest of its group so far: the rows come shortest first
        if not groups or len(groups[-1]) >= max(max_rows, 1) or (len(groups[-1]) + 1) * width > DECODE_CELLS:
            groups.append([])
        groups[-1].append(index)
    return groups


def _ids_tensor(rows: list[list[int]]) -> grpc_types.InferInput:
    """Rows of token ids as one tensor: one request's rows share a width, the shorter padded with NO_TOKEN."""
    ids = np.full((len(rows), max(1, *map(len, rows))), NO_TOKEN, dtype=np.int64)
    for row, values in enumerate(rows):
        ids[row, :len(values)] = values
    tensor = grpc_types.InferInput(IDS_INPUT, list(ids.shape), "INT64")
    tensor.set_data_from_numpy(ids)
    return tensor
