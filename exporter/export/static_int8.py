"""Static int8: NNCF post-training quantization, calibrated on project texts.

Two runtimes serve it: OpenVINO reads NNCF's IR (:func:`quantize_ir`), ONNX
Runtime a QDQ ONNX graph NNCF writes from the plain graph (:func:`quantize_qdq`).
Both use the same calibration texts (``data/calibration_texts.txt``: the
project's 330 topic sentences and 42 paragraphs joined from them, none of them a
validation text), the same SmoothQuant alpha and the same choice of MatMuls kept
in higher precision (the target names them), so that one measured recipe serves
either runtime.

Why ONNX Runtime gets a static int8 besides its dynamic one: the dynamic int8
scales each MatMul's input by one per-batch range, which a few outlier hidden
dimensions set for every token, so that no dynamic variant keeps the ``auto``
bar on a small sentence encoder.  SmoothQuant moves those outliers into the
weights, and with the attention and feed-forward output projections in fp32 the
static graph keeps it.  It matters on CPUs where OpenVINO's int8 of the same
recipe is slower than fp32 (bench/data/tried.md, "Faithful int8 on AVX2 without
VNNI" and "ONNX Runtime static int8").
"""

from __future__ import annotations

import logging
import tempfile
from importlib import resources
from pathlib import Path

import numpy as np

from nexus_sli.exporter.triton.python_models.encoding import encode

CALIBRATION_BATCH = 16
#: Calibration texts per batch for a graph past 2 GB: NNCF holds every activation it collects statistics of
#: for a whole batch at once, so smaller batches lower its peak memory over the same texts
#: (bench/data/tried.md, "Exporter constants").
LARGE_MODEL_CALIBRATION_BATCH = 4

#: SmoothQuant's alpha for MatMuls in the variants that keep the attention output projections:
#: 0.75 kept the bar where NNCF's default 0.95 broke a short text and 0.5 did less
#: (bench/data/tried.md, "int8 that keeps the bar: static levers")
SMOOTH_QUANT_ALPHA = 0.75

#: the graph label of ONNX Runtime's static int8 candidate (validation.json's ``graph``; the bench reads it)
STATIC_INT8_GRAPH = f"plain+static-sq{SMOOTH_QUANT_ALPHA}+attn-ffn-out-fp32"


def calibration_texts() -> list[str]:
    text = resources.files("nexus_sli.exporter.export").joinpath("data/calibration_texts.txt").read_text("utf-8")
    return [line for line in text.splitlines() if line.strip()]


def calibration_feeds(tokenizer, input_names: list[str], pad_id: int, max_length: int,
                      pairs: bool, batch: int = CALIBRATION_BATCH) -> list[dict[str, np.ndarray]]:
    texts = calibration_texts()
    if pairs:
        texts = list(zip(texts, texts[1:] + texts[:1]))
    return [encode(tokenizer, texts[i:i + batch], input_names, pad_id, max_length)
            for i in range(0, len(texts), batch)]


def _quantize(model, calibration: list[dict[str, np.ndarray]], keep: list[str], smooth_quant_alpha: float | None,
              ignored_types: list[str] | None = None, backend_params: dict | None = None):
    """``nncf.quantize`` of an OpenVINO or ONNX ``model`` with the MatMuls named in ``keep`` (and every node of
    ``ignored_types``) left out, and ``smooth_quant_alpha`` (None: NNCF's default) for MatMuls."""
    import nncf
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, AdvancedSmoothQuantParameters

    # NNCF logs every operation it leaves unquantized at INFO: the export log has its own summary
    nncf.set_log_level(logging.WARNING)
    scope = (nncf.IgnoredScope(names=list(keep), types=list(ignored_types or []), validate=False)
             if keep or ignored_types else None)
    advanced = AdvancedQuantizationParameters(
        **({"smooth_quant_alphas": AdvancedSmoothQuantParameters(matmul=smooth_quant_alpha)}
           if smooth_quant_alpha is not None else {}),
        **({"backend_params": backend_params} if backend_params else {}))
    return nncf.quantize(model, nncf.Dataset(calibration), model_type=nncf.ModelType.TRANSFORMER,
                         subset_size=len(calibration), ignored_scope=scope, advanced_parameters=advanced)


