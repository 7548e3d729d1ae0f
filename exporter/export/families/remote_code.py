"""Families that exist only as hub remote code, which nexus-sli never runs.

transformers has no classes for them, so the project writes their layers and
task models itself (:mod:`.jinabert_model`, :mod:`.neobert_model`) with the
published module and weight names; the walk loads real checkpoints into them
strictly, exactly as it does for transformers' own layers.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, ClassVar

from torch import nn

from nexus_sli.exporter.errors import NexusError
from .base import EncoderFamily, config_value, normalize_model_type, register

log = logging.getLogger(__name__)


class ProjectCodeFamily(EncoderFamily):
    """A family whose modules are the project's own code, not transformers'.

    Names are ``"module:Class"`` under this package, imported on first use (the
    modules import transformers, which the handler alone should not pay for).
    Layers and task models are built from one normalized settings object."""

    layer_class: ClassVar[str]
    settings_class: ClassVar[str]
    #: task name -> the model class serving it (the base model for embeddings).
    task_models: ClassVar[dict[str, str]]

    @staticmethod
    def _resolve(name: str) -> Any:
        module, class_name = name.split(":")
        return getattr(importlib.import_module(f"{__package__}.{module}"), class_name)

    def _settings(self, config: Any) -> Any:
        return self._resolve(self.settings_class).from_config(config)

    def create_layer(self, config: Any, layer_idx: int) -> nn.Module:
        return self._resolve(self.layer_class)(self._settings(config))

    def build_model(self, task: Any, config: Any) -> nn.Module:
        name = self.task_models.get(task.name)
        if name is None:
            raise NexusError(
                f"{self.model_type} supports the tasks {', '.join(self.task_models)}; "
                f"task {task.name!r} is not written for it"
            )
        return self._resolve(name)(self._settings(config))


@register
class JinaBertFamily(ProjectCodeFamily):
    """jina-embeddings-v2: BERT layout, ALiBi attention biases, gated-GELU MLP.
    Its configs say ``model_type: bert``; it is told apart by its architectures,
    ``auto_map`` or ``position_embedding_type: alibi``."""

    model_type = "jinabert"
    architectures = ("JinaBertModel", "JinaBertForMaskedLM", "JinaBertForSequenceClassification",
                     "JinaBertForTokenClassification", "JinaBertForQuestionAnswering")
    base_prefix = "bert"
    layer_class = "jinabert_model:JinaBertLayer"
    settings_class = "jinabert_model:JinaBertSettings"
    task_models = {"embedding": "jinabert_model:JinaBertModel",
                   "classification": "jinabert_model:JinaBertForSequenceClassification"}
    pretraining_head_prefixes = ("cls.",)

    def matches_config(self, model_type: str, architectures: list[str], config: Any) -> bool:
        if normalize_model_type(model_type or "") == "jinabert":
            return True
        if normalize_model_type(model_type or "") != "bert":
            return False
        if any(a.startswith("JinaBert") for a in architectures):
            return True
        get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        auto_map = get("auto_map", None) or {}
        return get("position_embedding_type", None) == "alibi" or any(
            "jina" in str(v).lower() for v in auto_map.values()
        )


@register
class NeoBertFamily(ProjectCodeFamily):
    """NeoBERT: pre-norm RMSNorm blocks, rotary positions, SwiGLU feed-forward.
    Published weight names: ``encoder`` (token embeddings),
    ``transformer_encoder.{i}.{qkv,wo,ffn.w12,ffn.w3,attention_norm,ffn_norm}``,
    ``layer_norm``."""

    model_type = "neobert"
    architectures = ("NeoBERT", "NeoBERTLMHead", "NeoBERTForSequenceClassification")
    base_prefix = "model"
    layer_template = "transformer_encoder.{i}."
    embedding_name = "encoder"
    layer_class = "neobert_model:NeoBertEncoderBlock"
    settings_class = "neobert_model:NeoBertSettings"
    task_models = {"embedding": "neobert_model:NeoBertModel",
                   "classification": "neobert_model:NeoBertForSequenceClassification"}
    max_positions_keys = ("max_length", "max_position_embeddings")
    #: The published ``NeoBERTConfig`` default ``max_length``.
    default_max_length: ClassVar[int] = 1024
    optional_prefixes = ()
    pretraining_head_prefixes = ("decoder.",)

    def ffn_width(self, config: Any) -> int:
        from .neobert_model import NeoBertSettings

        return NeoBertSettings.from_config(config).ffn_size

    def max_positions(self, config: Any) -> int:
        limit = config_value(config, self.max_positions_keys)
        if limit is None:
            # transformers 5 drops ``max_length`` (a generation parameter to it) when a
            # NeoBERT config is read as a plain PretrainedConfig.
            log.warning("NeoBERT config has no max_length left; using NeoBERTConfig's default %d",
                        self.default_max_length)
            return self.default_max_length
        return int(limit)


@register
class GteFamily(ProjectCodeFamily):
    """GTE v1.5 and mGTE (Alibaba-NLP's ``new-impl``; configs say ``model_type: new``, or ``gte`` where
    transformers 5 saved them, with the same weight names): post-norm layers,
    rotary positions (NTK-scaled), a gated feed-forward.  Published weight names:
    ``embeddings.{word_embeddings,token_type_embeddings,LayerNorm}``,
    ``encoder.layer.{i}.{attention.qkv_proj,attention.o_proj,mlp.up_gate_proj,mlp.down_proj,attn_ln,mlp_ln}``,
    and in the task models ``new.`` before them, ``new.pooler.dense`` and ``classifier``."""

    model_type = "gte"
    aliases = ("new",)
    architectures = ("NewModel", "NewForMaskedLM", "NewForSequenceClassification")
    base_prefix = "new"
    layer_class = "gte_model:GteLayer"
    settings_class = "gte_model:GteSettings"
    # a reranker is new-impl's classification model with one label
    task_models = {"embedding": "gte_model:GteModel",
                   "classification": "gte_model:GteForSequenceClassification",
                   "rerank": "gte_model:GteForSequenceClassification"}
    pretraining_head_prefixes = ("lm_head.",)
