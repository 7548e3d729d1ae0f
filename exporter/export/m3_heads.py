"""BGE-M3's two heads, and its three outputs from one encoder run: numpy reference and ONNX nodes.

A BGE-M3 checkpoint is an xlm-roberta encoder with two linear heads beside its
weights, saved by FlagEmbedding as ``torch.save`` state dicts:
``sparse_linear.pt`` (``Linear(hidden, 1)``) and ``colbert_linear.pt``
(``Linear(hidden, dim)``).  From the encoder's token states ``h`` of one text
(``n`` tokens, ``<s>`` first), FlagEmbedding's ``BGEM3FlagModel`` answers:

- dense: ``h[0]`` (the CLS state), L2-normalised;
- sparse (lexical weights): ``relu(h w^T + b)`` per token; the tokens whose id
  is the cls, eos, pad or unk token's are dropped, and zero weights; per id the
  largest weight, as ``{id: weight}``; two texts score ``sum w_a w_b`` over
  their shared ids;
- ColBERT: ``h W^T + b`` for every token but the first (``</s>`` included),
  each L2-normalised; two texts score MaxSim divided by the query's vector count.

The heads are pickles, read under the one rule for every pickle file
(:mod:`pickles`): only with ``--allow-pickle``, and then as tensors only.

A folder with one head but not the other is refused (:func:`check_heads`):
under ``--task auto`` exporting its encoder as dense embeddings would drop the
other head without a word.

The graph nodes (:func:`add_m3_heads`) follow :mod:`pooling`: appended in fp32
after the encoder, named with its prefix, reading the graph's inputs by name.
Per token they answer what a served text needs to rebuild FlagEmbedding's
outputs: ``SPARSE_WEIGHTS`` ``[batch, sequence]`` (the token weights, zero
where a token is padding or one of the dropped ids; the client reduces them per
id) and ``MULTI_VECTOR`` ``[batch, sequence, dim]`` (zero off the scoring mask,
which the tokenizer step answers without each text's first token).

:class:`M3Head` is how every target appends them to its candidate graphs, and
:class:`M3Embedder` how validation applies them to PyTorch's token states.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, NamedTuple

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from nexus_sli.exporter.errors import CheckpointError, ExportError, UnsafeCheckpointError
from nexus_sli.exporter.triton.python_models.encoding import l2_normalize
from nexus_sli.exporter.triton.python_models.sides import SCORE_MASK, Side, Sides

from . import onnx_files
from .pooling import MASK, PREFIX, normalize_nodes, pool_states, pooling_constants, prefixed_node
from .score_fidelity import COSINE, LEXICAL
from .st_folder import SPECIAL_TOKENS_MAP, TOKENIZER_CONFIG, special_tokens, state_dict
from .validate import M3_POOLING

SPARSE_HEAD, COLBERT_HEAD = "sparse_linear.pt", "colbert_linear.pt"
#: BGE-M3's head files, in the order errors name them
HEADS = (SPARSE_HEAD, COLBERT_HEAD)
#: the graph's three outputs, in order (the ``bge-m3`` task's computed results)
EMBEDDING, SPARSE_WEIGHTS, MULTI_VECTOR = "EMBEDDING", "SPARSE_WEIGHTS", "MULTI_VECTOR"
#: the special tokens FlagEmbedding leaves out of the lexical weights, by the names a tokenizer's config
#: gives them, with XLM-RoBERTa's tokens where the config names none (as its tokenizer class does)
DROPPED_TOKENS = {"cls_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
#: the graph input holding the token ids (the dropped ids are found there)
IDS = "input_ids"


def missing_heads(path: Path) -> list[str]:
    """BGE-M3's head files the folder at ``path`` lacks."""
    return [name for name in HEADS if not (path / name).is_file()]


def is_bge_m3(path: Path) -> bool:
    """Whether the folder at ``path`` has BGE-M3's two heads beside its weights."""
    return not missing_heads(path)


def check_heads(path: Path, task: str) -> None:
    """Refuse a folder that carries some of BGE-M3's heads but not all, before anything is exported: under
    ``task`` ``auto`` (which would export the encoder alone as dense embeddings), naming the missing file and
    ``--task embedding`` for those who want the dense part; under ``bge-m3``, naming the missing files."""
    missing = missing_heads(path)
    lacks = " and ".join(missing)
    if task == "bge-m3" and missing:
        raise CheckpointError(f"{path} lacks {lacks}: the bge-m3 task reads BGE-M3's heads from "
                              f"{' and '.join(HEADS)} beside the weights")
    if task != "auto" or len(missing) in (0, len(HEADS)):
        return
    present = " and ".join(name for name in HEADS if name not in missing)
    raise CheckpointError(f"{path} has BGE-M3's {present} but not {lacks}: add {lacks} to export BGE-M3's three "
                          "outputs, or pass --task embedding to export the dense embeddings alone, on purpose")


