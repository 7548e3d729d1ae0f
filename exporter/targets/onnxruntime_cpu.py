"""ONNX Runtime on the CPU (Triton platform ``onnxruntime_onnx``).

fp32 offers the plain graph and, where ONNX Runtime's transformer optimizer
fuses anything, the fused one: fusion is not faster on every CPU, so both are
timed.  int8 is dynamic quantization of each, with and without the
feed-forward output projections kept in fp32 (:mod:`quantize`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from nexus_sli.exporter.export.optimize import fuse, session
from nexus_sli.exporter.export.quantize import quantize_int8

from nexus_sli.exporter.triton.config import EncoderServing

from .base import Candidate, ExportedGraph, Target

log = logging.getLogger(__name__)


class OnnxRuntimeCPU(Target):
    name = "onnxruntime"
    precisions = ("fp32", "int8")

    def candidates(self, graph: ExportedGraph, precision: str) -> list[Candidate]:
        graphs = [Candidate("plain", graph.plain), *self._fused(graph)]
        if precision == "int8":
            graphs = [variant for c in graphs for variant in self._int8_variants(graph, c)]
        return [Candidate(c.graph, graph.trimmed(c.path)) for c in graphs]

    def _fused(self, graph: ExportedGraph) -> list[Candidate]:
        log.info("fusing the plain graph with ONNX Runtime's transformer optimizer")
        target = graph.work / "fused.onnx"
        counts = fuse(graph.plain, target, graph.family.num_heads(graph.config), graph.family.hidden_size(graph.config))
        if not counts:
            return []
        log.info("transformer optimizer fused %s", ", ".join(f"{n} {op}" for op, n in counts.items()))
        return [Candidate("fused", target)]

    @staticmethod
    def _int8_variants(graph: ExportedGraph, source: Candidate) -> list[Candidate]:
        log.info("quantizing the %s graph to int8 (ONNX Runtime, dynamic)", source.graph)
        variants = [Candidate(source.graph, quantize_int8(source.path, graph.work / f"{source.graph}.int8.onnx"))]
        keep = graph.ffn_outputs(source.path)
        if keep:
            path = quantize_int8(source.path, graph.work / f"{source.graph}.int8-ffn-fp32.onnx", exclude=keep)
            variants.append(Candidate(f"{source.graph}+ffn-out-fp32", path))
        return variants

    def open(self, path: Path, parameters: dict[str, str]):
        return session(path)

    def serving(self, precision: str) -> EncoderServing:
        return EncoderServing(platform="onnxruntime_onnx")
