"""GTE v1.5 and mGTE (the hub's ``model_type: new``), written by the project from its published definition.

Sources read: Alibaba-NLP/new-impl ``modeling.py`` / ``configuration.py``, the
remote code the GTE v1.5 and mGTE checkpoints name in their ``auto_map`` (``NewEmbeddings``, ``RotaryEmbedding``,
``NTKScalingRotaryEmbedding``, ``NewAttention``, ``NewGatedMLP``, ``NewLayer``,
``NewModel``, ``NewPooler``, ``NewForSequenceClassification``), read through a
copy kept with the published names and math (xuhaike/SparseCL
``sparsecl/gte/modeling.py``).  Paper: Zhang et al., *mGTE: Generalized
Long-Context Text Representation and Reranking Models* (arXiv:2407.19669).

Module and parameter names are the published checkpoint names
(``embeddings.{word_embeddings,token_type_embeddings,LayerNorm}``,
``encoder.layer.N.attention.{qkv_proj,o_proj}``,
``encoder.layer.N.mlp.{up_gate_proj,down_proj}``, ``.attn_ln``, ``.mlp_ln``,
``pooler.dense``; the task models put the base model under ``new.``).  The hub
code is never run.  Its rotary tables are precomputed up to the scaled
position limit; here they are computed from the runtime sequence length, the
same products of the same frequencies, which ONNX exports and which serve any
length.  Only the published layout is built: the switches the published
checkpoints never set (absolute positions, RMSNorm, unpacked q/k/v, the log-n
attention scale) are refused by name rather than mis-loaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.modeling_outputs import BaseModelOutput, SequenceClassifierOutput

from nexus_sli.exporter.errors import UnsupportedModelError
from .base import config_value

#: The published layout's switches, with the value every published checkpoint has.
PUBLISHED = {"position_embedding_type": "rope", "layer_norm_type": "layer_norm", "pack_qkv": True,
             "logn_attention_scale": False}


@dataclass(frozen=True)
class GteSettings:
    """The config facts the layers read, with the published ``NewConfig`` defaults."""

    hidden_size: int
    num_heads: int
    intermediate_size: int
    num_layers: int
    vocab_size: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    rope_theta: float
    #: ``rope_scaling``'s NTK factor (1: none) and its ``mixed_b`` (None: the fixed NTK form)
    ntk_factor: float
    mixed_b: float | None
    num_labels: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_config(cls, config: Any) -> "GteSettings":
        for key, published in PUBLISHED.items():
            value = config_value(config, (key,), published)
            if value != published:
                raise UnsupportedModelError(f"GTE (model_type new) with {key}={value!r} is not supported "
                                            f"(published checkpoints: {published!r})")
        theta, scaling = _rope(config)
        settings = cls(
            hidden_size=int(config_value(config, ("hidden_size",), 768)),
            num_heads=int(config_value(config, ("num_attention_heads",), 12)),
            intermediate_size=int(config_value(config, ("intermediate_size",), 3072)),
            num_layers=int(config_value(config, ("num_hidden_layers",), 12)),
            vocab_size=int(config_value(config, ("vocab_size",), 30528)),
            type_vocab_size=int(config_value(config, ("type_vocab_size",), 1)),
            layer_norm_eps=float(config_value(config, ("layer_norm_eps",), 1e-12)),
            hidden_act=str(config_value(config, ("hidden_act",), "gelu")),
            rope_theta=theta,
            ntk_factor=float(scaling.get("factor", 1.0)),
            mixed_b=scaling.get("mixed_b"),
            num_labels=int(config_value(config, ("num_labels",), 2)),
        )
        if settings.hidden_size % settings.num_heads or settings.head_dim % 2:
            raise UnsupportedModelError(f"GTE hidden_size {settings.hidden_size} must split into "
                                        f"num_attention_heads {settings.num_heads} heads of even size (rotary halves)")
        return settings

    def inv_freq(self) -> torch.Tensor:
        """The rotary frequencies, as ``NTKScalingRotaryEmbedding`` leaves them for a factor above 1: the base
        times the factor and each frequency divided by ``factor^(2/dim)`` (fixed NTK), or each divided by
        ``exp(a k^b)`` with ``a = ln(factor) / (dim/2)^b`` (mixed NTK, ``mixed_b`` = b)."""
        dim = self.head_dim
        exponents = torch.arange(0, dim, 2).float() / dim
        if self.ntk_factor <= 1:
            return 1.0 / (self.rope_theta ** exponents)
        if self.mixed_b is None:
            return 1.0 / ((self.rope_theta * self.ntk_factor) ** exponents) / self.ntk_factor ** (2 / dim)
        a = torch.tensor(self.ntk_factor).log() / (dim / 2) ** self.mixed_b
        return 1.0 / (self.rope_theta ** exponents) / (a * torch.arange(1, dim // 2 + 1).float() ** self.mixed_b).exp()


def _rope(config: Any) -> tuple[float, dict]:
    """(rotary base, NTK scaling or ``{}``).  new-impl configs keep ``rope_theta`` and ``rope_scaling`` apart;
    transformers 5 keeps both in ``rope_parameters``, and its own ``model_type: gte`` config (which saves the
    published weight names) has ``rope_type: default`` for no scaling and no ``rope_theta`` key beside it."""
    parameters = dict(config_value(config, ("rope_parameters", "rope_scaling")) or {})
    theta = parameters.pop("rope_theta", None) or config_value(config, ("rope_theta",), 10000.0)
    kind = parameters.get("type", parameters.get("rope_type"))
    if kind in (None, "default"):
        return float(theta), {}
    if kind != "ntk":
        raise UnsupportedModelError(f"GTE rope_scaling type {kind!r} is not supported (published: 'ntk')")
    return float(theta), parameters


def rotary_tables(inv_freq: torch.Tensor, seq_len: torch.Tensor | int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``position * inv_freq``, each frequency twice (``cat(freqs, freqs)``), shaped
    ``(1, seq, 1, head_dim)``."""
    positions = torch.arange(seq_len, device=inv_freq.device).to(inv_freq.dtype)
    angles = positions[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x cos + rotate_half(x) sin`` on (batch, seq, heads, head_dim): the halves, not adjacent pairs, rotate."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class GteAttention(nn.Module):
    """``o_proj(softmax(R(q) R(k)ᵀ / √d + M) v)`` with ``[q | k | v] = qkv_proj(x)`` (three stacked blocks)."""

    def __init__(self, settings: GteSettings):
        super().__init__()
        self.num_heads, self.head_dim = settings.num_heads, settings.head_dim
        self.qkv_proj = nn.Linear(settings.hidden_size, 3 * settings.hidden_size)
        self.o_proj = nn.Linear(settings.hidden_size, settings.hidden_size)

    def forward(self, x: torch.Tensor, attention_bias: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (self.num_heads, self.head_dim)) for t in self.qkv_proj(x).chunk(3, dim=-1))
        q, k = apply_rotary(q, cos, sin).transpose(1, 2), apply_rotary(k, cos, sin).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim) + attention_bias
        context = torch.matmul(scores.softmax(dim=-1), v.transpose(1, 2))
        return self.o_proj(context.transpose(1, 2).flatten(2))


