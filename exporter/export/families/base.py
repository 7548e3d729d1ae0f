"""What one encoder family is: prefixes, config keys, layer class.

Each supported ``model_type`` is described by one :class:`EncoderFamily`
subclass whose class constants are the only home of that family's facts.
Close relatives are near-empty subclasses (ELECTRA is BERT with another base
prefix).  The registry is filled by the :func:`register` decorator and refuses
duplicates, so two families can never silently claim the same model type.
"""

from __future__ import annotations

import importlib
import numbers
from typing import Any, ClassVar, Iterator

from torch import nn

from nexus_sli.exporter.errors import (
    LayerIndexError,
    LayerTypeError,
    NotYetImplementedError,
    UnsupportedModelError,
)

ENCODER = "encoder"
#: The transformers auto class of a task model that keeps the masked-LM head (sparse embeddings).
MASKED_LM = "AutoModelForMaskedLM"


def config_value(config: Any, keys: tuple[str, ...], default: Any = None) -> Any:
    """First of ``keys`` present in a config object or plain dict."""
    for key in keys:
        value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
        if value is not None:
            return value
    return default


class EncoderFamily:
    """Facts about one model type.  Subclasses override class constants only,
    plus the few methods where a family's layout really differs (ALBERT)."""

    model_type: ClassVar[str]
    #: Other spellings of ``model_type`` (configs use hyphens, the seed underscores).
    aliases: ClassVar[tuple[str, ...]] = ()
    architectures: ClassVar[tuple[str, ...]] = ()
    #: ``base_model_prefix`` of the task models (``bert.encoder.layer.0.``).
    base_prefix: ClassVar[str]
    #: Prefix the handler reports before a checkpoint is bound (the seed's examples).
    default_prefix: ClassVar[str] = ""
    #: Checkpoint path of layer ``i`` relative to the base model.
    layer_template: ClassVar[str] = "encoder.layer.{i}."
    #: Where layer ``i`` sits in the transformers model, when the published
    #: checkpoint names it differently (Nomic); None = same as ``layer_template``.
    module_template: ClassVar[str | None] = None
    embedding_name: ClassVar[str] = "embeddings"
    #: ``"module:Class"`` under ``transformers.models``, or None when not written yet.
    layer_class: ClassVar[str | None] = None
    layer_takes_index: ClassVar[bool] = False
    hidden_size_keys: ClassVar[tuple[str, ...]] = ("hidden_size",)
    num_layers_keys: ClassVar[tuple[str, ...]] = ("num_hidden_layers",)
    vocab_size_keys: ClassVar[tuple[str, ...]] = ("vocab_size",)
    max_positions_keys: ClassVar[tuple[str, ...]] = ("max_position_embeddings",)
    num_heads_keys: ClassVar[tuple[str, ...]] = ("num_attention_heads", "n_heads", "n_head")
    #: RoBERTa-style models number positions from ``pad_token_id + 1``.
    position_offset_from_pad: ClassVar[bool] = False
    #: Base-model tensors a checkpoint may lack when the task does not use them.
    optional_prefixes: ClassVar[tuple[str, ...]] = ("pooler.",)
    #: Pre-training heads: present in many checkpoints, unused by the served tasks but one: the
    #: sparse-embedding task's model has the masked-LM head, and the walk loads it there.
    pretraining_head_prefixes: ClassVar[tuple[str, ...]] = ()
    #: Whether the sparse-embedding task (SPLADE over the masked-LM head) is built for this family:
    #: only where its export was checked against sentence-transformers' SparseEncoder (tests/test_sparse.py).
    masked_lm: ClassVar[bool] = False
    #: Why a family is registered without layer code (shown in errors and docs).
    not_implemented_reason: ClassVar[str | None] = None

    # -- config ---------------------------------------------------------------
    def names(self) -> tuple[str, ...]:
        return (self.model_type, *self.aliases)

    def num_layers(self, config: Any) -> int:
        return int(config_value(config, self.num_layers_keys))

    def hidden_size(self, config: Any) -> int:
        return int(config_value(config, self.hidden_size_keys))

    def ffn_width(self, config: Any) -> int | None:
        """Inner width of the feed-forward block (its output projection maps it back)."""
        width = config_value(config, ("intermediate_size", "hidden_dim", "n_inner"))
        return int(width) if width else None

    def num_heads(self, config: Any) -> int:
        return int(config_value(config, self.num_heads_keys))

    def vocab_size(self, config: Any) -> int:
        return int(config_value(config, self.vocab_size_keys))

    def max_positions(self, config: Any) -> int:
        """Longest sequence the position embeddings allow."""
        limit = int(config_value(config, self.max_positions_keys))
        if self.position_offset_from_pad:
            limit -= int(config_value(config, ("pad_token_id",), 1)) + 1
        return limit

    def matches_config(self, model_type: str, architectures: list[str], config: Any) -> bool:
        """Extra test for families that share a ``model_type`` (JinaBERT is ``bert``)."""
        return normalize_model_type(model_type) in {normalize_model_type(n) for n in self.names()}

    # -- layers ---------------------------------------------------------------
    def virtual_layer_count(self, config: Any) -> int:
        return self.num_layers(config)

    def check_layer(self, config: Any, layer_idx: int, layer_type: str) -> None:
        if layer_type != ENCODER:
            raise LayerTypeError(
                f"{self.model_type} is encoder-only: layer_type must be 'encoder', got {layer_type!r}"
            )
        count = self.virtual_layer_count(config) if config is not None else None
        # numpy's integers are indices too; a bool is an int to Python, and no index
        if (isinstance(layer_idx, bool) or not isinstance(layer_idx, numbers.Integral) or layer_idx < 0
                or (count is not None and layer_idx >= count)):
            bound = f"[0, {count})" if count is not None else "non-negative integers"
            raise LayerIndexError(
                f"layer index {layer_idx!r} is out of range for {self.model_type}: valid indices are {bound}"
            )

    def layer_path(self, config: Any, layer_idx: int) -> str:
        """Prefix of layer ``layer_idx`` relative to the base model, ending in '.'."""
        return self.layer_template.format(i=layer_idx)

    def weight_slots(self, config: Any) -> Iterator[tuple[int, str]]:
        """(first virtual layer index, relative prefix) for each distinct set of
        layer weights: one per layer, or one per shared layer (ALBERT)."""
        seen = set()
        for idx in range(self.virtual_layer_count(config)):
            path = self.layer_path(config, idx)
            if path not in seen:
                seen.add(path)
                yield idx, path

    def module_path(self, config: Any, layer_idx: int) -> str:
        """Module path of layer ``layer_idx`` inside the transformers base model."""
        if self.module_template is None:
            return self.layer_path(config, layer_idx)[:-1]
        return self.module_template.format(i=layer_idx)

    def adapt_config(self, config: Any) -> None:
        """Make ``config`` (the walk's private copy) say what the layer classes read, where the checkpoint's
        config spells it otherwise (Nomic's original keys); refuse what they cannot compute."""

    def convert_layer_tensors(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """Published per-layer tensor names -> the transformers layer's names."""
        return tensors

    def convert_key(self, key: str) -> str:
        """Published name of a tensor outside the layers -> the transformers name."""
        return key

    def build_model(self, task: Any, config: Any) -> nn.Module:
        """The model ``task`` serves, with freshly initialised weights the walk
        then replaces.  Families transformers lacks override this."""
        if task.auto_class == MASKED_LM and not self.masked_lm:
            served = ", ".join(f.model_type for f in FAMILIES.values() if f.masked_lm)
            raise UnsupportedModelError(f"task {task.name!r} reads the masked-LM head, which the exporter builds "
                                        f"for {served}, not for {self.model_type}")
        return task.build(config)

    def create_layer(self, config: Any, layer_idx: int) -> nn.Module:
        if self.layer_class is None:
            raise NotYetImplementedError(
                f"{self.model_type}: layer code is not yet implemented ({self.not_implemented_reason})"
            )
        module_name, class_name = self.layer_class.split(":")
        cls = getattr(importlib.import_module(f"transformers.models.{module_name}"), class_name)
        return cls(config, layer_idx=layer_idx) if self.layer_takes_index else cls(config)


def normalize_model_type(name: str) -> str:
    """``deberta-v2`` and ``deberta_v2`` are the same type."""
    return name.strip().lower().replace("-", "_")


FAMILIES: dict[str, EncoderFamily] = {}
_BY_NAME: dict[str, EncoderFamily] = {}


def register(cls: type[EncoderFamily]) -> type[EncoderFamily]:
    family = cls()
    for key in {normalize_model_type(name) for name in family.names()}:
        if key in _BY_NAME:
            raise RuntimeError(f"model type {key!r} registered twice ({cls.__name__})")
        _BY_NAME[key] = family
    FAMILIES[family.model_type] = family
    return cls


def supported_types() -> list[str]:
    return list(FAMILIES)


def family_for(model_type: str, architectures: list[str] | None = None, config: Any = None) -> EncoderFamily:
    """The family of a config; families with a ``matches_config`` override win
    over the plain ``model_type`` lookup (JinaBERT ships ``model_type: bert``)."""
    architectures = list(architectures or [])
    for family in FAMILIES.values():
        if type(family).matches_config is not EncoderFamily.matches_config and family.matches_config(
            model_type, architectures, config
        ):
            return family
    family = _BY_NAME.get(normalize_model_type(model_type or ""))
    if family is None:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported; supported types: {', '.join(supported_types())}"
        )
    return family
