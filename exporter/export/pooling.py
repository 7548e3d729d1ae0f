"""Pooling and L2 normalisation as ONNX ops at the end of an embedding encoder graph.

The served embedding ensemble is then tokenizer -> encoder: the encoder answers
``[batch, hidden]`` sentence embeddings itself, so no python post-processing
step runs per request and Triton moves ``[batch, hidden]`` instead of
``[batch, length, hidden]`` between steps.

The ops reproduce the python pooling (``python_models.encoding.pool`` and
``l2_normalize``, which older repositories' post-processing model runs and which
validation applies to PyTorch's token states) mode for mode:

- ``mean``: ``sum(states * mask) / max(sum(mask), 1e-9)`` over the sequence;
- ``cls``: the first position's state;
- ``max``: the largest state over positions whose mask is > 0 (``-1e9`` elsewhere);
- normalisation: ``x / max(||x||_2, 1e-12)``.

They read the graph's ``attention_mask`` input by name, so in front of a padding
trim (:mod:`padding_trim`) they see the trimmed mask, exactly as wide as the
token states.  They compute in fp32: each target appends them to its candidate
graphs after lowering their precision (the fp16 graph's token states come out
as fp32, ``keep_io_types``; ONNX Runtime's int8 leaves them alone), and where
a runtime lowers precision itself the nodes named :data:`PREFIX` are excluded
(NNCF's ignored scope, TensorRT's precision constraints).  ONNX Runtime's fp16
converter is not asked to keep them in fp32: it rounds every value between two
kept nodes through fp16.  OpenVINO's bf16 hint is a runtime precision for the
whole graph, pooling included (docs/repository.md has the measured fidelity).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from nexus_sli.exporter.errors import ExportError
# the modes and guards of the python pooling: the graph offers exactly those modes, with the same guards
from nexus_sli.exporter.triton.python_models.encoding import MASKED_OUT, MIN_COUNT, MIN_NORM, POOLING_MODES

from . import onnx_files

#: Every node and constant this step adds is named with this prefix.
PREFIX = "nexus_pool/"
#: The mask input the pooling reads (trimmed with the states when a padding trim is in front).
MASK = "attention_mask"


def _constants() -> list[onnx.TensorProto]:
    values = {"axis1": np.array([1], np.int64), "axis2": np.array([2], np.int64), "zero": np.array(0, np.int64),
              "min_count": np.array(MIN_COUNT, np.float32), "min_norm": np.array(MIN_NORM, np.float32),
              "masked_out": np.array(MASKED_OUT, np.float32), "zero_f": np.array(0.0, np.float32)}
    return [numpy_helper.from_array(value, PREFIX + name) for name, value in values.items()]


def _node(op: str, inputs: list[str], output: str, **attributes) -> onnx.NodeProto:
    return helper.make_node(op, inputs, [output], name=PREFIX + output.removeprefix(PREFIX), **attributes)


def _pool(states: str, mode: str) -> tuple[list[onnx.NodeProto], str]:
    """Nodes pooling ``states`` ([batch, sequence, hidden]) with the mask into [batch, hidden]."""
    p = PREFIX
    if mode == "cls":
        return [_node("Gather", [states, p + "zero"], p + "pooled", axis=1)], p + "pooled"
    nodes = [
        _node("Cast", [states], p + "states", to=TensorProto.FLOAT),  # fp32 even after an fp16 encoder
        _node("Cast", [MASK], p + "mask", to=TensorProto.FLOAT),
        _node("Unsqueeze", [p + "mask", p + "axis2"], p + "weights"),  # [batch, sequence, 1]
    ]
    if mode == "mean":
        nodes += [
            _node("Mul", [p + "states", p + "weights"], p + "weighted"),
            _node("ReduceSum", [p + "weighted", p + "axis1"], p + "sum", keepdims=0),
            _node("ReduceSum", [p + "weights", p + "axis1"], p + "count", keepdims=0),  # [batch, 1]
            _node("Max", [p + "count", p + "min_count"], p + "count_or_min"),
            _node("Div", [p + "sum", p + "count_or_min"], p + "pooled"),
        ]
    else:  # max
        nodes += [
            _node("Greater", [p + "weights", p + "zero_f"], p + "real"),
            _node("Where", [p + "real", p + "states", p + "masked_out"], p + "candidates"),
            _node("ReduceMax", [p + "candidates"], p + "pooled", axes=[1], keepdims=0),
        ]
    return nodes, p + "pooled"


def _normalize(vectors: str) -> tuple[list[onnx.NodeProto], str]:
    p = PREFIX
    return [
        _node("ReduceL2", [vectors], p + "norm", axes=[-1], keepdims=1),
        _node("Max", [p + "norm", p + "min_norm"], p + "norm_or_min"),
        _node("Div", [vectors, p + "norm_or_min"], p + "normalized"),
    ], p + "normalized"


def add_pooling(source: Path, target: Path, states: str, output: str, mode: str, normalize: bool,
                hidden_size: int) -> Path:
    """Write ``source`` as ``target`` with its token-state output ``states`` pooled (``mode``, one of
    :data:`POOLING_MODES`) and L2-normalised (when ``normalize``) into the fp32 output ``output``
    of shape ``[batch, hidden_size]``, which replaces ``states`` as the graph's output."""
    if mode not in POOLING_MODES:
        raise ExportError(f"cannot pool {mode!r} in the graph; known modes: {', '.join(POOLING_MODES)}")
    # No onnx.checker here: fused graphs carry ONNX Runtime's contrib ops, unknown to it; the
    # exporter's validation runs every pooled graph on its runtime instead.  The weights are never
    # loaded: a graph past 2 GB keeps naming its data file (:func:`onnx_files.rewrite`).
    return onnx_files.rewrite(source, target,
                              lambda model: _append(model.graph, states, output, mode, normalize, hidden_size))


def _append(graph: onnx.GraphProto, states: str, output: str, mode: str, normalize: bool, hidden_size: int) -> None:
    """The pooling nodes after ``graph``'s output ``states``; ``output`` replaces it."""
    outputs = [o.name for o in graph.output]
    inputs = [i.name for i in graph.input]
    if states not in outputs or MASK not in inputs:
        raise ExportError(f"cannot pool in the graph: it needs the output {states!r} and the input {MASK!r} "
                          f"(outputs {outputs}, inputs {inputs})")
    nodes, vectors = _pool(states, mode)
    if normalize:
        more, vectors = _normalize(vectors)
        nodes += more
    nodes.append(helper.make_node("Identity", [vectors], [output], name=PREFIX + "output"))
    graph.node.extend(nodes)
    used = {name for node in nodes for name in node.input}
    graph.initializer.extend(c for c in _constants() if c.name in used)
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info(output, TensorProto.FLOAT, ["batch", hidden_size]))


@dataclass(frozen=True)
class Pooling:
    """How one export pools in its graphs: what each target appends to its candidates."""

    mode: str
    normalize: bool
    #: the token-state output pooled, and the embedding output that replaces it
    states: str
    output: str
    hidden_size: int

    def append(self, source: Path, target: Path) -> Path:
        """``source`` with the pooling at its end, as ``target``."""
        return add_pooling(source, target, self.states, self.output, self.mode, self.normalize, self.hidden_size)


def pooling_nodes(path: Path) -> list[str]:
    """The names of the nodes :func:`add_pooling` added to the graph at ``path`` (empty for none)."""
    graph = onnx.load(str(path), load_external_data=False).graph
    return [node.name for node in graph.node if node.name.startswith(PREFIX)]