@dataclass(frozen=True)
class M3Heads:
    """The two heads' weights, fp32."""

    #: ``[hidden]`` and a scalar: one weight per token
    sparse_weight: np.ndarray
    sparse_bias: float
    #: ``[dim, hidden]`` and ``[dim]``: one vector per token
    colbert_weight: np.ndarray
    colbert_bias: np.ndarray

    @property
    def colbert_dim(self) -> int:
        return int(self.colbert_weight.shape[0])


def read_m3_heads(path: Path, hidden_size: int, allow_pickle: bool) -> M3Heads:
    """The heads of the BGE-M3 folder at ``path`` for an encoder of ``hidden_size``; a head of another shape,
    or a file that is no state dict, is a :class:`CheckpointError` that names it."""
    if not allow_pickle:
        raise UnsafeCheckpointError(
            f"{path} keeps BGE-M3's heads as pickles ({SPARSE_HEAD}, {COLBERT_HEAD}); loading pickle can run "
            "arbitrary code. Pass --allow-pickle (make: ALLOW_PICKLE=1) if you trust the source (they are then "
            "read as tensors only), or --task embedding to export the dense embeddings alone.")
    sparse = state_dict(path / SPARSE_HEAD, {"weight": (1, hidden_size), "bias": (1,)}, allow_pickle)
    colbert = state_dict(path / COLBERT_HEAD, {"weight": (None, hidden_size), "bias": (None,)}, allow_pickle)
    dim = colbert["weight"].shape[0]
    if colbert["bias"].shape != (dim,):
        raise CheckpointError(f"{COLBERT_HEAD}: bias has shape {colbert['bias'].shape}, expected ({dim},) "
                              f"for a weight of shape {colbert['weight'].shape}")
    return M3Heads(sparse["weight"][0], float(sparse["bias"][0]), colbert["weight"], colbert["bias"])


def dropped_token_ids(path: Path, tokenizer) -> tuple[int, ...]:
    """The ids left out of the lexical weights: the cls, eos, pad and unk tokens as the folder's
    ``special_tokens_map.json`` (else ``tokenizer_config.json``) names them, in ``tokenizer`` (the served
    ``tokenizers.Tokenizer``)."""
    named = {**special_tokens(path / TOKENIZER_CONFIG), **special_tokens(path / SPECIAL_TOKENS_MAP)}
    ids = []
    for name, default in DROPPED_TOKENS.items():
        token = named.get(name, default)
        found = tokenizer.token_to_id(token)
        if found is None:
            raise ExportError(f"the tokenizer has no {name} {token!r}: BGE-M3 drops it from the lexical weights")
        ids.append(found)
    return tuple(sorted(set(ids)))


class M3Output(NamedTuple):
    """One text's three outputs, as FlagEmbedding's ``BGEM3FlagModel.encode`` answers them."""

    dense: np.ndarray
    lexical: dict[int, float]
    colbert: np.ndarray


def token_weights(states: np.ndarray, heads: M3Heads) -> np.ndarray:
    """``relu(h w^T + b)`` for token states ``[..., hidden]``: ``[...]``."""
    return np.maximum(states.astype(np.float32) @ heads.sparse_weight + np.float32(heads.sparse_bias), 0)


def colbert_vectors(states: np.ndarray, heads: M3Heads) -> np.ndarray:
    """``h W^T + b`` for token states ``[..., hidden]``, L2-normalised: ``[..., dim]``."""
    return l2_normalize(states.astype(np.float32) @ heads.colbert_weight.T + heads.colbert_bias)


def m3_outputs(states: np.ndarray, ids: np.ndarray, heads: M3Heads, dropped_ids: tuple[int, ...]) -> M3Output:
    """The three outputs of one text from its token states ``[n, hidden]`` and ids ``[n]`` (no padding)."""
    lexical = lexical_weights(ids, token_weights(states, heads), dropped_ids)
    return M3Output(l2_normalize(states[0].astype(np.float32)), lexical, colbert_vectors(states[1:], heads))


