"""ORT transformer-optimizer fusion, and the timing that decides whether it stays.

Fusion is not automatically faster (docs/export.md, "Validation", shows a fused
graph losing), so the exporter times both graphs side by side on the same workload
(:mod:`timing`) and keeps the faster one that validates.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path

from . import onnx_files
from .threads import export_threads

log = logging.getLogger(__name__)


def fuse(plain: Path, target: Path, num_heads: int, hidden_size: int, large: bool,
         use_gpu: bool = False) -> dict[str, int] | None:
    """Write the fused graph (``use_gpu``: the fusions ONNX Runtime's CUDA provider runs); return its fused-operator
    counts, or None if nothing fused.  ``large``: the plain graph has a data file (:attr:`ExportedGraph.large`)."""
    from onnxruntime.transformers.optimizer import optimize_model

    try:
        optimized = optimize_model(str(plain), model_type="bert", num_heads=num_heads, hidden_size=hidden_size,
                                   use_gpu=use_gpu)
    except Exception as exc:  # the optimizer's pattern matchers raise freely on unfamiliar graphs
        log.info("transformer optimizer failed, keeping the plain graph: %s", exc)
        return None
    counts = {op: n for op, n in optimized.get_fused_operator_statistics().items() if n}
    if counts:
        optimized.save_model_to_file(str(onnx_files.prepare(target)), use_external_data_format=onnx_files.external(plain))
    del optimized
    free_cycles(plain, large)
    return counts or None


#: From this size of graph (bytes) the graph tools' reference cycles are collected at once (:func:`free_cycles`).
COLLECT_FROM_BYTES = 64 * 2**20


def free_cycles(plain: Path, large: bool) -> None:
    """Collect the reference cycles in which the graph tools (the transformer optimizer, the quantizers) leave the
    graphs they loaded, where the graph is large: Python frees them only at its next cyclic collection, whenever that
    comes, and until then a large model's graphs stay resident (bench/data/tried.md, "Exporter constants").  A
    collection walks every object of the process (a few hundred milliseconds once PyTorch is loaded): most of a small
    model's export, whose graphs can wait for Python's own next collection.  Large: the plain graph the tools read
    has a data file (``large``), or is one file of :data:`COLLECT_FROM_BYTES` or more."""
    if large or plain.stat().st_size >= COLLECT_FROM_BYTES:
        gc.collect()


#: Whether ONNX Runtime's idle intra-op threads spin between runs: no, as in the served encoder by default
#: (``serving/backends/onnxruntime_backend.py``).  Timing runs the candidates in turns, and a spinning thread
#: of one graph's session keeps a core busy after its run, slowing whichever graph runs next (an OpenVINO one,
#: or another session's); it would also time ONNX Runtime's graphs otherwise than they are served.
SPINNING = "0"


def session(path: Path, threads: int = 0, providers: tuple[str, ...] = ()):
    """An ONNX Runtime session on the first of ``providers`` this onnxruntime has, else the CPU, with
    ``threads`` intra-op threads (0: :func:`threads.export_threads`) that sleep between runs (:data:`SPINNING`)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or export_threads()
    options.add_session_config_entry("session.intra_op.allow_spinning", SPINNING)
    options.log_severity_level = 3
    available = [p for p in providers if p in ort.get_available_providers()]
    return ort.InferenceSession(str(path), options, providers=[*available, "CPUExecutionProvider"])
