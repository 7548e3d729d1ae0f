"""``BERTFamilyHandler`` and the registry: the seed's public API.

The handler is the single family (``family_id == "bert"``) that covers all
thirteen encoder model types; per-type facts live in :mod:`.families`.  A
handler becomes specific to one model when it is *bound* to a config (and,
ideally, to a checkpoint's keys, from which the real weight prefix is read).
"""

from __future__ import annotations

import re
from typing import Any, Iterable

from torch import nn

from nexus_sli.exporter.errors import CheckpointError, UnsupportedModelError
from .families import FAMILIES, EncoderFamily, family_for, supported_types
from .families.base import ENCODER


def _model_type(config: Any) -> str:
    return (config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)) or ""


def _architectures(config: Any) -> list[str]:
    value = config.get("architectures") if isinstance(config, dict) else getattr(config, "architectures", None)
    return list(value or [])


def _family_of(config: Any) -> EncoderFamily:
    return family_for(_model_type(config), _architectures(config), config)


def detect_layer_prefix(family: EncoderFamily, keys: Iterable[str]) -> str:
    """The prefix before ``family.layer_template`` in a checkpoint's keys:
    ``""`` for a base model, ``"bert."`` for a task model, and so on."""
    pattern = re.escape(family.layer_template)
    for placeholder in ("i", "group", "inner"):
        pattern = pattern.replace(re.escape("{" + placeholder + "}"), r"\d+")
    layer_key = re.compile(rf"^(.*?){pattern}")
    keys = list(keys)
    found = {m.group(1) for m in map(layer_key.match, keys) if m}
    if len(found) == 1:
        return found.pop()
    expected = family.layer_template.format(i="N", group="G", inner="I")
    if not found:
        sample = ", ".join(sorted(keys)[:6])
        raise CheckpointError(
            f"no checkpoint key looks like a {family.model_type} layer ('<prefix>{expected}...'); "
            f"found keys such as: {sample}"
        )
    raise CheckpointError(
        f"checkpoint mixes layer prefixes {sorted(found)} for '{expected}'; expected exactly one"
    )


class BERTFamilyHandler:
    """Handler for BERT-based encoder architectures (see the encoder-support spec)."""

    family_id = "bert"
    family_name = "BERT-Based Encoder Architectures"
    trust_remote_code = False

    def __init__(self) -> None:
        self.model_types: list[str] = supported_types()
        self.architectures: list[str] = sorted({a for f in FAMILIES.values() for a in f.architectures})
        self._family: EncoderFamily = FAMILIES["bert"]
        self._config: Any = None
        self._prefix: str | None = None  # from a checkpoint; None = the family's default

    # -- binding --------------------------------------------------------------
    @property
    def family(self) -> EncoderFamily:
        return self._family

    @property
    def prefix(self) -> str:
        """Prefix of the base model inside the bound checkpoint (``""``, ``"bert."``...)."""
        return self._family.default_prefix if self._prefix is None else self._prefix

    def bind(self, config: Any, checkpoint_keys: Iterable[str] | None = None) -> "BERTFamilyHandler":
        """Make the handler specific to ``config`` and, given its keys, to a checkpoint."""
        family = _family_of(config)
        if family is not self._family or config is not self._config:  # another model: its checkpoint's prefix unknown
            self._prefix = None
        self._family, self._config = family, config
        if checkpoint_keys is not None:
            self._prefix = detect_layer_prefix(family, checkpoint_keys)
        return self

    # -- the seed's API -------------------------------------------------------
    def matches(self, model_type: str, architectures: list[str], config: Any = None) -> bool:
        try:
            family_for(model_type, architectures, config)
        except UnsupportedModelError:
            return False
        return True

    def get_layer_prefix(self, layer_idx: int, layer_type: str = ENCODER) -> str:
        self._family.check_layer(self._config, layer_idx, layer_type)
        return self.prefix + self._family.layer_path(self._config, layer_idx)

    def create_layer(self, config: Any, layer_idx: int, layer_type: str = ENCODER) -> nn.Module:
        self.bind(config)
        self._family.check_layer(config, layer_idx, layer_type)
        return self._family.create_layer(config, layer_idx)

    def get_embedding_name(self) -> str:
        return self.prefix + self._family.embedding_name

    def get_lm_head_name(self) -> None:
        """Encoder-only models have no generation head."""
        return None

    def is_encoder_only(self) -> bool:
        return True

    def get_num_layers(self, config: Any) -> int:
        return _family_of(config).num_layers(config)

    def get_hidden_size(self, config: Any) -> int:
        return _family_of(config).hidden_size(config)

    def get_vocab_size(self, config: Any) -> int:
        return _family_of(config).vocab_size(config)


class ArchitectureRegistry:
    """Finds the handler for a config.  Today one handler serves every encoder."""

    def __init__(self) -> None:
        self._handler_types = [BERTFamilyHandler]

    @property
    def families(self) -> list[str]:
        return [t.family_id for t in self._handler_types]

    def detect_family(self, config: Any) -> BERTFamilyHandler:
        """A fresh handler bound to ``config``; :class:`UnsupportedModelError` if none fits."""
        for handler_type in self._handler_types:
            handler = handler_type()
            if handler.matches(_model_type(config), _architectures(config), config):
                return handler.bind(config)
        raise UnsupportedModelError(
            f"no family handles model type {_model_type(config)!r} "
            f"(architectures {_architectures(config)}); supported types: {', '.join(supported_types())}"
        )


_REGISTRY: ArchitectureRegistry | None = None


def get_registry() -> ArchitectureRegistry:
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = ArchitectureRegistry()
    return _REGISTRY