def m3_arrays(states: np.ndarray, feeds: dict[str, np.ndarray], heads: M3Heads,
              dropped_ids: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What :func:`add_m3_heads`' outputs answer for a padded batch: its token states ``[batch, sequence,
    hidden]`` and the graph's ``input_ids``, ``attention_mask`` and :data:`SCORE_MASK` in ``feeds``."""
    kept = feeds[MASK].astype(bool) & ~np.isin(feeds[IDS], dropped_ids)
    sparse = token_weights(states, heads) * kept
    vectors = colbert_vectors(states, heads) * feeds[SCORE_MASK][..., None]
    return l2_normalize(states[:, 0].astype(np.float32)), sparse.astype(np.float32), vectors.astype(np.float32)


def lexical_weights(ids: np.ndarray, weights: np.ndarray, dropped_ids: tuple[int, ...]) -> dict[int, float]:
    """One text's lexical weights from its token ids and weights ``[n]``: per id its tokens' largest weight,
    zero weights and the ids in ``dropped_ids`` left out."""
    lexical: dict[int, float] = {}
    for token, weight in zip(ids.tolist(), weights.tolist()):
        if token not in dropped_ids and weight > lexical.get(token, 0.0):
            lexical[token] = weight
    return lexical


def lexical_score(a: dict[int, float], b: dict[int, float]) -> float:
    """Two texts' lexical matching score: the sum of weight products over the ids they share."""
    return float(sum(weight * b[token] for token, weight in a.items() if token in b))


def colbert_score(query: np.ndarray, document: np.ndarray) -> float:
    """BGE-M3's ColBERT score: each query vector's best match in the document, summed, over the query's count."""
    return float((query @ document.T).max(axis=1).sum() / len(query))


def add_m3_heads(source: Path, target: Path, states: str, heads: M3Heads, dropped_ids: tuple[int, ...],
                 embedding: str, sparse: str, vectors: str) -> Path:
    """Write ``source`` as ``target`` with its token-state output ``states`` replaced by BGE-M3's three outputs,
    fp32: ``embedding`` ``[batch, hidden]`` (CLS, normalised), ``sparse`` ``[batch, sequence]`` (token weights
    times the attention mask, zero at ``dropped_ids``) and ``vectors`` ``[batch, sequence, dim]`` (ColBERT
    vectors, normalised, times the graph input :data:`SCORE_MASK`, added when the graph lacks it)."""
    p = PREFIX + "m3/"
    initializers = [
        numpy_helper.from_array(heads.sparse_weight.astype(np.float32), p + "sparse_weight"),
        numpy_helper.from_array(np.array(heads.sparse_bias, np.float32), p + "sparse_bias"),
        numpy_helper.from_array(heads.colbert_weight.T.astype(np.float32).copy(), p + "colbert_weight"),
        numpy_helper.from_array(heads.colbert_bias.astype(np.float32), p + "colbert_bias"),
        numpy_helper.from_array(np.array(dropped_ids, np.int64), p + "dropped_ids"),
    ]

    def rewrite(model: onnx.ModelProto) -> None:
        graph = model.graph
        shape = _check_graph(graph, states)
        nodes = [prefixed_node("Cast", [states], p + "states", to=TensorProto.FLOAT)]  # fp32 even after an fp16 encoder
        for part, output in ((_dense_nodes, embedding), (_sparse_nodes, sparse), (_colbert_nodes, vectors)):
            more, value = part(p + "states")
            nodes += more + [helper.make_node("Identity", [value], [output], name=PREFIX + output)]
        graph.node.extend(nodes)
        used = {name for node in nodes for name in node.input}
        graph.initializer.extend([c for c in pooling_constants() if c.name in used] + initializers)
        batch, sequence = shape[0], shape[1]
        del graph.output[:]
        graph.output.extend([
            helper.make_tensor_value_info(embedding, TensorProto.FLOAT, [batch, shape[2]]),
            helper.make_tensor_value_info(sparse, TensorProto.FLOAT, [batch, sequence]),
            helper.make_tensor_value_info(vectors, TensorProto.FLOAT, [batch, sequence, heads.colbert_dim]),
        ])

    return onnx_files.rewrite(source, target, rewrite)


