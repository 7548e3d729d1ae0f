"""ORT transformer-optimizer fusion, and the timing that decides whether it stays.

Fusion is not automatically faster (docs/export.md, "Validation", shows a fused
graph losing), so the exporter times both graphs on the same input and keeps
the faster one that validates.
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)


def fuse(plain: Path, target: Path, num_heads: int, hidden_size: int) -> dict[str, int] | None:
    """Write the fused graph; return its fused-operator counts, or None if nothing fused."""
    from onnxruntime.transformers.optimizer import optimize_model

    try:
        optimized = optimize_model(str(plain), model_type="bert", num_heads=num_heads, hidden_size=hidden_size)
    except Exception as exc:  # the optimizer's pattern matchers raise freely on unfamiliar graphs
        log.info("transformer optimizer failed, keeping the plain graph: %s", exc)
        return None
    counts = {op: n for op, n in optimized.get_fused_operator_statistics().items() if n}
    if not counts:
        return None
    optimized.save_model_to_file(str(target))
    return counts


def session(path: Path, threads: int = 0, providers: tuple[str, ...] = ()):
    """An ONNX Runtime session on the first of ``providers`` this onnxruntime has, else the CPU."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    available = [p for p in providers if p in ort.get_available_providers()]
    return ort.InferenceSession(str(path), options, providers=[*available, "CPUExecutionProvider"])


def median_latency_ms(sess, feeds: dict[str, np.ndarray], repeats: int = 5) -> float:
    """Median wall time of one ``sess.run`` on ``feeds`` after two warm-up runs."""
    for _ in range(2):
        sess.run(None, feeds)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sess.run(None, feeds)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def timing_feeds(input_names: list[str], vocab_size: int, length: int, batch: int = 8) -> dict[str, np.ndarray]:
    """A fixed, unpadded batch for timing graphs against each other."""
    ids = np.random.default_rng(7).integers(5, max(vocab_size, 6), size=(batch, length), dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
    return {name: feeds[name] for name in input_names}
