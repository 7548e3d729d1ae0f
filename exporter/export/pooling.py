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

The token states stay beside the embedding as a second output,
``TOKEN_EMBEDDINGS`` (fp32, before pooling): a second ensemble serves them,
and the served encoder computes only the outputs a request asks for.

A late-interaction (multi-vector) graph pools nothing: it ends in the model's
Dense modules on every token state and the L2 normalisation of each, times the
scoring mask, a graph input of its own (``score_mask``, from the tokenizer step,
``python_models/sides.py``), into ``[batch, sequence, dim]``: exact zeros where a
token is not scored.  The scoring mask may hold positions the attention mask
does not (query expansion the encoder does not attend to), so the padding trim
in front cuts at the last position of either (:mod:`padding_trim`).

A sparse-embedding graph ends instead in sentence-transformers' SpladePooling
(``python_models.encoding.splade``): masked-LM logits times the mask,
``log(1 + relu(x))`` (twice for ``log1p_relu``), max or sum over the sequence,
into ``[batch, vocab]``.

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
from nexus_sli.exporter.triton.python_models.encoding import (MASKED_OUT, MIN_COUNT, MIN_NORM, POOLING_MODES,
                                                              SPLADE_ACTIVATIONS, SPLADE_STRATEGIES)

from . import onnx_files
from .dense import ACTIVATIONS, SENTENCE, TOKENS, Dense
from .export_report import LayerNormRecord

#: Every node and constant this step adds is named with this prefix.
PREFIX = "nexus_pool/"
#: The mask input the pooling reads (trimmed with the states when a padding trim is in front).
MASK = "attention_mask"


def pooling_constants() -> list[onnx.TensorProto]:
    """The constants the appended nodes read, named with :data:`PREFIX` (a graph keeps those it uses)."""
    values = {"axis1": np.array([1], np.int64), "axis2": np.array([2], np.int64), "zero": np.array(0, np.int64),
              "min_count": np.array(MIN_COUNT, np.float32), "min_norm": np.array(MIN_NORM, np.float32),
              "masked_out": np.array(MASKED_OUT, np.float32), "zero_f": np.array(0.0, np.float32),
              "one_f": np.array(1.0, np.float32), "tiny": np.array(np.finfo(np.float32).tiny, np.float32)}
    return [numpy_helper.from_array(value, PREFIX + name) for name, value in values.items()]


def prefixed_node(op: str, inputs: list[str], output: str, **attributes) -> onnx.NodeProto:
    """An ONNX node named, as its one output is, with :data:`PREFIX`."""
    return helper.make_node(op, inputs, [output], name=PREFIX + output.removeprefix(PREFIX), **attributes)


def pool_states(states: str, mode: str) -> tuple[list[onnx.NodeProto], str]:
    """Nodes pooling ``states`` ([batch, sequence, hidden]) with the mask into [batch, hidden]."""
    p = PREFIX
    if mode == "cls":
        return [prefixed_node("Gather", [states, p + "zero"], p + "pooled", axis=1)], p + "pooled"
    nodes = [
        prefixed_node("Cast", [states], p + "states", to=TensorProto.FLOAT),  # fp32 even after an fp16 encoder
        prefixed_node("Cast", [MASK], p + "mask", to=TensorProto.FLOAT),
        prefixed_node("Unsqueeze", [p + "mask", p + "axis2"], p + "weights"),  # [batch, sequence, 1]
    ]
    if mode == "mean":
        nodes += [
            prefixed_node("Mul", [p + "states", p + "weights"], p + "weighted"),
            prefixed_node("ReduceSum", [p + "weighted", p + "axis1"], p + "sum", keepdims=0),
            prefixed_node("ReduceSum", [p + "weights", p + "axis1"], p + "count", keepdims=0),  # [batch, 1]
            prefixed_node("Max", [p + "count", p + "min_count"], p + "count_or_min"),
            prefixed_node("Div", [p + "sum", p + "count_or_min"], p + "pooled"),
        ]
    else:  # max
        nodes += [
            prefixed_node("Greater", [p + "weights", p + "zero_f"], p + "real"),
            prefixed_node("Where", [p + "real", p + "states", p + "masked_out"], p + "candidates"),
            prefixed_node("ReduceMax", [p + "candidates"], p + "pooled", axes=[1], keepdims=0),
        ]
    return nodes, p + "pooled"