class GteGatedMLP(nn.Module):
    """``down_proj(act(gate) * up)`` with ``[up | gate] = up_gate_proj(x)`` (no bias on ``up_gate_proj``)."""

    def __init__(self, settings: GteSettings):
        super().__init__()
        self.up_gate_proj = nn.Linear(settings.hidden_size, 2 * settings.intermediate_size, bias=False)
        self.down_proj = nn.Linear(settings.intermediate_size, settings.hidden_size)
        self.act = ACT2FN[settings.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, gate = self.up_gate_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class GteLayer(nn.Module):
    """One post-norm layer (published ``NewLayer``)::

        x = attn_ln(x + attention(x))
        x = mlp_ln(x + mlp(x))
    """

    def __init__(self, settings: GteSettings):
        super().__init__()
        self.attention = GteAttention(settings)
        self.mlp = GteGatedMLP(settings)
        self.attn_ln = nn.LayerNorm(settings.hidden_size, eps=settings.layer_norm_eps)
        self.mlp_ln = nn.LayerNorm(settings.hidden_size, eps=settings.layer_norm_eps)

    def forward(self, x: torch.Tensor, attention_bias: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        x = self.attn_ln(x + self.attention(x, attention_bias, cos, sin))
        return self.mlp_ln(x + self.mlp(x))


class GteEmbeddings(nn.Module):
    """Word embeddings, plus segment embeddings where ``type_vocab_size`` > 0, then LayerNorm (no positions:
    they are rotary, in the attention)."""

    def __init__(self, settings: GteSettings):
        super().__init__()
        self.word_embeddings = nn.Embedding(settings.vocab_size, settings.hidden_size)
        if settings.type_vocab_size > 0:
            self.token_type_embeddings = nn.Embedding(settings.type_vocab_size, settings.hidden_size)
        self.LayerNorm = nn.LayerNorm(settings.hidden_size, eps=settings.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        x = self.word_embeddings(input_ids)
        if hasattr(self, "token_type_embeddings"):
            x = x + self.token_type_embeddings(torch.zeros_like(input_ids) if token_type_ids is None
                                               else token_type_ids)
        return self.LayerNorm(x)


class GteEncoder(nn.Module):
    def __init__(self, settings: GteSettings):
        super().__init__()
        self.layer = nn.ModuleList(GteLayer(settings) for _ in range(settings.num_layers))


class GteModel(nn.Module):
    """The base model (published ``NewModel``): ``embeddings``, ``encoder.layer.N``, and with
    ``pooling`` the ``pooler`` the classification model reads."""

    base_model_prefix = "new"

    def __init__(self, settings: GteSettings, pooling: bool = False):
        super().__init__()
        self.settings = settings
        self.embeddings = GteEmbeddings(settings)
        self.encoder = GteEncoder(settings)
        if pooling:
            self.pooler = nn.Module()
            self.pooler.dense = nn.Linear(settings.hidden_size, settings.hidden_size)
        self.register_buffer("inv_freq", settings.inv_freq(), persistent=False)

    @property
    def base_model(self) -> nn.Module:
        return self

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, return_dict: bool = True):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        x = self.embeddings(input_ids, token_type_ids)
        cos, sin = rotary_tables(self.inv_freq, input_ids.shape[1])
        bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        for layer in self.encoder.layer:
            x = layer(x, bias, cos, sin)
        return BaseModelOutput(last_hidden_state=x) if return_dict else (x,)


class GteForSequenceClassification(nn.Module):
    """``classifier(tanh(pooler.dense(h[:, 0])))`` over ``new.`` (published ``NewForSequenceClassification``;
    with one label, a reranker's)."""

    base_model_prefix = "new"

    def __init__(self, settings: GteSettings):
        super().__init__()
        self.new = GteModel(settings, pooling=True)
        self.classifier = nn.Linear(settings.hidden_size, settings.num_labels)

    @property
    def base_model(self) -> nn.Module:
        return self.new

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, return_dict: bool = True):
        hidden = self.new(input_ids, attention_mask, token_type_ids).last_hidden_state
        logits = self.classifier(torch.tanh(self.new.pooler.dense(hidden[:, 0])))
        return SequenceClassifierOutput(logits=logits) if return_dict else (logits,)
