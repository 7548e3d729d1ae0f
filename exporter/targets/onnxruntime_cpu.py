"""ONNX Runtime on the CPU (Triton platform ``onnxruntime_onnx``).

fp32 offers the plain graph and, where ONNX Runtime's transformer optimizer
fuses anything, the fused one: fusion is not faster on every CPU, so both are
timed.  int8 is dynamic quantization of each, with and without the
feed-forward output projections kept in fp32 (:mod:`quantize`).  Where the
candidates are held to the ``auto`` bar, which no dynamic variant kept on a
real model, one more: NNCF's static int8 of the plain graph with SmoothQuant
and the attention and feed-forward output projections in fp32
(:mod:`static_int8`), slower than the dynamic ones but faithful.  For dense
embeddings, the task of the real models measured, it replaces them
(docs/export.md, "What auto skips").  A graph past 2 GB does not get it
(:meth:`OnnxRuntimeCPU.left_out`), nor does one NNCF cannot quantize: those
keep the dynamic variants.  Each quantized graph comes from the candidate
cache where an earlier export made it (:meth:`ExportedGraph.derived`).
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from functools import partial
from pathlib import Path

from nexus_sli.exporter.export.candidate_cache import feeds_digest
from nexus_sli.exporter.export.optimize import fuse, session
from nexus_sli.exporter.export.quantize import get_int8_config, quantize_int8
from nexus_sli.exporter.export.static_int8 import (SMOOTH_QUANT_ALPHA, STATIC_INT8_GRAPH, calibration_feeds,
                                                  quantize_qdq)

from nexus_sli.exporter.triton.config import EncoderServing

from .base import MEASURED_TASK, Candidate, ExportedGraph, Target

log = logging.getLogger(__name__)


class OnnxRuntimeCPU(Target):
    name = "onnxruntime"
    precisions = ("fp32", "int8")

    def candidates(self, graph: ExportedGraph, precision: str) -> list[Candidate]:
        measured = graph.task.name == MEASURED_TASK
        # the static graph comes first where it is made for the measured task, last (unwanted alone) elsewhere
        static = self._static_int8(graph) if precision == "int8" and (measured or not graph.first_only) else []
        if static and measured:  # the dynamic variants never kept the auto bar there
            return [Candidate(c.graph, graph.trimmed(c.path)) for c in static]
        graphs = [Candidate("plain", graph.plain), *([] if graph.first_only else self._fused(graph))]
        if precision == "int8":
            graphs = [variant for c in graphs for variant in self._int8_variants(graph, c)] + static
        return [Candidate(c.graph, graph.trimmed(c.path)) for c in graphs]

    def _fused(self, graph: ExportedGraph) -> list[Candidate]:
        log.info("fusing the plain graph with ONNX Runtime's transformer optimizer")
        target = graph.work / "fused.onnx"
        counts = fuse(graph.plain, target, graph.family.num_heads(graph.config), graph.family.hidden_size(graph.config),
                      graph.large)
        if not counts:
            return []
        log.info("transformer optimizer fused %s", ", ".join(f"{n} {op}" for op, n in counts.items()))
        return [Candidate("fused", target)]

    @staticmethod
    def _int8_variants(graph: ExportedGraph, source: Candidate) -> list[Candidate]:
        log.info("int8 of the %s graph (ONNX Runtime, dynamic; made, or restored from the cache)", source.graph)
        variants = [(source.graph, ".int8.onnx", [])]
        ffn = [] if graph.first_only else graph.ffn_outputs(source.path)
        if ffn:
            variants.append((f"{source.graph}+ffn-out-fp32", ".int8-ffn-fp32.onnx", ffn))
        made = []
        for label, suffix, keep in variants:
            target = graph.work / f"{source.graph}{suffix}"
            path = graph.derived(target, partial(quantize_int8, source.path, target, exclude=keep), [source.path],
                                 step="onnxruntime dynamic int8", exclude=keep, int8=asdict(get_int8_config()))
            made.append(Candidate(label, path))
        return made

    @staticmethod
    def _static_int8(graph: ExportedGraph) -> list[Candidate]:
        """NNCF's static int8 where the auto bar holds.  On an AVX2-only CPU it kept the bar where every
        dynamic variant missed it on real models, and still ran faster than ONNX Runtime fp32; keeping only
        one of the two roles in fp32 missed the bar (bench/data/tried.md, "ONNX Runtime static int8").  Where
        NNCF cannot quantize a family's graph, the export goes on without it."""
        if not graph.auto or graph.large:
            return []
        keep = graph.attention_outputs(graph.plain) + graph.ffn_outputs(graph.plain)
        if not keep:
            return []
        log.info("static int8 of the plain graph (NNCF, %s; made, or restored from the cache)", STATIC_INT8_GRAPH)
        calibration = calibration_feeds(graph.tokenizer, graph.input_names, graph.pad_id, graph.max_length,
                                        graph.task.pair)
        target = graph.work / "plain.static-int8.onnx"
        try:
            path = graph.derived(target, partial(quantize_qdq, graph.plain, target, calibration, keep,
                                                 SMOOTH_QUANT_ALPHA),
                                 [graph.plain], step="nncf static int8, qdq", keep=keep, alpha=SMOOTH_QUANT_ALPHA,
                                 calibration=feeds_digest(calibration))
        except Exception as exc:  # NNCF's ONNX backend raises its own and onnx's errors alike
            log.warning("onnxruntime int8: no %s candidate, NNCF could not quantize this graph: %s: %s",
                        STATIC_INT8_GRAPH, type(exc).__name__, exc)
            return []
        return [Candidate(STATIC_INT8_GRAPH, path)]

    def left_out(self, graph: ExportedGraph, precision: str) -> str | None:
        if precision != "int8" or not graph.auto or not graph.large:
            return None
        return ("onnxruntime int8: the dynamic variants only, no NNCF static one: NNCF's ONNX backend has not "
                "been run on a graph past 2 GB here, and its OpenVINO run on xlm-roberta-large's shape took "
                "7.4-10.5 min and 8.4-15.0 GiB (docs/export.md, \"Models past 2 GB\")")

    def open(self, path: Path, parameters: dict[str, str]):
        return session(path)

    def serving(self, precision: str) -> EncoderServing:
        return EncoderServing(platform="onnxruntime_onnx")
