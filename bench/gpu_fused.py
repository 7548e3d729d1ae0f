"""The GPU repository with ONNX Runtime's fused graph: a lever the GPU check measures beside the exported one.

The GPU export's graph is the plain one in fp16 (one graph for TensorRT and for CUDA), its LayerNorms and
softmax kept in fp32 behind casts: on the CUDA provider a run of it is hundreds of small kernels, whose
launches the GPU waits on (bench/data/tried.md, "The GPU served path on an H200").  ONNX Runtime's transformer
optimizer fuses the plain fp32 graph for its CUDA provider (attention, embeddings, skip-LayerNorms, bias-GELUs
into single operators), and its converter then makes the fused graph fp16.  TensorRT parses none of those
operators, so this can only ever be the CUDA target's graph; whether it should be is for a GPU to say (the
exporter cannot time a GPU graph on the machine that exports it).  This writes the packaged model's GPU
repository with the fused graph, validated against PyTorch as every export is::

    python -m nexus_sli.bench.gpu_fused OUT_REPOSITORY

``bench/gpu_parts.sh`` carries it to the GPU host beside the exported repository, and ``bench/gpu_check.py
--fused-repository`` times, checks and serves it beside the exported graph.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
from pathlib import Path

from nexus_sli.exporter.export.fp16 import convert_fp16
from nexus_sli.exporter.export.optimize import fuse
from nexus_sli.exporter.export.pipeline import ExportOptions, ExportResult, run_export
from nexus_sli.exporter.targets import TARGETS
from nexus_sli.exporter.targets.base import Candidate, ExportedGraph
from nexus_sli.exporter.targets.onnxruntime_gpu import OnnxRuntimeCUDA

log = logging.getLogger(__name__)


class FusedCUDA(OnnxRuntimeCUDA):
    """The CUDA target, its one candidate the fused graph in fp16 (the exported pooling after it, in fp32)."""

    def candidates(self, graph: ExportedGraph, precision: str) -> list[Candidate]:
        fused = graph.work / "fused.gpu.onnx"
        counts = fuse(graph.plain, fused, graph.family.num_heads(graph.config), graph.family.hidden_size(graph.config),
                      graph.large, use_gpu=True)
        if not counts or "Attention" not in counts:
            raise RuntimeError(f"ONNX Runtime's optimizer fused no attention in this graph ({counts}): nothing to "
                               "measure against the plain graph")
        log.info("fused for the CUDA provider: %s", ", ".join(f"{n} {op}" for op, n in counts.items()))
        return [Candidate("fused-fp16", graph.pooled_graph(convert_fp16(fused, graph.work / "fused.gpu.fp16.onnx",
                                                                        keep_fp32=None)))]


@contextlib.contextmanager
def fused_cuda_target():
    """The CUDA target's registry entry replaced by :class:`FusedCUDA` while the context is open."""
    exported = TARGETS["onnxruntime-cuda"]
    TARGETS["onnxruntime-cuda"] = FusedCUDA()
    try:
        yield
    finally:
        TARGETS["onnxruntime-cuda"] = exported


def export_fused(out: Path, model: str | None = None, **options) -> ExportResult:
    """``model`` (the packaged one by default) exported for the CUDA provider with the fused graph into ``out``."""
    with fused_cuda_target():
        return run_export(ExportOptions(model=model, device="gpu", backend="onnxruntime-cuda", precision="fp16",
                                        out=out, **options))


def operators(path: Path) -> dict[str, int]:
    """The graph's operator types and how many nodes of each: what its run launches, roughly."""
    import onnx

    return dict(collections.Counter(node.op_type for node in onnx.load(str(path), load_external_data=False).graph.node)
                .most_common())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the repository to write")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result = export_fused(args.out)
    graph = args.out / f"{result.name}_encoder" / "1" / "model.onnx"
    found = operators(graph)
    print(json.dumps({"nodes": sum(found.values()), "operators": found,
                      "cosine_min": result.report.validation.cosine_min}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
