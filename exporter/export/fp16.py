"""fp16 graphs for NVIDIA GPUs, made with ONNX Runtime's float16 converter.

Weights and most arithmetic become fp16; the graph's inputs and outputs stay
as they were (``keep_io_types``), so the tokenizer and post-processing models
see the same tensors as on the CPU.  Normalisation and softmax stay in fp32
(:data:`FP32_OPS`): their sums of squares and of exponentials overflow or lose
their precision in fp16.  Constants are clamped into fp16's finite range, so
the attention mask's additive value (fp32's lowest number in the PyTorch
graph) becomes -65504, not -inf.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from . import onnx_files

#: Ops the converter leaves in fp32 (it casts around them).
FP32_OPS = ("LayerNormalization", "SkipLayerNormalization", "SimplifiedLayerNormalization",
            "SkipSimplifiedLayerNormalization", "Softmax", "ReduceMean", "Pow", "Sqrt")
#: fp16's largest finite value.
FP16_MAX = 65504.0


def convert_fp16(source: Path, target: Path, keep_fp32: tuple[str, ...] | None = FP32_OPS) -> Path:
    """Write ``source`` as an fp16 graph with fp32 inputs/outputs and the ops ``keep_fp32`` names kept in fp32
    (None: the converter's own list, for a fused graph, whose normalisations and softmax are inside ONNX Runtime's
    fused operators)."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    # by path: the converter's shape inference then runs on the file, which works past 2 GB
    model = convert_float_to_float16(str(source), keep_io_types=True,
                                     op_block_list=None if keep_fp32 is None else list(keep_fp32),
                                     max_finite_val=FP16_MAX)
    # half the bytes: a large model's fp16 graph may fit one file again (:mod:`onnx_files` decides)
    return onnx_files.save(model, target)


def lowest_constant(path: Path) -> float:
    """The most negative floating-point constant in the graph (initializers and Constant nodes)."""
    graph = onnx.load(str(path)).graph
    tensors = [*graph.initializer, *(a.t for n in graph.node if n.op_type == "Constant" for a in n.attribute
                                     if a.type == onnx.AttributeProto.TENSOR)]
    values = [numpy_helper.to_array(t) for t in tensors if t.data_type in (TensorProto.FLOAT, TensorProto.FLOAT16)]
    return float(min((v.min() for v in values if v.size), default=0.0))


def op_input_types(path: Path, op_types: tuple[str, ...]) -> dict[str, set[int]]:
    """For each op type present, the element types of its nodes' floating inputs (shape inference)."""
    model = onnx.shape_inference.infer_shapes(onnx.load(str(path), load_external_data=False))
    graph = model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in (*graph.value_info, *graph.input, *graph.output)}
    types.update({t.name: t.data_type for t in graph.initializer})
    found: dict[str, set[int]] = {}
    for node in graph.node:
        if node.op_type in op_types:
            floating = {types.get(i) for i in node.input if i} & {TensorProto.FLOAT, TensorProto.FLOAT16}
            found.setdefault(node.op_type, set()).update(floating)
    return found


def fp16_share(path: Path) -> float:
    """The share of weight elements stored as fp16 (how much of the graph was converted)."""
    sizes = {TensorProto.FLOAT: 0, TensorProto.FLOAT16: 0}
    for init in onnx.load(str(path), load_external_data=False).graph.initializer:  # types and shapes only
        if init.data_type in sizes:
            sizes[init.data_type] += int(np.prod(init.dims))
    total = sum(sizes.values())
    return sizes[TensorProto.FLOAT16] / total if total else 0.0
