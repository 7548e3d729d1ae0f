"""JinaBERT v2 (``jina-embeddings-v2-*``), written by the project from its published definition.

Sources read: jinaai/jina-bert-implementation ``modeling_bert.py`` on the Hugging
Face hub (``JinaBertEmbeddings``, ``JinaBertSelfAttention``, ``JinaBertGLUMLP``,
``JinaBertEncoder.rebuild_alibi_tensor``, ``JinaBertForSequenceClassification``),
cross-checked against text-embeddings-inference
``backends/candle/src/models/jina.rs`` and ``alibi.rs``.  Papers: Günther et al.,
*Jina Embeddings 2* (arXiv:2310.19923); Press et al., *ALiBi* (arXiv:2108.12409),
in its symmetric, bidirectional form.

Module and parameter names are the published checkpoint names
(``encoder.layer.N.attention.self.query``, ``encoder.layer.N.mlp.gated_layers``
...), so the walk loads real checkpoints strictly.  The hub code itself is never
run.  Attention is eager and written with plain tensor ops; the ALiBi biases are
computed from the runtime sequence length, so an exported graph serves any
length (no position embeddings, no baked tables).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.modeling_outputs import BaseModelOutputWithPooling, SequenceClassifierOutput

from nexus_sli.exporter.errors import UnsupportedModelError
from .base import config_value

#: ``feed_forward_type`` values of the published code: two gated forms and plain BERT.
GATED_ACTIVATIONS = {"geglu": F.gelu, "reglu": F.relu}
FEED_FORWARD_TYPES = (*GATED_ACTIVATIONS, "original")


@dataclass(frozen=True)
class JinaBertSettings:
    """The config facts the layers read, with the published ``JinaBertConfig`` defaults."""

    hidden_size: int
    num_heads: int
    intermediate_size: int
    num_layers: int
    vocab_size: int
    type_vocab_size: int
    layer_norm_eps: float
    feed_forward_type: str
    hidden_act: str
    num_labels: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_config(cls, config: Any) -> "JinaBertSettings":
        position = config_value(config, ("position_embedding_type",), "absolute")
        if position != "alibi":
            raise UnsupportedModelError(
                f"JinaBERT with position_embedding_type {position!r} is not supported: only 'alibi' "
                "(what every published jina-embeddings-v2 checkpoint uses)"
            )
        feed_forward = config_value(config, ("feed_forward_type",), "original")
        if feed_forward not in FEED_FORWARD_TYPES:
            raise UnsupportedModelError(
                f"JinaBERT feed_forward_type {feed_forward!r} is not supported; known: {', '.join(FEED_FORWARD_TYPES)}"
            )
        settings = cls(
            hidden_size=int(config_value(config, ("hidden_size",))),
            num_heads=int(config_value(config, ("num_attention_heads",))),
            intermediate_size=int(config_value(config, ("intermediate_size",))),
            num_layers=int(config_value(config, ("num_hidden_layers",))),
            vocab_size=int(config_value(config, ("vocab_size",))),
            type_vocab_size=int(config_value(config, ("type_vocab_size",), 2)),
            layer_norm_eps=float(config_value(config, ("layer_norm_eps",), 1e-12)),
            feed_forward_type=feed_forward,
            hidden_act=str(config_value(config, ("hidden_act",), "gelu")),
            num_labels=int(config_value(config, ("num_labels",), 2)),
        )
        if settings.hidden_size % settings.num_heads:
            raise UnsupportedModelError(
                f"JinaBERT hidden_size {settings.hidden_size} is not a multiple of "
                f"num_attention_heads {settings.num_heads}"
            )
        return settings


def alibi_slopes(num_heads: int) -> list[float]:
    """Per-head ALiBi slopes: the geometric series ``2^(-8/n * (h+1))`` for a power of
    two ``n``; otherwise the nearest lower power of two, topped up with every other
    slope of the next power (Press et al., as in the published ``_get_alibi_head_slopes``)."""

    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start ** (h + 1) for h in range(n)]

    if math.log2(num_heads).is_integer():
        return power_of_two(num_heads)
    lower = 2 ** math.floor(math.log2(num_heads))
    return power_of_two(lower) + alibi_slopes(2 * lower)[0::2][: num_heads - lower]


class JinaBertEmbeddings(nn.Module):
    """``LayerNorm(word[ids] + token_type[types])``; ALiBi models have no position embeddings."""

    def __init__(self, settings: JinaBertSettings):
        super().__init__()
        self.word_embeddings = nn.Embedding(settings.vocab_size, settings.hidden_size)
        self.token_type_embeddings = nn.Embedding(settings.type_vocab_size, settings.hidden_size)
        self.LayerNorm = nn.LayerNorm(settings.hidden_size, eps=settings.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids))


class JinaBertSelfAttention(nn.Module):
    def __init__(self, settings: JinaBertSettings):
        super().__init__()
        self.num_heads, self.head_dim = settings.num_heads, settings.head_dim
        self.query = nn.Linear(settings.hidden_size, settings.hidden_size)
        self.key = nn.Linear(settings.hidden_size, settings.hidden_size)
        self.value = nn.Linear(settings.hidden_size, settings.hidden_size)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)

    def forward(self, hidden_states: torch.Tensor, attention_bias: torch.Tensor) -> torch.Tensor:
        q, k, v = (self._heads(proj(hidden_states)) for proj in (self.query, self.key, self.value))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim) + attention_bias
        context = torch.matmul(scores.softmax(dim=-1), v)
        return context.transpose(1, 2).flatten(2)


class JinaBertSelfOutput(nn.Module):
    def __init__(self, settings: JinaBertSettings):
        super().__init__()
        self.dense = nn.Linear(settings.hidden_size, settings.hidden_size)
        self.LayerNorm = nn.LayerNorm(settings.hidden_size, eps=settings.layer_norm_eps)

    def forward(self, context: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(context) + residual)


class JinaBertAttention(nn.Module):
    def __init__(self, settings: JinaBertSettings):
        super().__init__()
        self.self = JinaBertSelfAttention(settings)
        self.output = JinaBertSelfOutput(settings)

    def forward(self, hidden_states: torch.Tensor, attention_bias: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(hidden_states, attention_bias), hidden_states)


class JinaBertGLUMLP(nn.Module):
    """``LayerNorm(x + wo(act(g) * u))`` with ``[g | u] = gated_layers(x)``: the *first*
    half of the gated projection goes through the activation (GELU for ``geglu``,
    ReLU for ``reglu``), the second half multiplies it."""

    def __init__(self, settings: JinaBertSettings):
        super().__init__()
        self.intermediate_size = settings.intermediate_size
        self.act = GATED_ACTIVATIONS[settings.feed_forward_type]
        self.gated_layers = nn.Linear(settings.hidden_size, 2 * settings.intermediate_size, bias=False)
        self.wo = nn.Linear(settings.intermediate_size, settings.hidden_size)
        self.layernorm = nn.LayerNorm(settings.hidden_size, eps=settings.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        gated, non_gated = self.gated_layers(hidden_states).split(self.intermediate_size, dim=-1)
        return self.layernorm(self.wo(self.act(gated) * non_gated) + hidden_states)


class JinaBertIntermediate(nn.Module):
    def __init__(self, settings: JinaBertSettings):
        super().__init__()
        self.dense = nn.Linear(settings.hidden_size, settings.intermediate_size)
        self.act = ACT2FN[settings.hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(hidden_states))


class JinaBertOutput(nn.Module):
    def __init__(self, settings: JinaBertSettings):
        super().__init__()
        self.dense = nn.Linear(settings.intermediate_size, settings.hidden_size)
        self.LayerNorm = nn.LayerNorm(settings.hidden_size, eps=settings.layer_norm_eps)

    def forward(self, intermediate: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(intermediate) + residual)


class JinaBertLayer(nn.Module):
    """One post-norm JinaBERT encoder layer (published ``JinaBertLayer``)::

        a   = LayerNorm(x + W_o · softmax(Q Kᵀ / √d + M + B) V)       per head
        out = LayerNorm(a + wo(act(g) * u)),  [g | u] = gated_layers(a)

    ``B[h, i, j] = -m_h · |i - j|`` is the symmetric ALiBi bias with head slopes
    ``m_h`` (:func:`alibi_slopes`), ``M`` the padding mask (both supplied by the
    encoder).  ``feed_forward_type: original`` replaces the gated feed-forward by
    BERT's ``LayerNorm(a + W_2 act(W_1 a))`` (``intermediate`` / ``output``).
    Source: jinaai/jina-bert-implementation ``modeling_bert.py``; arXiv:2310.19923.
    """

    def __init__(self, settings: JinaBertSettings):
        super().__init__()
        self.attention = JinaBertAttention(settings)
        self.gated = settings.feed_forward_type in GATED_ACTIVATIONS
        if self.gated:
            self.mlp = JinaBertGLUMLP(settings)
        else:
            self.intermediate = JinaBertIntermediate(settings)
            self.output = JinaBertOutput(settings)

    def forward(self, hidden_states: torch.Tensor, attention_bias: torch.Tensor) -> torch.Tensor:
        attended = self.attention(hidden_states, attention_bias)
        if self.gated:
            return self.mlp(attended)
        return self.output(self.intermediate(attended), attended)


class JinaBertEncoder(nn.Module):
    def __init__(self, settings: JinaBertSettings):
        super().__init__()
        self.layer = nn.ModuleList(JinaBertLayer(settings) for _ in range(settings.num_layers))
        # Recomputed, never in a checkpoint (the published ``alibi`` buffer is not persistent either).
        self.register_buffer("alibi_slopes", torch.tensor(alibi_slopes(settings.num_heads)), persistent=False)

    def attention_bias(self, attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """ALiBi plus padding bias, ``(batch, heads, seq, seq)``, for the runtime length."""
        positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
        distance = (positions[None, :] - positions[:, None]).abs().to(dtype)
        alibi = -self.alibi_slopes.to(dtype)[:, None, None] * distance
        padding = (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min
        return alibi[None] + padding

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        bias = self.attention_bias(attention_mask, hidden_states.dtype)
        for layer in self.layer:
            hidden_states = layer(hidden_states, bias)
        return hidden_states


class JinaBertPooler(nn.Module):
    """``tanh(dense(h[:, 0]))``; feeds the classification head (embeddings are mean-pooled outside)."""

    def __init__(self, settings: JinaBertSettings):
        super().__init__()
        self.dense = nn.Linear(settings.hidden_size, settings.hidden_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(hidden_states[:, 0]))


class JinaBertModel(nn.Module):
    """The base model: ``embeddings``, ``encoder.layer.N``, ``pooler`` (published ``JinaBertModel``)."""

    base_model_prefix = "bert"

    def __init__(self, settings: JinaBertSettings):
        super().__init__()
        self.settings = settings
        self.embeddings = JinaBertEmbeddings(settings)
        self.encoder = JinaBertEncoder(settings)
        self.pooler = JinaBertPooler(settings)

    @property
    def base_model(self) -> nn.Module:
        return self

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, return_dict: bool = True):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        hidden = self.encoder(self.embeddings(input_ids, token_type_ids), attention_mask)
        pooled = self.pooler(hidden)
        if not return_dict:
            return hidden, pooled
        return BaseModelOutputWithPooling(last_hidden_state=hidden, pooler_output=pooled)


class JinaBertForSequenceClassification(nn.Module):
    """``classifier(pooler_output)`` over ``bert.`` (published ``JinaBertForSequenceClassification``)."""

    base_model_prefix = "bert"

    def __init__(self, settings: JinaBertSettings):
        super().__init__()
        self.bert = JinaBertModel(settings)
        self.classifier = nn.Linear(settings.hidden_size, settings.num_labels)

    @property
    def base_model(self) -> nn.Module:
        return self.bert

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, return_dict: bool = True):
        pooled = self.bert(input_ids, attention_mask, token_type_ids).pooler_output
        logits = self.classifier(pooled)
        return SequenceClassifierOutput(logits=logits) if return_dict else (logits,)
