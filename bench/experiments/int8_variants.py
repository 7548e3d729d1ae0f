"""ONNX Runtime dynamic int8 variants of the bench's fp32 encoder: fidelity and speed.

``.venv/bin/python -m nexus_sli.bench.experiments.int8_variants`` quantizes the
served fp32 graph of ``bench/.repo`` with every combination tried (7-bit weights
for CPUs without VNNI, per-tensor weights, the feed-forward output projections
kept fp32) and prints, for each, the cosine of its embeddings to the fp32
graph's over the bench and validation texts, and its in-process speed relative
to fp32 (batches of 32 after a length sort, timed in the same process).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

from nexus_sli.exporter.export.optimize import session
from nexus_sli.exporter.export.quantize import Int8Config, ffn_output_matmuls, quantize_int8
from nexus_sli.exporter.export.validate import validation_texts

from ..runners import GraphEncoder, ServedFacts
from ..texts import bench_texts
from . import MODEL, bench_repository

VARIANTS = {  # name: (reduce_range, per_channel, keep feed-forward outputs fp32)
    "per-channel (the exporter's int8)": (False, True, False),
    "per-channel, 7-bit weights": (True, True, False),
    "per-channel, 7-bit, ffn-out fp32": (True, True, True),
    "per-tensor, 7-bit": (True, False, False),
    "per-channel, ffn-out fp32": (False, True, True),
}


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _seconds(encoder: GraphEncoder, texts: list[str]) -> float:
    start = time.perf_counter()
    encoder(texts)
    return time.perf_counter() - start


def main() -> None:
    repo = bench_repository()
    facts = ServedFacts.read(repo, MODEL)
    source = repo / f"{MODEL}_encoder" / "1" / "model.onnx"
    texts = bench_texts() + validation_texts()
    fp32 = GraphEncoder(session(source), facts, "onnxruntime")
    reference = _unit(fp32(texts))
    fp32_seconds = _seconds(fp32, bench_texts())
    ffn = ffn_output_matmuls(source, 1536, 384)
    with tempfile.TemporaryDirectory() as work:
        for name, (reduce_range, per_channel, keep_ffn) in VARIANTS.items():
            target = quantize_int8(source, Path(work) / "int8.onnx", ffn if keep_ffn else None,
                                   Int8Config(per_channel=per_channel, reduce_range=reduce_range))
            encoder = GraphEncoder(session(target), facts, "onnxruntime")
            cosine = (_unit(encoder(texts)) * reference).sum(axis=1)
            speed = fp32_seconds / _seconds(encoder, bench_texts())
            print(f"{name}: cosine mean {cosine.mean():.5f} min {cosine.min():.5f}; {speed:.2f}x fp32", flush=True)


if __name__ == "__main__":
    main()