def normalize_nodes(vectors: str, name: str = PREFIX + "normalized") -> tuple[list[onnx.NodeProto], str]:
    """``vectors / max(||vectors||_2, min_norm)`` over the last axis, as ``name`` (its intermediate values named
    after it, so that one graph may normalise twice)."""
    return [
        prefixed_node("ReduceL2", [vectors], name + "_norm", axes=[-1], keepdims=1),
        prefixed_node("Max", [name + "_norm", PREFIX + "min_norm"], name + "_norm_or_min"),
        prefixed_node("Div", [vectors, name + "_norm_or_min"], name),
    ], name


def _tokens(states: str, tokens: str) -> onnx.NodeProto:
    """The token states as the graph output ``tokens``, fp32 (an fp16 encoder's too), before any pooling."""
    return helper.make_node("Cast", [states], [tokens], name=PREFIX + "tokens", to=TensorProto.FLOAT)


def _log1p(x: str, name: str) -> tuple[list[onnx.NodeProto], str]:
    """``log(1 + x)`` for ``x >= 0`` without losing the small values (ONNX has no Log1p): ``x * log(u) / (u - 1)``
    with ``u = 1 + x``, and ``x`` itself where ``u`` rounds to 1 (Goldberg's formula, accurate to a few ulps)."""
    p = PREFIX + name
    return [
        prefixed_node("Add", [x, PREFIX + "one_f"], p + "u"),
        prefixed_node("Sub", [p + "u", PREFIX + "one_f"], p + "u_minus_1"),
        prefixed_node("Equal", [p + "u_minus_1", PREFIX + "zero_f"], p + "rounds_to_1"),
        prefixed_node("Max", [p + "u_minus_1", PREFIX + "tiny"], p + "divisor"),  # no 0/0 in the branch not taken
        prefixed_node("Log", [p + "u"], p + "log_u"),
        prefixed_node("Div", [x, p + "divisor"], p + "scale"),
        prefixed_node("Mul", [p + "log_u", p + "scale"], p + "formula"),
        prefixed_node("Where", [p + "rounds_to_1", x, p + "formula"], p + "log1p"),
    ], p + "log1p"


def _activate(x: str, activation: str, step: str) -> tuple[list[onnx.NodeProto], str]:
    """SpladePooling's activation: ``log1p(relu(x))``, and a second ``log1p`` for ``log1p_relu``."""
    nodes = [prefixed_node("Relu", [x], PREFIX + step + "relu")]
    more, value = _log1p(PREFIX + step + "relu", step + "1/")
    nodes += more
    if activation == "log1p_relu":
        more, value = _log1p(value, step + "2/")
        nodes += more
    return nodes, value


def _splade(logits: str, strategy: str, activation: str) -> tuple[list[onnx.NodeProto], str]:
    """Nodes pooling masked-LM ``logits`` ([batch, sequence, vocab]) with the mask into [batch, vocab], as
    sentence-transformers' SpladePooling: logits times the mask, activation, max or sum over the sequence.
    For ``max`` the activation runs after the max (it is monotonic, so the result is the same) on
    [batch, vocab] instead of [batch, sequence, vocab]."""
    p = PREFIX
    nodes = [
        prefixed_node("Cast", [logits], p + "logits", to=TensorProto.FLOAT),
        prefixed_node("Cast", [MASK], p + "mask", to=TensorProto.FLOAT),
        prefixed_node("Unsqueeze", [p + "mask", p + "axis2"], p + "weights"),  # [batch, sequence, 1]
        prefixed_node("Mul", [p + "logits", p + "weights"], p + "masked"),    # padding -> 0, as SpladePooling
    ]
    if strategy == "max":
        nodes.append(prefixed_node("ReduceMax", [p + "masked"], p + "max", axes=[1], keepdims=0))
        more, pooled = _activate(p + "max", activation, "")
        return nodes + more, pooled
    more, weights = _activate(p + "masked", activation, "")
    return nodes + more + [prefixed_node("ReduceSum", [weights, p + "axis1"], p + "pooled", keepdims=0)], p + "pooled"


def _layer_norm(vectors: str, norm: LayerNormRecord) -> tuple[list[onnx.NodeProto], str, list[onnx.TensorProto]]:
    """sentence-transformers' LayerNorm module on the pooled vectors: (nodes, output, its weights)."""
    p = PREFIX
    weights = [numpy_helper.from_array(np.asarray(values, np.float32), p + f"layer_norm_{key}")
               for key, values in (("weight", norm.weight), ("bias", norm.bias))]
    node = helper.make_node("LayerNormalization", [vectors, p + "layer_norm_weight", p + "layer_norm_bias"],
                            [p + "layer_normed"], name=p + "layer_norm", axis=-1, epsilon=float(norm.eps))
    return [node], p + "layer_normed", weights


