"""fp16 graphs for NVIDIA GPUs, made with ONNX Runtime's float16 converter.

Weights and most arithmetic become fp16; the graph's inputs and outputs stay
as they were (``keep_io_types``), so the tokenizer and post-processing models
see the same tensors as on the CPU.  Normalisation and softmax stay in fp32
(:data:`FP32_OPS`): their sums of squares and of exponentials overflow or lose
their precision in fp16.  So do rotary position tables (:func:`rotary_nodes`),
as transformers computes them under fp16 too.  Constants are clamped into fp16's
finite range, so the attention mask's additive value (fp32's lowest number in
the PyTorch graph) becomes -65504, not -inf.
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
#: Ops whose output is their input's shape, not its values: the walk back from a rotary table stops there
SHAPE_OPS = ("Shape", "Size")


def convert_fp16(source: Path, target: Path, keep_fp32: tuple[str, ...] | None = FP32_OPS) -> Path:
    """Write ``source`` as an fp16 graph with fp32 inputs/outputs and the ops ``keep_fp32`` names kept in fp32
    (None: the converter's own list, for a fused graph, whose normalisations and softmax are inside ONNX Runtime's
    fused operators)."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    rotary = rotary_nodes(source)
    # by path: the converter's shape inference then runs on the file, which works past 2 GB
    model = convert_float_to_float16(str(source), keep_io_types=True,
                                     op_block_list=None if keep_fp32 is None else list(keep_fp32),
                                     node_block_list=rotary, max_finite_val=FP16_MAX)
    _fp32_between(model.graph, set(rotary))
    # half the bytes: a large model's fp16 graph may fit one file again (:mod:`onnx_files` decides)
    return onnx_files.save(model, target)


def rotary_nodes(path: Path) -> list[str]:
    """The nodes that make a graph's rotary position tables: each ``Cos`` and ``Sin`` and the nodes it depends
    on, back to the positions (a tensor's shape, a range).  A position's angle (position x frequency) needs
    more than fp16's 11 significant bits once positions reach the hundreds: transformers' rotary embeddings
    compute it in fp32 under fp16 weights too, and cast only the cos and sin."""
    graph = onnx.load(str(path), load_external_data=False).graph
    producer = {output: node for node in graph.node for output in node.output}
    weights = {initializer.name for initializer in graph.initializer}
    found: list[str] = []
    for trig in (node for node in graph.node if node.op_type in ("Cos", "Sin")):
        table = _ancestors(trig, producer)
        # a table of positions reads no weight (a Cos or Sin of the hidden states, an activation, is left as it
        # is); a node without a name cannot be kept by name
        if all(table) and not {name for node in table.values() for name in node.input} & weights:
            found += [name for name in table if name not in found]
    return found


def _ancestors(node: onnx.NodeProto, producer: dict) -> dict[str, onnx.NodeProto]:
    """``node`` and the nodes it depends on, back to shapes (:data:`SHAPE_OPS`: blocking one would cast a whole
    fp16 tensor to fp32 to read its shape) and the graph's inputs, by name."""
    found: dict[str, onnx.NodeProto] = {}
    waiting = [node.output[0]]
    while waiting:
        node = producer.get(waiting.pop())
        # an unnamed node is "" here: the table it is part of is not kept (``all(table)``), so one is enough
        if node is None or node.op_type in SHAPE_OPS or node.name in found:
            continue
        found[node.name] = node
        waiting.extend(name for name in node.input if name)
    return found


def _fp32_between(graph: onnx.GraphProto, kept: set[str]) -> None:
    """Between two nodes of ``kept``, the fp32 tensor itself: the converter casts every blocked node's inputs
    from fp16 and its outputs to fp16, so a chain of them (the rotary tables' angles) still went through fp16
    at each step.  The casts so bypassed are removed where nothing else reads them."""
    producer = {output: node for node in graph.node for output in node.output}

    def cast_to(node, element_type: int) -> bool:
        return node is not None and node.op_type == "Cast" and node.attribute[0].i == element_type

    bypassed = []
    for node in graph.node:
        if node.name not in kept:
            continue
        for index, name in enumerate(node.input):
            widened = producer.get(name)
            narrowed = producer.get(widened.input[0]) if cast_to(widened, TensorProto.FLOAT) else None
            if cast_to(narrowed, TensorProto.FLOAT16) and getattr(producer.get(narrowed.input[0]), "name", None) in kept:
                node.input[index] = narrowed.input[0]
                bypassed += [widened, narrowed]
    for cast in bypassed:  # the widening first: then its narrowing may be unread too
        if cast in graph.node and not set(cast.output) & _read(graph):
            graph.node.remove(cast)


def _read(graph: onnx.GraphProto) -> set[str]:
    """Every tensor name the graph reads: its nodes' inputs, those of the subgraphs in their attributes (an
    ``If``'s branches read the outer graph's tensors by name), and its outputs."""
    names = {output.name for output in graph.output}
    for node in graph.node:
        names.update(node.input)
        for attribute in node.attribute:
            for subgraph in (*([attribute.g] if attribute.HasField("g") else []), *attribute.graphs):
                names |= _read(subgraph)
    return names


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
