"""Is one quantized node to blame for ONNX Runtime int8's worst texts?

``.venv/bin/python -m nexus_sli.bench.experiments.int8_sensitivity`` quantizes
the bench's fp32 encoder as the exporter does, finds the 40 calibration texts
(``exporter/data/calibration_texts.txt``, disjoint from the validation texts)
whose embeddings moved most, then re-quantizes once per quantized node with
that node alone kept fp32 and prints the 40 texts' min and mean cosine to fp32.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx

from nexus_sli.exporter.targets.openvino_cpu import calibration_texts
from nexus_sli.exporter.export.optimize import session
from nexus_sli.exporter.export.quantize import get_int8_config, quantize_int8
from nexus_sli.exporter.export.validate import validation_texts

from ..runners import GraphEncoder, ServedFacts
from ..texts import bench_texts
from . import MODEL, bench_repository

WORST = 40


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def main() -> None:
    repo = bench_repository()
    facts = ServedFacts.read(repo, MODEL)
    source = repo / f"{MODEL}_encoder" / "1" / "model.onnx"
    calibration, held_out = calibration_texts(), validation_texts() + bench_texts()
    fp32 = GraphEncoder(session(source), facts, "onnxruntime")
    ref_calibration, ref_held_out = _unit(fp32(calibration)), _unit(fp32(held_out))
    with tempfile.TemporaryDirectory() as work:
        target = Path(work) / "int8.onnx"

        def int8(exclude: list[str]) -> GraphEncoder:
            return GraphEncoder(session(quantize_int8(source, target, exclude)), facts, "onnxruntime")

        everything = int8([])
        cosine = (_unit(everything(calibration)) * ref_calibration).sum(axis=1)
        held = (_unit(everything(held_out)) * ref_held_out).sum(axis=1)
        worst = np.argsort(cosine)[:WORST]
        print(f"every node int8: calibration texts min {cosine.min():.4f} mean {cosine.mean():.5f}; "
              f"worst {WORST}: mean {cosine[worst].mean():.5f}; validation + bench texts min {held.min():.4f}")
        texts, reference = [calibration[i] for i in worst], ref_calibration[worst]
        quantized = set(get_int8_config().op_types)
        for node in [n.name for n in onnx.load(str(source)).graph.node if n.op_type in quantized]:
            kept = (_unit(int8([node])(texts)) * reference).sum(axis=1)
            print(f"{node} kept fp32: worst {WORST} min {kept.min():.4f} mean {kept.mean():.5f}", flush=True)


if __name__ == "__main__":
    main()