def _dense(x: str, module: Dense, name: str) -> tuple[list[onnx.NodeProto], str, list[onnx.TensorProto]]:
    """sentence-transformers' Dense module on ``x`` (``[..., in_features]``): (nodes, output, its weights),
    as :meth:`Dense.__call__` computes it."""
    p = PREFIX + name + "/"
    weights = [numpy_helper.from_array(np.asarray(module.weight, np.float32).T.copy(), p + "weight")]
    nodes = [prefixed_node("MatMul", [x, p + "weight"], p + "linear")]
    out = p + "linear"
    if module.bias is not None:
        weights.append(numpy_helper.from_array(np.asarray(module.bias, np.float32), p + "bias"))
        nodes.append(prefixed_node("Add", [out, p + "bias"], p + "biased"))
        out = p + "biased"
    op = ACTIVATIONS[module.activation][0]
    if op is not None:
        nodes.append(prefixed_node(op, [out], p + "activated"))
        out = p + "activated"
    if module.use_residual:
        residual = x
        if module.residual is not None:
            weights.append(numpy_helper.from_array(np.asarray(module.residual, np.float32).T.copy(), p + "residual"))
            nodes.append(prefixed_node("MatMul", [x, p + "residual"], p + "projected"))
            residual = p + "projected"
        nodes.append(prefixed_node("Add", [out, residual], p + "with_residual"))
        out = p + "with_residual"
    return nodes, out, weights


def add_pooling(source: Path, target: Path, states: str, output: str, mode: str, normalize: bool,
                size: int, tokens: str | None = None, layer_norm: LayerNormRecord | None = None,
                dense: tuple[Dense, ...] = ()) -> Path:
    """Write ``source`` as ``target`` with its token-state output ``states`` pooled (``mode``, one of
    :data:`POOLING_MODES`), projected by sentence-transformers' ``dense`` modules (those on the token
    states before the pooling, the others after it) and L2-normalised (when ``normalize``) into the fp32
    output ``output`` of shape ``[batch, size]``, which replaces ``states`` as the graph's first output;
    with ``tokens``, the token states stay beside it as that fp32 output ``[batch, sequence, hidden]``
    (the encoder's, before any Dense module)."""
    if mode not in POOLING_MODES:
        raise ExportError(f"cannot pool {mode!r} in the graph; known modes: {', '.join(POOLING_MODES)}")

    initializers: list[onnx.TensorProto] = []

    def project(vectors: str, feature: str, nodes: list[onnx.NodeProto]) -> str:
        for index, module in enumerate(dense):
            if module.input == feature:
                more, vectors, weights = _dense(vectors, module, f"dense_{index}")
                nodes += more
                initializers.extend(weights)
        return vectors

    def nodes() -> tuple[list[onnx.NodeProto], str]:
        added: list[onnx.NodeProto] = []
        if any(module.input == TOKENS for module in dense):  # in fp32, as the pooling computes
            added.append(prefixed_node("Cast", [states], PREFIX + "token_states", to=TensorProto.FLOAT))
            pooled, vectors = pool_states(project(PREFIX + "token_states", TOKENS, added), mode)
        else:
            pooled, vectors = pool_states(states, mode)
        added += pooled
        vectors = project(vectors, SENTENCE, added)
        if layer_norm is not None:  # sentence-transformers' LayerNorm module, before the normalisation
            more, vectors, weights = _layer_norm(vectors, layer_norm)
            added += more
            initializers.extend(weights)
        if normalize:
            more, vectors = normalize_nodes(vectors)
            added += more
        return added, vectors

    def rewrite(model: onnx.ModelProto) -> None:
        _append(model.graph, states, nodes, output, size, tokens)
        model.graph.initializer.extend(initializers)

    # No onnx.checker here: fused graphs carry ONNX Runtime's contrib ops, unknown to it; the
    # exporter's validation runs every pooled graph on its runtime instead.  The weights are never
    # loaded: a graph past 2 GB keeps naming its data file (:func:`onnx_files.rewrite`).
    return onnx_files.rewrite(source, target, rewrite)