def _check_graph(graph: onnx.GraphProto, states: str) -> list:
    """``states``' shape; the graph input :data:`SCORE_MASK` added where missing."""
    outputs = {o.name: o for o in graph.output}
    inputs = [i.name for i in graph.input]
    if states not in outputs or MASK not in inputs or IDS not in inputs:
        raise ExportError(f"cannot add BGE-M3's heads to the graph: it needs the output {states!r} and the inputs "
                          f"{MASK!r}, {IDS!r} (outputs {list(outputs)}, inputs {inputs})")
    shape = [d.dim_param or d.dim_value for d in outputs[states].type.tensor_type.shape.dim]
    if SCORE_MASK not in inputs:
        graph.input.append(helper.make_tensor_value_info(SCORE_MASK, TensorProto.INT64, shape[:2]))
    return shape


def _dense_nodes(states: str) -> tuple[list[onnx.NodeProto], str]:
    pooled, cls = pool_states(states, "cls")
    normalized, vectors = normalize_nodes(cls)
    return pooled + normalized, vectors


def _sparse_nodes(states: str) -> tuple[list[onnx.NodeProto], str]:
    """``relu(h w^T + b)`` times the attention mask, zero where the token's id is a dropped one."""
    p = PREFIX + "m3/"
    return [
        prefixed_node("MatMul", [states, p + "sparse_weight"], p + "sparse_linear"),  # [batch, sequence]
        prefixed_node("Add", [p + "sparse_linear", p + "sparse_bias"], p + "sparse_biased"),
        prefixed_node("Relu", [p + "sparse_biased"], p + "sparse_relu"),
        prefixed_node("Cast", [MASK], p + "attention", to=TensorProto.FLOAT),
        prefixed_node("Unsqueeze", [IDS, PREFIX + "axis2"], p + "ids"),  # [batch, sequence, 1] against [dropped]
        prefixed_node("Equal", [p + "ids", p + "dropped_ids"], p + "is_dropped"),
        prefixed_node("Cast", [p + "is_dropped"], p + "dropped", to=TensorProto.FLOAT),
        prefixed_node("ReduceMax", [p + "dropped"], p + "any_dropped", axes=[2], keepdims=0),
        prefixed_node("Sub", [PREFIX + "one_f", p + "any_dropped"], p + "kept"),
        prefixed_node("Mul", [p + "attention", p + "kept"], p + "weighed"),
        prefixed_node("Mul", [p + "sparse_relu", p + "weighed"], p + "sparse"),
    ], p + "sparse"


def _colbert_nodes(states: str) -> tuple[list[onnx.NodeProto], str]:
    """``h W^T + b`` per token, L2-normalised, times the scoring mask."""
    p = PREFIX + "m3/"
    return [
        prefixed_node("MatMul", [states, p + "colbert_weight"], p + "colbert_linear"),
        prefixed_node("Add", [p + "colbert_linear", p + "colbert_bias"], p + "colbert"),
        *normalize_nodes(p + "colbert", p + "colbert_unit")[0],
        prefixed_node("Cast", [SCORE_MASK], p + "scored", to=TensorProto.FLOAT),
        prefixed_node("Unsqueeze", [p + "scored", PREFIX + "axis2"], p + "scored_rows"),  # [batch, sequence, 1]
        prefixed_node("Mul", [p + "colbert_unit", p + "scored_rows"], p + "vectors"),
    ], p + "vectors"


