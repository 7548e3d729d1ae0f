"""The OpenVINO encoder target (``--backend openvino``).

- fp32 and bf16 serve the padding-trimmed plain ONNX graph as it is; bf16 is
  OpenVINO's inference-precision hint (``HINT_BF16`` in the Triton config), so
  the graph stays one file and the CPU decides nothing by itself.  Where the
  CPU has no bf16 (:func:`cpu.supports_bf16`) the export falls back to fp32
  and says so.
- int8 is NNCF post-training static quantization of the OpenVINO model,
  calibrated on ``data/calibration_texts.txt`` (the project's 330 topic
  sentences and 42 paragraphs joined from them; none of them is a validation
  text), written as an IR (``model.xml`` + ``model.bin``).  Measured on
  all-MiniLM-L6-v2: quantizing every MatMul gave min cosine 0.948; keeping the
  feed-forward output projections in higher precision passed (the same layers
  ONNX Runtime's int8 keeps in fp32, :func:`quantize.ffn_output_matmuls`).
  Both variants are made and validated; the exporter keeps the fastest that passes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from nexus_sli.exporter.triton.python_models.encoding import encode
from nexus_sli.exporter.serving.backends.openvino_properties import compile_properties

log = logging.getLogger(__name__)

CALIBRATION_BATCH = 16


def calibration_texts() -> list[str]:
    text = resources.files("nexus_sli.exporter.export").joinpath("data/calibration_texts.txt").read_text("utf-8")
    return [line for line in text.splitlines() if line.strip()]


@dataclass
class _Port:
    name: str


class OpenVINOSession:
    """An OpenVINO compiled model with the few ``onnxruntime.InferenceSession``
    methods the exporter's validation and timing use."""

    def __init__(self, path: Path, params: dict | None = None):
        import openvino as ov

        core = ov.Core()
        self.compiled = core.compile_model(core.read_model(str(path)), "CPU", compile_properties(params or {}))
        self.request = self.compiled.create_infer_request()

    def get_inputs(self) -> list[_Port]:
        return [_Port(port.get_any_name()) for port in self.compiled.inputs]

    def get_outputs(self) -> list[_Port]:
        return [_Port(port.get_any_name()) for port in self.compiled.outputs]

    def run(self, output_names, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        results = self.request.infer(feeds)
        ports = self.compiled.outputs
        if output_names is not None:
            ports = [port for name in output_names for port in ports if port.get_any_name() == name]
        return [results[port].copy() for port in ports]


def calibration_feeds(tokenizer, input_names: list[str], pad_id: int, max_length: int,
                      pairs: bool) -> list[dict[str, np.ndarray]]:
    texts = calibration_texts()
    if pairs:
        texts = list(zip(texts, texts[1:] + texts[:1]))
    return [encode(tokenizer, texts[i:i + CALIBRATION_BATCH], input_names, pad_id, max_length)
            for i in range(0, len(texts), CALIBRATION_BATCH)]


def quantize_int8(source: Path, target: Path, calibration: list[dict[str, np.ndarray]],
                  keep: list[str] | None = None) -> Path:
    """NNCF static int8 of the ONNX graph ``source`` as the IR ``target`` (``.xml``);
    the MatMuls named in ``keep`` stay in higher precision."""
    import nncf
    import openvino as ov

    model = ov.Core().read_model(str(source))
    scope = nncf.IgnoredScope(names=list(keep), validate=False) if keep else None
    quantized = nncf.quantize(model, nncf.Dataset(calibration), model_type=nncf.ModelType.TRANSFORMER,
                              subset_size=len(calibration), ignored_scope=scope)
    ov.save_model(quantized, str(target), compress_to_fp16=False)
    return target
