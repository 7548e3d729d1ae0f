"""INT8: ONNX Runtime dynamic quantization, per-output-channel weights.

Quantizing every MatMul costs the most fidelity on short texts; keeping the
feed-forward *output* projections in fp32 (their inputs are post-GELU
activations with large outliers) recovers much of it (docs/export.md,
"Validation", has the measurements).  The exporter tries both variants and
keeps the fastest that passes fidelity.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from . import onnx_files


@dataclass(frozen=True)
class Int8Config:
    """How int8 is made, in one place (the exporter and the layer cache read it)."""

    per_channel: bool = True
    weight_type: str = "QInt8"
    reduce_range: bool = False
    # Matrix products carry the compute; embedding tables (Gather) stay fp32
    # because they cost little time and quantizing them costs fidelity.
    op_types: tuple[str, ...] = ("MatMul", "Attention")


def get_int8_config() -> Int8Config:
    return Int8Config()


#: Operators that quantize their input with a scale measured on the batch they run on.
PER_BATCH_OPS = frozenset({"DynamicQuantizeLinear", "DynamicQuantizeMatMul"})


def scales_per_batch(path: Path) -> bool:
    """Whether the ONNX graph at ``path`` quantizes activations per batch (dynamic quantization): its
    answer for a text then depends on the texts batched with it (:func:`validate.compare`'s ``per_batch``).
    Graphs of other formats (OpenVINO's IR) do not."""
    import onnx

    if Path(path).suffix != ".onnx":
        return False
    graph = onnx.load(str(path), load_external_data=False).graph
    return any(node.op_type in PER_BATCH_OPS for node in graph.node)


def ffn_output_matmuls(path: Path, intermediate_size: int, hidden_size: int) -> list[str]:
    """MatMul nodes whose weight maps the feed-forward width back to the hidden size."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph  # names and shapes: no weights needed
    shapes = {init.name: tuple(init.dims) for init in graph.initializer}
    return [
        node.name for node in graph.node
        if node.op_type == "MatMul" and any(shapes.get(i) == (intermediate_size, hidden_size) for i in node.input)
    ]


def attention_output_matmuls(path: Path, hidden_size: int) -> list[str]:
    """MatMul nodes that project attention's result back into the hidden states: a (hidden, hidden)
    weight whose input no other such MatMul reads (query, key and value read one input together;
    families that fuse them have a (hidden, 3 x hidden) weight instead)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph  # names and shapes: no weights needed
    shapes = {init.name: tuple(init.dims) for init in graph.initializer}
    square = [(node.name, [i for i in node.input if shapes.get(i) != (hidden_size, hidden_size)])
              for node in graph.node
              if node.op_type == "MatMul" and any(shapes.get(i) == (hidden_size, hidden_size) for i in node.input)]
    readers = Counter(data for _, inputs in square for data in inputs)
    return [name for name, inputs in square if len(inputs) == 1 and readers[inputs[0]] == 1]


def quantize_int8(source: Path, target: Path, exclude: list[str] | None = None,
                  config: Int8Config | None = None) -> Path:
    """ONNX Runtime's dynamic int8 of the graph at ``source`` as ``target`` (with ``<name>.data`` where the
    source has external data or is past :data:`onnx_files.EXTERNAL_DATA_THRESHOLD`)."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    config = config or get_int8_config()
    quantize_dynamic(
        str(source),
        str(onnx_files.prepare(target)),
        per_channel=config.per_channel,
        reduce_range=config.reduce_range,
        weight_type=getattr(QuantType, config.weight_type),
        op_types_to_quantize=list(config.op_types),
        nodes_to_exclude=list(exclude or []),
        # Fused graphs carry com.microsoft ops whose output types the quantizer
        # cannot infer; tell it they are fp32.
        extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
        use_external_data_format=onnx_files.external(source),
    )
    return target
