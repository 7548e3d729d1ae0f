"""Families that exist only as hub remote code, which nexus-sli never runs.

They are registered with their published prefixes and config keys so that
detection, prefixes and sizes work today; their layers are rebuilt by the
project in a later change, until then ``create_layer`` says so.
"""

from __future__ import annotations

from typing import Any

from .base import EncoderFamily, normalize_model_type, register

_PENDING = "the project must rebuild this family's layers itself, since it never runs hub remote code"


@register
class JinaBertFamily(EncoderFamily):
    """jina-embeddings-v2: BERT layout, ALiBi attention biases, gated-GELU MLP.
    Its configs say ``model_type: bert``; it is told apart by its architectures,
    ``auto_map`` or ``position_embedding_type: alibi``."""

    model_type = "jinabert"
    architectures = ("JinaBertModel", "JinaBertForMaskedLM", "JinaBertForSequenceClassification",
                     "JinaBertForTokenClassification", "JinaBertForQuestionAnswering")
    base_prefix = "bert"
    not_implemented_reason = _PENDING
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
class NeoBertFamily(EncoderFamily):
    """NeoBERT: pre-norm RMSNorm blocks, rotary positions, SwiGLU feed-forward.
    Published weight names: ``encoder`` (token embeddings),
    ``transformer_encoder.{i}.{qkv,wo,ffn.w12,ffn.w3,attention_norm,ffn_norm}``,
    ``layer_norm``."""

    model_type = "neobert"
    architectures = ("NeoBERT", "NeoBERTLMHead", "NeoBERTForSequenceClassification")
    base_prefix = "model"
    layer_template = "transformer_encoder.{i}."
    embedding_name = "encoder"
    max_positions_keys = ("max_length", "max_position_embeddings")
    optional_prefixes = ()
    pretraining_head_prefixes = ("decoder.",)
    not_implemented_reason = _PENDING
