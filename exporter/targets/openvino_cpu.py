"""OpenVINO on the CPU (``--backend openvino``; Triton's ``openvino`` backend).

- fp32 and bf16 serve the padding-trimmed plain ONNX graph as it is; bf16 is
  OpenVINO's inference-precision hint (``HINT_BF16`` in the Triton config), so
  the graph stays one file and the CPU decides nothing by itself.  Where the
  CPU has no bf16 (:func:`cpu.supports_bf16`) the export falls back to fp32
  and says so.  ``auto`` picks bf16 only where the CPU has it.
- int8 is NNCF post-training static quantization of the OpenVINO model
  (:mod:`export.static_int8`, which says what it is calibrated on), written
  as an IR (``model.xml`` + ``model.bin``).  Quantizing every MatMul costs
  fidelity on real models (docs/export.md has the measurement), so besides
  the all-MatMul graph three variants keep MatMuls of one role in higher
  precision: the feed-forward output projections (the layers ONNX Runtime's
  int8 keeps in fp32, :func:`quantize.ffn_output_matmuls`); and, with
  SmoothQuant's alpha at :data:`SMOOTH_QUANT_ALPHA` instead of NNCF's 0.95, the
  attention output projections (:func:`quantize.attention_output_matmuls`),
  alone or with the feed-forward outputs.  All are validated; the fastest that
  passes is kept.  For dense embeddings, held to the ``auto`` bar whether
  ``auto`` chose int8 or it was named, only the two SmoothQuant variants are
  made: the other two never kept that bar in a kept run (docs/export.md, "What
  auto skips").  A graph past 2 GB (:attr:`ExportedGraph.large`) gets only
  :data:`LARGE_MODEL_VARIANT`, calibrated in smaller batches: there one NNCF
  run takes minutes and most of the export's memory (:meth:`OpenVINOCPU.left_out`).
  Each graph comes from the candidate cache where an earlier export made it
  (:meth:`ExportedGraph.derived`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from nexus_sli.exporter.export.candidate_cache import feeds_digest
from nexus_sli.exporter.export.pooling import pooling_nodes
from nexus_sli.exporter.export.static_int8 import (CALIBRATION_BATCH, LARGE_MODEL_CALIBRATION_BATCH, SMOOTH_QUANT_ALPHA,
                                                  calibration_feeds, quantize_ir)
from nexus_sli.exporter.export.validate import AUTO_BAR
from nexus_sli.exporter.export.threads import export_threads
from nexus_sli.exporter.serving.backends.openvino_properties import compile_properties
from nexus_sli.exporter.triton.config import EncoderServing
from nexus_sli.tasks.model_parameters import HINT_BF16, PERFORMANCE_HINT, write

from .base import MEASURED_TASK, Candidate, ExportedGraph, Target
from .cpu import BF16_FLAGS

log = logging.getLogger(__name__)


@dataclass
class _Port:
    name: str


class OpenVINOSession:
    """An OpenVINO compiled model with the few ``onnxruntime.InferenceSession``
    methods the exporter's validation and timing use."""

    def __init__(self, path: Path, params: dict | None = None):
        import openvino as ov

        core = ov.Core()
        properties = compile_properties(params or {})
        if export_threads() and "INFERENCE_NUM_THREADS" not in properties:
            properties["INFERENCE_NUM_THREADS"] = export_threads()
        model = core.read_model(str(path))
        # the graph's own names, read before compiling: the compiled ports bear every name of the tensors
        # OpenVINO folded together, and a port's first (sorted) name may then be an inner tensor's
        self._names = ([port.get_any_name() for port in model.inputs], [port.get_any_name() for port in model.outputs])
        self.compiled = core.compile_model(model, "CPU", properties)
        self.request = self.compiled.create_infer_request()

    def get_inputs(self) -> list[_Port]:
        return [_Port(name) for name in self._names[0]]

    def get_outputs(self) -> list[_Port]:
        return [_Port(name) for name in self._names[1]]

    def run(self, output_names, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        results = self.request.infer(feeds)
        ports = self.compiled.outputs
        if output_names is not None:
            # by any of a port's names, as the served backend finds them: OpenVINO merges folded tensors' names
            ports = [port for name in output_names for port in ports if name in port.get_names()]
        return [results[port].copy() for port in ports]


#: The one int8 variant a graph past 2 GB gets (:attr:`ExportedGraph.large`): the one ``auto`` kept where
#: OpenVINO int8 was fastest and passed (docs/export.md, "Choosing a backend").
LARGE_MODEL_VARIANT = f"plain+sq{SMOOTH_QUANT_ALPHA}+attn-out-fp32"

#: The int8 variants not made for dense embeddings (where the SmoothQuant ones are): every MatMul int8, and the
#: feed-forward outputs kept alone, missed the auto bar, which int8 is held to, in every kept run (docs/export.md,
#: "What auto skips")
NEVER_KEPT_THE_AUTO_BAR = ("plain", "plain+ffn-out-fp32")

#: OpenVINO int8 (NNCF static quantization, calibrated) is held to a higher bar than
#: ONNX Runtime's dynamic int8 for embeddings: the one ``auto`` asks of every configuration.
STATIC_INT8_THRESHOLDS = AUTO_BAR


class OpenVINOCPU(Target):
    name = "openvino"
    precisions = ("fp32", "bf16", "int8")

    def runnable(self, precision: str, flags: set[str]) -> str:
        if precision == "bf16" and not flags & BF16_FLAGS:
            log.warning("this CPU has no bf16 instructions (%s): exporting fp32 instead of bf16",
                        " or ".join(sorted(BF16_FLAGS)))
            return "fp32"
        return precision

    def suits(self, precision: str, flags: set[str]) -> bool:
        return precision != "bf16" or bool(flags & BF16_FLAGS)

    def thresholds(self, task, precision: str) -> dict[str, float] | None:
        return STATIC_INT8_THRESHOLDS if precision == "int8" and not task.agreement else None

    def candidates(self, graph: ExportedGraph, precision: str) -> list[Candidate]:
        trimmed = graph.trimmed(graph.plain)
        if precision != "int8":
            return [Candidate("plain", trimmed)]
        variants = self._int8_variants(graph)
        if graph.large:
            variants = [v for v in variants if v[0] == LARGE_MODEL_VARIANT] or variants[:1]
        elif graph.task.name == MEASURED_TASK:  # held to the auto bar, named or not (STATIC_INT8_THRESHOLDS)
            variants = [v for v in variants if v[0] not in NEVER_KEPT_THE_AUTO_BAR] or variants
        if graph.first_only:  # each variant is an NNCF run: only the one kept is made
            variants = variants[:1]
        # NNCF calibrates the trimmed graph, which reads the inputs its pooling adds too
        calibration = [graph.complete(feeds) for feeds in calibration_feeds(
            graph.tokenizer, graph.input_names, graph.pad_id, graph.max_length, graph.task.pair,
            LARGE_MODEL_CALIBRATION_BATCH if graph.large else CALIBRATION_BATCH)]
        log.info("int8 with NNCF on %d calibration texts in batches of %d (made, or restored from the cache): %s",
                 sum(len(f["input_ids"]) for f in calibration), len(calibration[0]["input_ids"]),
                 ", ".join(label for label, *_ in variants))
        pool = pooling_nodes(trimmed)  # an embedding graph's pooling stays in fp32 (:mod:`export.pooling`)
        digest = feeds_digest(calibration)
        made = []
        for label, suffix, keep, alpha in variants:
            target = graph.work / f"plain.ov-int8{suffix}.xml"
            path = graph.derived(target, partial(quantize_ir, trimmed, target, calibration, keep + pool, alpha),
                                 [trimmed], step="nncf static int8, openvino ir", keep=keep + pool, alpha=alpha,
                                 calibration=digest)
            made.append(Candidate(label, path))
        return made

    @staticmethod
    def _int8_variants(graph: ExportedGraph) -> list[tuple[str, str, list[str], float | None]]:
        """(graph label, file suffix, MatMuls kept in higher precision, SmoothQuant alpha) of each variant."""
        variants: list[tuple[str, str, list[str], float | None]] = [("plain", "", [], None)]
        ffn = graph.ffn_outputs(graph.plain)
        if ffn:
            variants.append(("plain+ffn-out-fp32", "-ffn-fp32", ffn, None))
        attention = graph.attention_outputs(graph.plain)
        if attention:
            roles = {"attn-out": attention, **({"attn-ffn-out": attention + ffn} if ffn else {})}
            variants += [(f"plain+sq{SMOOTH_QUANT_ALPHA}+{label}-fp32", f"-sq-{label}-fp32", keep, SMOOTH_QUANT_ALPHA)
                         for label, keep in roles.items()]
        return variants

    def left_out(self, graph: ExportedGraph, precision: str) -> str | None:
        if precision != "int8" or not graph.large:
            return None
        return (f"openvino int8: one NNCF variant ({LARGE_MODEL_VARIANT}, or plain where the graph has no "
                f"attention output projections) instead of four, calibrated in batches of "
                f"{LARGE_MODEL_CALIBRATION_BATCH} instead of {CALIBRATION_BATCH}: on xlm-roberta-large's shape one "
                "NNCF run took 10.5 min and 15.0 GiB in batches of 16, 7.4 min and 8.4 GiB in batches of 4 "
                "(docs/export.md, \"Models past 2 GB\")")

    def open(self, path: Path, parameters: dict[str, str]):
        return OpenVINOSession(path, parameters)

    def serving(self, precision: str) -> EncoderServing:
        # Triton's OpenVINO backend reads these parameter names.
        params = write({HINT_BF16: "YES" if precision == "bf16" else "NO", PERFORMANCE_HINT: "LATENCY"})
        return EncoderServing(backend="openvino", parameters=params)