def add_splade_pooling(source: Path, target: Path, logits: str, output: str, strategy: str, activation: str,
                       vocab_size: int) -> Path:
    """Write ``source`` as ``target`` with its masked-LM output ``logits`` SPLADE-pooled (``strategy`` in
    :data:`SPLADE_STRATEGIES`, ``activation`` in :data:`SPLADE_ACTIVATIONS`) into the fp32 output ``output``
    of shape ``[batch, vocab_size]``, which replaces ``logits`` as the graph's output."""
    if strategy not in SPLADE_STRATEGIES or activation not in SPLADE_ACTIVATIONS:
        raise ExportError(f"cannot pool SPLADE {strategy!r} with activation {activation!r} in the graph; known: "
                          f"{', '.join(SPLADE_STRATEGIES)} with {', '.join(SPLADE_ACTIVATIONS)}")
    return onnx_files.rewrite(source, target, lambda model: _append(
        model.graph, logits, lambda: _splade(logits, strategy, activation), output, vocab_size))


def _append(graph: onnx.GraphProto, states: str, make_nodes, output: str, size: int,
            tokens: str | None = None) -> None:
    """The nodes ``make_nodes()`` gives (and the result's name) after ``graph``'s output ``states``;
    ``output`` (``[batch, size]``) replaces it, followed by ``tokens`` where asked."""
    outputs = [o.name for o in graph.output]
    inputs = [i.name for i in graph.input]
    if states not in outputs or MASK not in inputs:
        raise ExportError(f"cannot pool in the graph: it needs the output {states!r} and the input {MASK!r} "
                          f"(outputs {outputs}, inputs {inputs})")
    nodes, vectors = make_nodes()
    nodes.append(helper.make_node("Identity", [vectors], [output], name=PREFIX + "output"))
    if tokens is not None:
        nodes.append(_tokens(states, tokens))
    graph.node.extend(nodes)
    used = {name for node in nodes for name in node.input}
    graph.initializer.extend(c for c in pooling_constants() if c.name in used)
    states_type = next(o for o in graph.output if o.name == states)
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info(output, TensorProto.FLOAT, ["batch", size]))
    if tokens is not None:
        shape = [d.dim_param or d.dim_value for d in states_type.type.tensor_type.shape.dim]
        graph.output.append(helper.make_tensor_value_info(tokens, TensorProto.FLOAT, shape))


def _multi_vector(states: str, score_mask: str, dense: tuple[Dense, ...], normalize: bool,
                  initializers: list[onnx.TensorProto]) -> tuple[list[onnx.NodeProto], str]:
    """Nodes turning token ``states`` ([batch, sequence, hidden]) into one vector per scored token:
    the Dense modules, the normalisation, times ``score_mask`` ([batch, sequence]); their weights go into
    ``initializers``."""
    p = PREFIX
    nodes = [prefixed_node("Cast", [states], p + "token_states", to=TensorProto.FLOAT)]  # fp32 after an fp16 encoder
    vectors = p + "token_states"
    for index, module in enumerate(dense):
        more, vectors, weights = _dense(vectors, module, f"dense_{index}")
        nodes += more
        initializers.extend(weights)
    if normalize:
        more, vectors = normalize_nodes(vectors)
        nodes += more
    return nodes + [
        prefixed_node("Cast", [score_mask], p + "score_weights", to=TensorProto.FLOAT),
        prefixed_node("Unsqueeze", [p + "score_weights", p + "axis2"], p + "scored"),  # [batch, sequence, 1]
        prefixed_node("Mul", [vectors, p + "scored"], p + "vectors"),
    ], p + "vectors"


def add_multi_vector(source: Path, target: Path, states: str, output: str, score_mask: str,
                     dense: tuple[Dense, ...], normalize: bool, size: int) -> Path:
    """Write ``source`` as ``target`` with its token-state output ``states`` turned into the fp32 output
    ``output`` ``[batch, sequence, size]``: sentence-transformers' ``dense`` modules on every token, each
    vector L2-normalised (when ``normalize``), times the new int64 graph input ``score_mask``
    ``[batch, sequence]`` (zeros where a token is not scored)."""
    if any(module.input != TOKENS for module in dense):
        raise ExportError("a late-interaction model's Dense modules read the token states; one reads "
                          "the pooled sentence vector, which this model does not make")

    def rewrite(model: onnx.ModelProto) -> None:
        graph = model.graph
        outputs, inputs = [o.name for o in graph.output], [i.name for i in graph.input]
        if states not in outputs or MASK not in inputs or score_mask in inputs:
            raise ExportError(f"cannot append the multi-vector head: it needs the output {states!r}, the input "
                              f"{MASK!r} and no input {score_mask!r} yet (outputs {outputs}, inputs {inputs})")
        initializers: list[onnx.TensorProto] = []
        nodes, vectors = _multi_vector(states, score_mask, dense, normalize, initializers)
        nodes.append(helper.make_node("Identity", [vectors], [output], name=PREFIX + "output"))
        graph.node.extend(nodes)
        used = {name for node in nodes for name in node.input}
        graph.initializer.extend([*initializers, *(c for c in pooling_constants() if c.name in used)])
        mask_type = next(i for i in graph.input if i.name == MASK)
        sequence = mask_type.type.tensor_type.shape.dim[1].dim_param or "sequence"
        graph.input.append(helper.make_tensor_value_info(score_mask, TensorProto.INT64, ["batch", sequence]))
        del graph.output[:]
        graph.output.append(helper.make_tensor_value_info(output, TensorProto.FLOAT, ["batch", sequence, size]))

    return onnx_files.rewrite(source, target, rewrite)


