"""Export records as the pipeline writes them, for tests that read them without exporting."""

from __future__ import annotations

FP32 = {"precision": "fp32", "backend": "onnxruntime", "thresholds": {"max_abs_diff": 0.0001}, "texts": 240,
        "max_abs_diff": 1.1920928955078125e-06, "cosine_min": 0.999999999999966, "cosine_mean": 0.9999999999999871,
        "agreement": None, "decisions": 0, "ties": 0, "reference": "pytorch-fp32", "failures": [], "passed": True}


def measured_row(precision: str, graph: str, passed: bool, chosen: bool = False) -> dict:
    return {"backend": "onnxruntime", "precision": precision, "graph": graph, "passed": passed,
            "cosine_min": 0.99999 if passed else 0.93, "cosine_mean": 0.99999 if passed else 0.99, "agreement": None,
            "max_abs_diff": 1e-06 if passed else 0.2,
            "timings_ms": {"batch of 32": 104.2, "one short text": 0.41} if passed else {},
            "score": (1.0 if chosen else 1.0812) if passed else None, "chosen": chosen}


def version_1() -> dict:
    """validation.json as the pipeline wrote it before the ``version`` key: an auto export of two
    configurations on the CPU, one of which failed."""
    heat = {"onnxruntime fp32 plain": 1.0, "onnxruntime fp32 fused": 1.0812}
    return {
        **FP32, "model": "sentence-transformers/all-MiniLM-L6-v2", "model_type": "bert", "task": "embedding",
        "graph": "plain", "requested_backend": "auto", "requested_precision": "auto", "device": "cpu",
        "validated_on": "the runtime that serves it, on this machine",
        "attempts": [{"backend": "onnxruntime", "precision": "fp32", "reason": "auto: exact", "passed": True,
                      "failures": []},
                     {"backend": "onnxruntime", "precision": "int8", "reason": "auto: faster", "passed": False,
                      "failures": ["plain: fidelity: cosine_min 0.93 < 0.98"], "left_out": "no NNCF static one"}],
        "allow_degraded": False,
        "candidates": [{"graph": "plain", "passed": True, "latency_ms": 104.61, "score": 1.0,
                        "max_abs_diff": 1e-06, "cosine_min": 0.99999},
                       {"graph": "fused", "passed": True, "latency_ms": 110.2, "score": 1.0812,
                        "max_abs_diff": 1e-06, "cosine_min": 0.99999}],
        "measured": [measured_row("fp32", "plain", True, chosen=True), measured_row("fp32", "fused", True),
                     {**measured_row("int8", "plain", False)}],
        "workloads": ["batch of 32 (32 x 128 tokens)", "one short text (1 x 13 tokens)"],
        "timing": {"optimize": "balanced", "heats": [{"score": heat, "fastest": "onnxruntime fp32 plain",
                                                       "rounds": 5}],
                   "memory_budget_bytes": 11481028608, "estimated_bytes": {label: 268524 for label in heat},
                   "why": "every graph open at once, side by side", "score": "each workload's median ..."},
        "large_model": False, "inputs": ["input_ids", "attention_mask", "token_type_ids"], "truncate": True,
        "max_length": 256, "pooling": "mean", "normalize": True, "pooled_in_graph": True,
        "outputs": ["EMBEDDING", "TOKEN_EMBEDDINGS"],
        "walk": {"layers": 6, "from_cache": 0, "tensors": 101, "skipped": {"unused": ["pooler.dense.weight"]},
                 "absent_optional": []},
    }