def quantize_ir(source: Path, target: Path, calibration: list[dict[str, np.ndarray]],
                keep: list[str] | None = None, smooth_quant_alpha: float | None = None) -> Path:
    """NNCF static int8 of the ONNX graph ``source`` as the OpenVINO IR ``target`` (``.xml``);
    the MatMuls named in ``keep`` stay in higher precision."""
    import openvino as ov

    quantized = _quantize(ov.Core().read_model(str(source)), calibration, keep or [], smooth_quant_alpha)
    ov.save_model(quantized, str(target), compress_to_fp16=False)
    return target


def quantize_qdq(source: Path, target: Path, calibration: list[dict[str, np.ndarray]],
                 keep: list[str] | None = None, smooth_quant_alpha: float | None = None) -> Path:
    """NNCF static int8 of the ONNX graph ``source`` as the QDQ ONNX graph ``target``, for ONNX Runtime.

    ``source`` is the plain graph, not the pooled one: NNCF's ONNX pre-pass removes no-op Casts and fails on
    one that writes a graph output (the pooled graph's token states), so the target appends the pooling after
    quantizing, in fp32, as it does for the dynamic int8."""
    import onnx
    from nncf.onnx.quantization.backend_parameters import BackendParameters

    from . import onnx_files

    # NNCF copies and serializes the graph at each of its steps and infers its shapes several times: handed the
    # graph without its weights, which it reads from the data file beside it, it writes the same graph sooner
    # (bench/data/tried.md, "Five minutes reached")
    with tempfile.TemporaryDirectory(prefix="nncf-", dir=Path(target).parent) as folder:
        detached = onnx_files.detach(source, Path(folder) / Path(source).name)
        # NNCF's default overflow fix (7-bit weights in the first layer only) is kept: 7-bit weights everywhere,
        # meant for CPUs without VNNI, lost fidelity on an AVX2 CPU, enough to put a base-size model under the
        # auto bar (bench/data/tried.md, "ONNX Runtime static int8")
        quantized = _quantize(
            onnx.load(str(detached), load_external_data=False), calibration, keep or [], smooth_quant_alpha,
            # The embedding tables feed Gathers: quantized, ONNX Runtime would dequantize the whole table on
            # every run, where OpenVINO folds it once (bench/data/tried.md, "ONNX Runtime static int8").
            ignored_types=["Gather"], backend_params={BackendParameters.EXTERNAL_DATA_DIR: folder})
    return onnx_files.save(unsigned_activations(quantized), target)


def unsigned_activations(model):
    """``model`` with each activation's int8 QuantizeLinear/DequantizeLinear pair made uint8 (zero point + 128,
    the same scale: every value dequantizes as before).  NNCF writes int8 wherever a range reaches below 0, but
    ONNX Runtime's x86 integer kernels take u8 activations: from int8 ones its optimizer left most MatMuls
    dequantized in fp32 and ran a short text slower than fp32 (bench/data/tried.md, "ONNX Runtime static
    int8")."""
    import onnx
    from onnx import numpy_helper

    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    readers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    changed: set[str] = set()
    outputs: set[str] = set()
    for quantize in graph.node:
        if quantize.op_type != "QuantizeLinear" or quantize.input[0] in initializers:
            continue  # weights stay int8: ONNX Runtime wants s8 weights
        zero = quantize.input[2] if len(quantize.input) > 2 else ""
        if zero not in initializers or initializers[zero].data_type != onnx.TensorProto.INT8:
            continue  # no zero point (uint8 already) or not an int8 one
        dequantizers = readers.get(quantize.output[0], [])
        if not dequantizers or any(node.op_type != "DequantizeLinear" for node in dequantizers):
            raise ValueError(f"{quantize.name}: a QuantizeLinear read by anything but DequantizeLinear")
        zeros = {zero, *(node.input[2] if len(node.input) > 2 else "" for node in dequantizers)}
        pair = {quantize.name, *(node.name for node in dequantizers)}
        if not zeros <= set(initializers) or any(node.name not in pair for z in zeros for node in readers[z]):
            raise ValueError(f"{quantize.name}: a zero point missing from its DequantizeLinear or shared beyond "
                             "the pair")
        outputs.add(quantize.output[0])
        for name in zeros - changed:
            shifted = numpy_helper.to_array(initializers[name]).astype(np.int16) + 128
            initializers[name].CopyFrom(numpy_helper.from_array(shifted.astype(np.uint8), name))
            changed.add(name)
    for info in [*graph.value_info, *graph.output]:
        if info.name in outputs:
            info.type.tensor_type.elem_type = onnx.TensorProto.UINT8
    return model