@dataclass(frozen=True)
class Pooling:
    """How one embedding export pools in its graphs: what each target appends to its candidates."""

    mode: str
    normalize: bool
    #: the token-state output pooled, and the embedding output that replaces it
    states: str
    output: str
    #: the embedding's size (the hidden size, or the last Dense module's ``out_features``)
    size: int
    #: the output that keeps the token states beside the embedding (None: not kept)
    tokens: str | None = None
    #: sentence-transformers' LayerNorm module between the pooling and the normalisation (None: none)
    layer_norm: LayerNormRecord | None = None
    #: sentence-transformers' Dense modules in order (on the token states, then on the pooled vector)
    dense: tuple[Dense, ...] = ()

    def append(self, source: Path, target: Path) -> Path:
        """``source`` with the pooling at its end, as ``target``."""
        return add_pooling(source, target, self.states, self.output, self.mode, self.normalize, self.size,
                           self.tokens, self.layer_norm, self.dense)

    @property
    def outputs(self) -> list[str]:
        """The pooled graph's outputs, in order."""
        return [self.output, *self.per_token]

    @property
    def per_token(self) -> list[str]:
        """The pooled graph's outputs that follow the sequence (cut with the padding)."""
        return [self.tokens] if self.tokens else []

    @property
    def inputs(self) -> tuple[str, ...]:
        """Graph inputs the pooling adds: none, it reads the encoder's own."""
        return ()

    def complete(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``feeds`` with the inputs the pooling adds: none."""
        return feeds


@dataclass(frozen=True)
class SpladePooling:
    """How one sparse-embedding export pools in its graphs (sentence-transformers' SpladePooling)."""

    strategy: str
    activation: str
    #: the masked-LM logits pooled, and the sparse embedding output that replaces them
    states: str
    output: str
    vocab_size: int

    def append(self, source: Path, target: Path) -> Path:
        return add_splade_pooling(source, target, self.states, self.output, self.strategy, self.activation,
                                  self.vocab_size)

    @property
    def outputs(self) -> list[str]:
        return [self.output]

    @property
    def per_token(self) -> list[str]:
        return []

    @property
    def inputs(self) -> tuple[str, ...]:
        return ()

    def complete(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return feeds


def pooling_nodes(path: Path) -> list[str]:
    """The names of the nodes :func:`add_pooling` added to the graph at ``path`` (empty for none)."""
    graph = onnx.load(str(path), load_external_data=False).graph
    return [node.name for node in graph.node if node.name.startswith(PREFIX)]


@dataclass(frozen=True)
class MultiVectorHead:
    """How one late-interaction export ends its graphs: one vector per scored token."""

    #: the token-state output read, and the vectors' output that replaces it
    states: str
    output: str
    #: the scoring mask, a graph input this head adds
    score_mask: str
    dense: tuple[Dense, ...]
    normalize: bool
    #: the vectors' size (the hidden size, or the last Dense module's ``out_features``)
    size: int

    def append(self, source: Path, target: Path) -> Path:
        return add_multi_vector(source, target, self.states, self.output, self.score_mask, self.dense,
                                self.normalize, self.size)

    @property
    def inputs(self) -> tuple[str, ...]:
        """The graph input it adds, after the encoder's own."""
        return (self.score_mask,)

    def complete(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``feeds`` with a scoring mask that scores every attended token (a document without a skiplist):
        for timing and calibration, where which tokens are scored changes nothing the encoder computes."""
        return {**feeds, self.score_mask: feeds["attention_mask"].copy()}

    @property
    def outputs(self) -> list[str]:
        return [self.output]

    @property
    def per_token(self) -> list[str]:
        return [self.output]
