"""What the HTTP gateway costs over the client's direct gRPC, and what its token counts cost.

``.venv/bin/python -m nexus_sli.bench.experiments.gateway_overhead`` serves
``bench/.repo`` with ``nexus-sli gateway`` in front, then, rounds interleaved:
texts/s for client batches of 32 over the first 256 bench texts (the client over
gRPC direct; the gateway through the ``openai`` SDK with base64 and with float
vectors; the ``<model>_tokenizer`` model alone, which is the token count's extra
work), and the p50/p99 of sequential single short queries (direct, gateway).
"""

from __future__ import annotations

import time

import numpy as np
import tritonclient.grpc as grpcclient

from nexus_sli.client.protocol import strings

from ..served import Gateway, GatewayEmbedder, ServedEmbedder, Server
from . import MODEL, served_inputs

TEXTS = 256
BATCH = 32


class _Float(GatewayEmbedder):
    def embed_with(self, client, texts: list[str]) -> np.ndarray:
        response = client.embeddings.create(model=self.model, input=texts, encoding_format="float")
        return np.array([item.embedding for item in response.data], dtype=np.float32)


def _tokenizer_only(url: str):
    client = grpcclient.InferenceServerClient(url)

    def run(texts: list[str]) -> None:
        tensor = grpcclient.InferInput("TEXT", [len(texts), 1], "BYTES")
        tensor.set_data_from_numpy(strings(texts).reshape(-1, 1))
        client.infer(f"{MODEL}_tokenizer", [tensor], outputs=[grpcclient.InferRequestedOutput("attention_mask")])
    return run


def _rate(run, texts: list[str]) -> float:
    started = time.perf_counter()
    for i in range(0, len(texts), BATCH):
        run(texts[i:i + BATCH])
    return len(texts) / (time.perf_counter() - started)


def main(rounds: int = 5) -> None:
    repo, texts, short = served_inputs()
    texts = texts[:TEXTS]
    with Server(repo) as server, Gateway(server.url("grpc")) as gateway:
        direct = ServedEmbedder(server.url("grpc"), "grpc", MODEL)
        base64_, float_ = GatewayEmbedder(gateway.url, "openai-http", MODEL), _Float(gateway.url, "openai-http", MODEL)
        paths = {"client, gRPC direct": lambda b: direct.embed_with(direct.client, b),
                 "gateway, openai SDK, base64": lambda b: base64_.embed_with(base64_.client, b),
                 "gateway, openai SDK, float": lambda b: float_.embed_with(float_.client, b),
                 "tokenizer model alone (the token count)": _tokenizer_only(server.url("grpc"))}
        for run in paths.values():
            run(texts[:BATCH])
        rates = {name: [] for name in paths}
        for _ in range(rounds):
            for name, run in paths.items():
                rates[name].append(_rate(run, texts))
        print(f"batches of {BATCH}, {len(texts)} bench texts, {rounds} rounds interleaved (texts/s):")
        for name, values in rates.items():
            print(f"  {name}: median {np.median(values):.1f}, rounds {[round(v) for v in values]}")
        print(f"sequential single short queries ({len(short)}), ms:")
        for name, embedder in (("client, gRPC direct", direct), ("gateway, openai SDK, base64", base64_)):
            sample = embedder.sequential(short)
            print(f"  {name}: p50 {np.percentile(sample.latencies_ms, 50):.2f}, "
                  f"p99 {np.percentile(sample.latencies_ms, 99):.2f}")
        for embedder in (direct, base64_, float_):
            embedder.close()


if __name__ == "__main__":
    main()
