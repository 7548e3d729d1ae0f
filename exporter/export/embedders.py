"""How a pooled task's answer is made from the graph's output, as the model's folder says.

A task spec's ``pooled_by`` (:mod:`nexus_sli.tasks.spec`) names one entry of
:data:`POOLERS`.  Each reads the model's sentence-transformers folder and gives
the embedder (the numpy pooling validation applies to PyTorch's outputs, whose
parameters the post-processing and clients read) and the same pooling as ONNX
ops that every target appends to its candidate graphs (:mod:`pooling`):

- ``sentence``: mean, cls or max pooling, the pipeline's ``Dense`` modules
  (:mod:`dense`, on the token states or the pooled vector) and ``LayerNorm``,
  and L2 normalisation (``1_Pooling``, ``Normalize``), the token states kept
  beside the embedding where the task keeps them (``token_states``);
- ``splade``: sentence-transformers' ``SpladePooling`` over masked-LM logits,
  its ``pooling_strategy`` and ``activation_function`` read from its config.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from nexus_sli.exporter.errors import NexusError
from nexus_sli.exporter.triton.python_models.encoding import SPLADE_ACTIVATIONS, SPLADE_STRATEGIES

from .dense import chained_size
from .pooling import Pooling, SpladePooling
# sentence-transformers' modules.json, read where the rest of the folder is (one reader)
from .source import dense_modules, layer_norm, normalizes, pooling_mode, st_module_path
from .validate import Embedder, SparseEmbedder

#: The modules a sparse encoder folder may hold besides its SpladePooling: the masked-LM transformer
#: (``MLMTransformer``, or ``Transformer`` with ``transformer_task: fill-mask`` since sentence-transformers 6).
_SPARSE_TRANSFORMERS = ("MLMTransformer", "Transformer")


def _sentence(path: Path, task: Any, hidden_size: int, vocab_size: int) -> tuple[Embedder, Pooling]:
    on_tokens, on_pooled = dense_modules(path)
    embedder = Embedder(pooling_mode(path), normalizes(path), layer_norm(path), [*on_tokens, *on_pooled])
    size = chained_size(embedder.dense, hidden_size, path)
    if embedder.layer_norm is not None and len(embedder.layer_norm["weight"]) != size:
        raise NexusError(f"{path}: the LayerNorm module normalises {len(embedder.layer_norm['weight'])} values; "
                         f"the vectors before it have {size}")
    tokens = task.token_states.name if task.token_states is not None else None
    return embedder, Pooling(embedder.pooling, embedder.normalize, task.output_names()[0], task.client_output,
                             size, tokens, embedder.layer_norm, tuple(embedder.dense))


def splade_config(path: Path) -> tuple[str, str]:
    """(pooling strategy, activation) of the folder's SpladePooling module; ``max`` and ``relu`` (its
    defaults) where the folder has none.  Modules the export cannot reproduce are refused by name."""
    modules = json.loads((path / "modules.json").read_text()) if (path / "modules.json").is_file() else []
    others = [m.get("type", "?") for m in modules
              if not m.get("type", "").endswith(("SpladePooling", *_SPARSE_TRANSFORMERS))]
    if others:
        raise NexusError(f"{path / 'modules.json'}: the sparse-embedding export reproduces a masked-LM transformer "
                         f"followed by SpladePooling only, not {', '.join(others)}")
    folder = st_module_path(path, "SpladePooling")
    config = json.loads((folder / "config.json").read_text()) if folder and (folder / "config.json").is_file() else {}
    strategy, activation = config.get("pooling_strategy", "max"), config.get("activation_function", "relu")
    if strategy not in SPLADE_STRATEGIES or activation not in SPLADE_ACTIVATIONS:
        raise NexusError(f"unsupported SpladePooling pooling_strategy {strategy!r} / activation_function "
                         f"{activation!r} in {folder / 'config.json'}; known: {', '.join(SPLADE_STRATEGIES)} / "
                         f"{', '.join(SPLADE_ACTIVATIONS)}")
    return strategy, activation


def _splade(path: Path, task: Any, hidden_size: int, vocab_size: int) -> tuple[SparseEmbedder, SpladePooling]:
    embedder = SparseEmbedder(*splade_config(path))
    return embedder, SpladePooling(embedder.strategy, embedder.activation, task.output_names()[0],
                                   task.client_output, vocab_size)


#: ``TaskSpec.pooled_by`` -> (model folder, task, hidden size, vocabulary size) -> (embedder, in-graph pooling)
POOLERS: dict[str, Callable[[Path, Any, int, int], tuple[Any, Any]]] = {"sentence": _sentence, "splade": _splade}


def poolers(path: Path, task: Any, hidden_size: int, vocab_size: int) -> tuple[Any, Any]:
    """(embedder, in-graph pooling) of ``task`` for the model at ``path``; (None, None) for a task whose
    post-processing head reads the encoder's outputs."""
    if task.pooled_by is None:
        return None, None
    return POOLERS[task.pooled_by](path, task, hidden_size, vocab_size)


def is_sparse_encoder(path: Path) -> bool:
    """Whether the folder is a sentence-transformers SparseEncoder with SpladePooling (``--task auto``
    exports it as sparse embeddings; a ``*ForMaskedLM`` architecture alone does not say so)."""
    return st_module_path(path, "SpladePooling") is not None
