"""How a pooled task's answer is made from the graph's output, as the model's folder says.

A task spec's ``pooled_by`` (:mod:`nexus_sli.tasks.spec`) names one entry of
:data:`POOLERS`.  Each reads the model's sentence-transformers folder (through
:mod:`st_folder`, the one reader of its files) and gives
the embedder (the numpy pooling validation applies to PyTorch's outputs, whose
parameters the post-processing and clients read) and the same pooling as ONNX
ops that every target appends to its candidate graphs (:mod:`pooling`):

- ``sentence``: mean, cls or max pooling, the pipeline's ``Dense`` modules
  (:mod:`dense`, on the token states or the pooled vector) and ``LayerNorm``,
  and L2 normalisation (``1_Pooling``, ``Normalize``), the token states kept
  beside the embedding where the task keeps them (``token_states``);
- ``splade``: sentence-transformers' ``SpladePooling`` over masked-LM logits,
  its ``pooling_strategy`` and ``activation_function`` read from its config;
- ``multi-vector``: a late-interaction model (``MultiVectorEncoder``, PyLate or
  Stanford ColBERT folder, read by :mod:`multi_vector`): its Dense modules and
  normalisation on every token, kept where the scoring mask says;
- ``bge-m3``: BGE-M3's dense, sparse and ColBERT heads (:mod:`m3_heads`, the
  ``.pt`` files beside the weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from nexus_sli.exporter.errors import NexusError
from nexus_sli.exporter.triton.python_models.sides import SCORE_MASK

from .dense import chained_size
from .m3_heads import M3Embedder, M3Head, check_heads, dropped_token_ids, m3_sides, read_m3_heads
from .multi_vector import MultiVectorConfig, read_multi_vector
from .pooling import MultiVectorHead, Pooling, SpladePooling
from .st_folder import dense_modules, layer_norm, normalizes, pooling_mode, splade_config
from .validate import Embedder, MultiVectorEmbedder, SparseEmbedder


@dataclass(frozen=True)
class ModelFolder:
    """The model a pooler reads: its folder, and what the export found out about it."""

    path: Path
    task: Any
    hidden_size: int
    vocab_size: int
    #: the tokenizer the export serves, as the folder has it (``tokenizers.Tokenizer``)
    tokenizer: Any = None
    #: the encoder's positions
    max_positions: int = 0
    #: a checkpoint's pickle files may be read (``--allow-pickle``)
    allow_pickle: bool = False
    #: the length the export serves (the model's, as its folder says)
    max_length: int = 0


def _sentence(model: ModelFolder) -> tuple[Embedder, Pooling]:
    path, task, hidden_size = model.path, model.task, model.hidden_size
    on_tokens, on_pooled = dense_modules(path, model.allow_pickle)
    embedder = Embedder(pooling_mode(path), normalizes(path), layer_norm(path), [*on_tokens, *on_pooled])
    size = chained_size(embedder.dense, hidden_size, path)
    if embedder.layer_norm is not None and len(embedder.layer_norm.weight) != size:
        raise NexusError(f"{path}: the LayerNorm module normalises {len(embedder.layer_norm.weight)} values; "
                         f"the vectors before it have {size}")
    tokens = task.token_states.name if task.token_states is not None else None
    return embedder, Pooling(embedder.pooling, embedder.normalize, task.output_names()[0], task.client_output,
                             size, tokens, embedder.layer_norm, tuple(embedder.dense))


def _splade(model: ModelFolder) -> tuple[SparseEmbedder, SpladePooling]:
    embedder = SparseEmbedder(*splade_config(model.path))
    return embedder, SpladePooling(embedder.strategy, embedder.activation, model.task.output_names()[0],
                                   model.task.client_output, model.vocab_size)


def multi_vector_config(model: ModelFolder) -> MultiVectorConfig:
    """The late-interaction model's sides, projection, normalisation and similarity (:mod:`multi_vector`)."""
    if model.tokenizer is None:
        raise NexusError(f"{model.path}: reading a late-interaction model needs the tokenizer it serves")
    return read_multi_vector(model.path, model.tokenizer, model.max_positions, allow_pickle=model.allow_pickle)


def _multi_vector(model: ModelFolder) -> tuple[MultiVectorEmbedder, MultiVectorHead]:
    config = multi_vector_config(model)
    size = chained_size(list(config.dense), model.hidden_size, model.path)
    embedder = MultiVectorEmbedder(config.normalize, list(config.dense), config.similarity, size, config)
    return embedder, MultiVectorHead(model.task.output_names()[0], model.task.client_output, SCORE_MASK,
                                     config.dense, config.normalize, size)


def _bge_m3(model: ModelFolder) -> tuple[M3Embedder, M3Head]:
    check_heads(model.path, "bge-m3")
    if model.tokenizer is None:
        raise NexusError(f"{model.path}: reading BGE-M3's dropped token ids needs the tokenizer it serves")
    heads = read_m3_heads(model.path, model.hidden_size, model.allow_pickle)
    dropped = dropped_token_ids(model.path, model.tokenizer)
    return M3Embedder(heads, dropped, m3_sides(model.max_length)), M3Head(model.task.output_names()[0], heads, dropped)


#: ``TaskSpec.pooled_by`` -> (the model) -> (embedder, in-graph pooling)
POOLERS: dict[str, Callable[[ModelFolder], tuple[Any, Any]]] = {
    "sentence": _sentence, "splade": _splade, "multi-vector": _multi_vector, "bge-m3": _bge_m3}


def poolers(model: ModelFolder) -> tuple[Any, Any]:
    """(embedder, in-graph pooling) of ``model.task`` for the model; (None, None) for a task whose
    post-processing head reads the encoder's outputs."""
    if model.task.pooled_by is None:
        return None, None
    return POOLERS[model.task.pooled_by](model)
