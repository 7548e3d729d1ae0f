"""Synthetic bench rows: runs whose paired ratios the targets' tests know in advance."""

from __future__ import annotations

DEFAULT = {"label": "fp32", "backend": "onnxruntime", "precision": "fp32"}
#: a compute-limit estimate under which the served default's batches (300-330 texts/s) reach 50-55% of the peak
LIMIT = {"flops_per_text": 1e9, "peaks": {"fp32": {"flops": 600e9, "instruction_set": "avx2-fma"}}}


def synthetic(path, mode, *, rates=None, p50=None, p99=None, precision="fp32", protocol="in-process",
               baseline=False, peer=None, cosine=(1.0, 1.0)):
    """One row as results._row writes it, with only what the targets read."""
    reps = rates or p50
    return {"path": path, "precision": precision, "protocol": protocol, "mode": mode, "baseline": baseline,
            "peer": peer, "repetitions": len(reps), "cosine_mean": cosine[0], "cosine_min": cosine[1],
            "texts_per_s": float(sorted(rates)[len(rates) // 2]) if rates else 1.0,
            "p50_ms": float(sorted(p50)[len(p50) // 2]) if p50 else None,
            "p99_ms": float(sorted(p99)[len(p99) // 2]) if p99 else None,
            "texts_per_s_reps": rates or [], "p50_ms_reps": p50 or [], "p99_ms_reps": p99 or []}


def run_rows(served_batch=(300, 330, 305), served_concurrent=(240, 250, 245), served_p50=(5.0, 5.2, 5.1),
              served_p99=(6.0, 6.1, 6.0), graph_p50=(3.6, 3.7, 3.6), graph_p99=(), cosine=(0.9999, 0.999),
              peers=True, served_short=(900, 990, 910), gateway_p50=(6.2, 6.5, 6.3),
              gateway_batch=(290, 320, 295), paired=None, plain_p50=None, plain_paired=None):
    """A run on three repetitions: the baseline slows down in the second (a noisy neighbour), the
    served default slows with it, so the paired ratios agree where medians of each alone would not.
    ``paired``: (the OpenAI route's, gRPC's) texts/s of batches sent in turn; ``plain_p50``: the OpenAI
    route's single queries from a plain HTTP client; ``plain_paired``: the route's texts/s from a plain HTTP
    client, sent in turn with both ``paired`` sides; a run without them is one from before they were."""
    rows = [
        synthetic("sentence-transformers", "batch32", rates=[100, 110, 101], baseline=True),
        synthetic("sentence-transformers", "latency1", p50=[7.0, 7.4, 7.1], baseline=True),
        synthetic("sentence-transformers", "short32", rates=[300, 330, 303], baseline=True),
        synthetic("triton", "short32", rates=list(served_short), protocol="grpc", cosine=cosine),
        synthetic("onnxruntime", "latency1", p50=list(graph_p50), p99=list(graph_p99)),
        synthetic("triton", "batch32", rates=list(served_batch), protocol="grpc", cosine=cosine),
        synthetic("triton", "concurrent16", rates=list(served_concurrent), protocol="grpc", cosine=cosine),
        synthetic("triton", "latency1", p50=list(served_p50), p99=list(served_p99), protocol="grpc", cosine=cosine),
        # the default through the gateway's routes (target (f))
        synthetic("gateway", "latency1", p50=list(gateway_p50), protocol="openai-http", cosine=cosine),
        synthetic("gateway", "latency1", p50=[6.0, 6.2, 6.1], protocol="tei-http", cosine=cosine),
        synthetic("gateway", "batch32", rates=list(gateway_batch), protocol="openai-http", cosine=cosine),
        # another configuration, faster but not the default: never judged
        synthetic("triton", "batch32", rates=[900, 990, 910], precision="int8", protocol="grpc"),
    ]
    if paired:
        rows += [synthetic("gateway", "paired32", rates=list(paired[0]), protocol="openai-http", cosine=cosine),
                 synthetic("triton", "paired32", rates=list(paired[1]), protocol="grpc", cosine=cosine)]
    if plain_paired:
        rows.append(synthetic("gateway", "paired32", rates=list(plain_paired), protocol="openai-http-plain",
                              cosine=cosine))
    if plain_p50:
        rows.append(synthetic("gateway", "latency1", p50=list(plain_p50), protocol="openai-http-plain", cosine=cosine))
    if peers:
        rows += [
            synthetic("fastembed", "batch32", rates=[200, 220, 205], peer="in-process"),
            synthetic("infinity-emb torch", "batch32", rates=[150, 160, 150], protocol="http", peer="server"),
            synthetic("infinity-emb torch", "concurrent16", rates=[120, 125, 121], protocol="http", peer="server"),
            synthetic("infinity-emb torch", "latency1", p50=[9.0, 9.5, 9.1], protocol="http", peer="server"),
            synthetic("infinity-emb optimum", "latency1", p50=[6.0, 6.3, 6.1], protocol="http", peer="server"),
        ]
    return rows


def by_comparison(results: list[dict]) -> dict[tuple[str, str], dict]:
    return {(t["target"][:3], t["comparison"].split(" (")[0].split(":")[0]): t for t in results}
