"""Trailing padding cut off inside the graph, so one fixed input width costs nothing.

Triton's dynamic batcher merges only requests of equal shape.  The tokenizer
therefore pads every text to one fixed width (``triton.config.PAD_WIDTH``),
and every request reaching the encoder can join the same execution.  The
padding must then not be computed: this step puts a preamble in front of the
exported graph that finds the last real token of the whole batch (the last
non-zero ``attention_mask`` position, so a mask with holes is never cut short)
and slices every token input to it.  Outputs that follow the sequence come out
with that trimmed length; the post-processing slices its masks to match.

A late-interaction graph has a second mask input, ``score_mask`` (the tokens
whose vectors it answers): a query's expansion positions are scored even where
the encoder does not attend to them.  There the preamble cuts at the last
position either mask holds, so no scored position is cut off.

The preamble is plain ONNX (Shape, Range, ReduceMax, Slice), so it runs on every
backend: ONNX Runtime, OpenVINO, and the native backends of an NGC container.
Trimming trailing padding does not change any real token's output: positions
count from the start, and padded keys are masked out of attention.  The
exporter's parity check confirms this per model (its cases carry extra padding).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# the scoring mask input of a late-interaction graph: the cut keeps every position it or the attention mask holds
from nexus_sli.exporter.triton.python_models.sides import SCORE_MASK

from . import onnx_files

#: The name the trimmed sequence axis of the outputs gets in the graph.
TRIMMED_AXIS = "trimmed_sequence"
_PREFIX = "nexus_trim/"


def _constant(name: str, value: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(value, _PREFIX + name)


def _preamble(mask: str, score_mask: str | None = None) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto], str]:
    """Nodes computing ``ends`` ([1], int64): one past the batch's last non-zero position of ``mask``, or of
    ``mask`` and ``score_mask`` together where the graph has both."""
    p = _PREFIX
    constants = [
        _constant("one", np.array(1, dtype=np.int64)),
        _constant("axis1", np.array([1], dtype=np.int64)),
        _constant("zero_1d", np.array([0], dtype=np.int64)),
    ]
    nodes = []
    if score_mask is not None:
        nodes.append(helper.make_node("Max", [mask, score_mask], [p + "either_mask"]))
        mask = p + "either_mask"
    nodes += [
        helper.make_node("Shape", [mask], [p + "shape"], start=1, end=2),           # [L]
        helper.make_node("Squeeze", [p + "shape", p + "zero_1d"], [p + "length"]),  # L
        helper.make_node("Add", [p + "length", p + "one"], [p + "limit"]),
        helper.make_node("Range", [p + "one", p + "limit", p + "one"], [p + "positions"]),  # 1..L
        helper.make_node("Cast", [mask], [p + "real"], to=TensorProto.BOOL),
        helper.make_node("Cast", [p + "real"], [p + "real_i64"], to=TensorProto.INT64),
        helper.make_node("Mul", [p + "real_i64", p + "positions"], [p + "real_positions"]),
        helper.make_node("ReduceMax", [p + "real_positions"], [p + "last"], keepdims=0),
        # At least one position: an all-padding batch still has a sequence axis.
        helper.make_node("Max", [p + "last", p + "one"], [p + "last_or_one"]),
        helper.make_node("Unsqueeze", [p + "last_or_one", p + "zero_1d"], [p + "ends"]),
    ]
    return nodes, constants, p + "ends"


def _rename_uses(graph: onnx.GraphProto, old: str, new: str) -> None:
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = new
    for output in graph.output:
        if output.name == old:  # a graph that passes an input straight through
            output.name = new


def add_padding_trim(source: Path, target: Path, per_token_outputs: list[str]) -> Path:
    """Write ``source`` with the trimming preamble as ``target``.

    ``per_token_outputs``: the outputs whose second axis is the sequence (their
    axis is renamed :data:`TRIMMED_AXIS`, as they now come out trimmed).
    """
    # No onnx.checker here: fused graphs carry ONNX Runtime's contrib ops, unknown to it.
    # The exporter's validation runs every trimmed graph on its runtime instead.  The weights
    # are never loaded: a graph past 2 GB keeps naming its data file (:func:`onnx_files.rewrite`).
    return onnx_files.rewrite(source, target, lambda model: _trim(model.graph, per_token_outputs))


def _trim(graph: onnx.GraphProto, per_token_outputs: list[str]) -> None:
    """The preamble in front of ``graph``, every token input sliced by it."""
    inputs = [i.name for i in graph.input if i.name not in {init.name for init in graph.initializer}]
    if "attention_mask" not in inputs:
        raise ValueError(f"cannot trim padding: the graph has no attention_mask input (inputs: {inputs})")
    nodes, constants, ends = _preamble("attention_mask", SCORE_MASK if SCORE_MASK in inputs else None)
    for name in inputs:
        trimmed = _PREFIX + name
        _rename_uses(graph, name, trimmed)
        nodes.append(helper.make_node("Slice", [name, _PREFIX + "zero_1d", ends, _PREFIX + "axis1"], [trimmed]))
    # The preamble reads the original inputs, so it goes first; the renamed uses follow.
    rest = list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes + rest)
    graph.initializer.extend(constants)
    for output in graph.output:
        if output.name in per_token_outputs:
            output.type.tensor_type.shape.dim[1].dim_param = TRIMMED_AXIS


def trimmed_length(attention_mask: np.ndarray, score_mask: np.ndarray | None = None) -> int:
    """The sequence length the preamble cuts a batch to (numpy, for checks and tests); ``score_mask``: a
    late-interaction graph's second mask input."""
    held = np.asarray(attention_mask).astype(bool)
    if score_mask is not None:
        held = held | np.asarray(score_mask).astype(bool)
    real = np.flatnonzero(held.any(axis=0))
    return int(real[-1]) + 1 if real.size else 1