@dataclass(frozen=True)
class M3Head:
    """How a BGE-M3 export ends its graphs (:func:`add_m3_heads`): what each target appends to its candidates."""

    #: the token-state output the heads read
    states: str
    heads: M3Heads
    dropped_ids: tuple[int, ...]

    def append(self, source: Path, target: Path) -> Path:
        return add_m3_heads(source, target, self.states, self.heads, self.dropped_ids, *self.outputs)

    @property
    def outputs(self) -> list[str]:
        return [EMBEDDING, SPARSE_WEIGHTS, MULTI_VECTOR]

    @property
    def per_token(self) -> list[str]:
        """The outputs that follow the sequence (cut with the padding)."""
        return [SPARSE_WEIGHTS, MULTI_VECTOR]

    @property
    def inputs(self) -> tuple[str, ...]:
        """The graph input the heads add, after the encoder's own."""
        return (SCORE_MASK,)

    def complete(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``feeds`` with a scoring mask of every attended token but the first (timing and calibration: which
        tokens are scored changes nothing the encoder computes)."""
        score = feeds[MASK].copy()
        score[:, 0] = 0
        return {**feeds, SCORE_MASK: score}


#: the token weight from which validation under the parity bar requires the graph to keep a term
KEPT_WEIGHT = 1e-4
#: the cosine a text's token weights count as against the reference where both rows are all zero (nothing kept)
_BOTH_EMPTY = 1.0


@dataclass
class M3Embedder:
    """How token states become BGE-M3's three outputs, for validation (:func:`m3_arrays` on PyTorch's states),
    and the sides the tokenizer step serves (no markers, no expansion, the first token never scored)."""

    heads: M3Heads
    dropped_ids: tuple[int, ...]
    #: the tokenizer step's sides (``python_models/sides.py``)
    sides: Sides
    reads: ClassVar[str] = SCORE_MASK
    per_token: ClassVar[bool] = False
    #: the graph's outputs, and those that follow the sequence
    outputs: ClassVar[tuple[str, ...]] = (EMBEDDING, SPARSE_WEIGHTS, MULTI_VECTOR)
    token_outputs: ClassVar[tuple[str, ...]] = (SPARSE_WEIGHTS, MULTI_VECTOR)
    #: the served similarity of the ColBERT vectors: MaxSim over the query's vector count
    similarity: ClassVar[str] = "meanmaxsim"
    #: how users score each output (:mod:`score_fidelity`): cosine, the lexical matching score, MeanMaxSim
    scored: ClassVar[tuple[str, ...]] = (COSINE, LEXICAL, similarity)

    def answer(self, states: np.ndarray, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """The three outputs of a padded batch, as :data:`outputs` orders them."""
        return list(m3_arrays(states, feeds, self.heads, self.dropped_ids))

    @staticmethod
    def cosines(got: list[np.ndarray], expected: list[np.ndarray], scored: np.ndarray) -> list[float]:
        """The fidelity of the per-token outputs beside the dense vector's: each scored token's ColBERT vector,
        and each text's token weights as one vector (two texts that keep no weight agree)."""
        vectors = _cosine(got[2], expected[2])[scored.astype(bool)]
        weights = _cosine(got[1], expected[1])
        empty = ~got[1].any(axis=-1) & ~expected[1].any(axis=-1)
        return [*vectors.tolist(), *np.where(empty, _BOTH_EMPTY, weights).tolist()]

    @staticmethod
    def lost_terms(got: list[np.ndarray], expected: list[np.ndarray]) -> list[str]:
        """Under the parity bar: the token weights PyTorch gives at least :data:`KEPT_WEIGHT` that the graph
        zeroes (a term a text would lose), as one failure message; none where every such weight is kept."""
        lost = (expected[1] >= KEPT_WEIGHT) & (got[1] <= 0)
        if not lost.any():
            return []
        return [f"SPARSE_WEIGHTS: {int(lost.sum())} token weights >= {KEPT_WEIGHT:g} in PyTorch are zero in the graph"]

    @property
    def vector_size(self) -> int:
        return self.heads.colbert_dim

    @property
    def graph_only(self) -> list[str]:
        """The python post-processing step has no copy of the heads: only the graph applies them."""
        return ["BGE-M3's sparse and ColBERT heads"]

    def record(self) -> dict:
        return {"pooling": M3_POOLING, "normalize": True}

    def stored(self) -> dict[str, np.ndarray]:
        """What validating the graph again needs beside PyTorch's token states, kept with the stored reference
        (validation.json keeps no weights): the heads and the dropped ids (:meth:`from_stored` reads them)."""
        return {"sparse_weight": self.heads.sparse_weight, "sparse_bias": np.float32(self.heads.sparse_bias),
                "colbert_weight": self.heads.colbert_weight, "colbert_bias": self.heads.colbert_bias,
                "dropped_ids": np.asarray(self.dropped_ids, np.int64)}

    @classmethod
    def from_stored(cls, arrays: dict[str, np.ndarray], max_length: int) -> M3Embedder:
        """The embedder :meth:`stored` kept, for an export served at ``max_length``."""
        heads = M3Heads(arrays["sparse_weight"], float(arrays["sparse_bias"]), arrays["colbert_weight"],
                        arrays["colbert_bias"])
        return cls(heads, tuple(int(i) for i in arrays["dropped_ids"]), m3_sides(max_length))


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine over the last axis, in float64."""
    a, b = l2_normalize(a.astype(np.float64)), l2_normalize(b.astype(np.float64))
    return np.sum(a * b, axis=-1)


def m3_sides(max_length: int) -> Sides:
    """BGE-M3's tokenizer sides: both the model's length, no marker, expansion or skiplist; the first token's
    ColBERT vector is never answered (FlagEmbedding drops it)."""
    side = Side("", max_length)
    return Sides(side, side, drop_first=True)
