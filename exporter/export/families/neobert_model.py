"""NeoBERT, written by the project from its published definition.

Sources read: chandar-lab/NeoBERT ``model.py`` / ``rotary.py`` as published with
the hub checkpoint (``NeoBERT``, ``EncoderBlock``, ``NeoBERTLMHead``,
``NeoBERTForSequenceClassification``, ``precompute_freqs_cis`` /
``apply_rotary_emb``), read through the pszemraj/NeoBERT repository
(``src/neobert/huggingface/modeling_neobert.py``, ``rotary.py``), which keeps
the published weight names and math.  Paper: Le Breton et al., *NeoBERT: A
Next-Generation BERT* (arXiv:2502.19587).

Module and parameter names are the published checkpoint names (``encoder``,
``transformer_encoder.N.qkv``, ``.wo``, ``.ffn.w12``, ``.ffn.w3``,
``.attention_norm``, ``.ffn_norm``, ``layer_norm``).  The hub code is never
run.  The published rotary tables are complex numbers precomputed up to
``max_length``; here they are real cos/sin tables computed from the runtime
sequence length, which ONNX exports and which serve any length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutput, SequenceClassifierOutput

from nexus_sli.exporter.errors import UnsupportedModelError
from .base import config_value

#: Default of the published ``NeoBERTConfig``.
DEFAULT_NORM_EPS = 1e-6
#: The published ``precompute_freqs_cis`` default; NeoBERT configs carry no theta.
ROPE_THETA = 10000.0
#: The published feed-forward rounds ``2/3 * intermediate_size`` up to a multiple of 8.
FFN_MULTIPLE_OF = 8


@dataclass(frozen=True)
class NeoBertSettings:
    """The config facts the layers read, with the published ``NeoBERTConfig`` defaults."""

    hidden_size: int
    num_heads: int
    intermediate_size: int
    num_layers: int
    vocab_size: int
    norm_eps: float
    num_labels: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def ffn_size(self) -> int:
        """SwiGLU width: ``int(2 * intermediate_size / 3)`` rounded up to a multiple of 8."""
        reduced = int(2 * self.intermediate_size / 3)
        return FFN_MULTIPLE_OF * ((reduced + FFN_MULTIPLE_OF - 1) // FFN_MULTIPLE_OF)

    @classmethod
    def from_config(cls, config: Any) -> "NeoBertSettings":
        # Later NeoBERT code grew switches the published checkpoints never set; refuse
        # the variants whose weights or math differ instead of mis-loading them.
        for key, published in (("rope", True), ("rms_norm", True), ("swiglu_packed", True), ("hidden_act", "swiglu")):
            value = config_value(config, (key,), published)
            if value != published:
                raise UnsupportedModelError(f"NeoBERT with {key}={value!r} is not supported (published: {published!r})")
        settings = cls(
            hidden_size=int(config_value(config, ("hidden_size",), 768)),
            num_heads=int(config_value(config, ("num_attention_heads",), 12)),
            intermediate_size=int(config_value(config, ("intermediate_size",), 3072)),
            num_layers=int(config_value(config, ("num_hidden_layers",), 28)),
            vocab_size=int(config_value(config, ("vocab_size",), 30522)),
            norm_eps=float(config_value(config, ("norm_eps",), DEFAULT_NORM_EPS)),
            num_labels=int(config_value(config, ("num_labels",), 2)),
        )
        if settings.hidden_size % settings.num_heads or settings.head_dim % 2:
            raise UnsupportedModelError(
                f"NeoBERT hidden_size {settings.hidden_size} must split into num_attention_heads "
                f"{settings.num_heads} heads of even size (rotary pairs)"
            )
        return settings


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x²) + eps) * weight`` (``torch.nn.RMSNorm``, written out so it exports at opset 17)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.weight


class SwiGLU(nn.Module):
    """``w3(silu(a) * b)`` with ``[a | b] = w12(x)`` (xformers' packed ``SwiGLU``, no biases)."""

    def __init__(self, settings: NeoBertSettings):
        super().__init__()
        self.w12 = nn.Linear(settings.hidden_size, 2 * settings.ffn_size, bias=False)
        self.w3 = nn.Linear(settings.ffn_size, settings.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w12(x).chunk(2, dim=-1)
        return self.w3(nn.functional.silu(gate) * up)


def rotary_tables(inv_freq: torch.Tensor, seq_len: torch.Tensor | int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``position * inv_freq``, shaped ``(1, seq, 1, head_dim / 2)``."""
    positions = torch.arange(seq_len, device=inv_freq.device).to(inv_freq.dtype)
    angles = positions[:, None] * inv_freq[None, :]
    return angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs ``(x[2i], x[2i+1])`` of ``x`` (batch, seq, heads, head_dim) by
    the position's angle: the published complex product ``x · e^{iθ}`` in real arithmetic."""
    pairs = x.unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class NeoBertEncoderBlock(nn.Module):
    """One pre-norm NeoBERT block (published ``EncoderBlock``)::

        [q_h | k_h | v_h] = qkv(RMSNorm(x)) per head h       (per-head interleaved rows)
        x = x + wo(softmax(R(q) R(k)ᵀ / √d + M) v)           R: rotary on adjacent pairs
        x = x + w3(silu(a) * b),  [a | b] = w12(RMSNorm(x))  (SwiGLU)

    ``M`` masks padded keys; no biases anywhere.  Source: chandar-lab/NeoBERT
    ``model.py`` (``EncoderBlock._att_block``), RoPE per Su et al. (arXiv:2104.09864).
    """

    def __init__(self, settings: NeoBertSettings):
        super().__init__()
        self.num_heads, self.head_dim = settings.num_heads, settings.head_dim
        self.qkv = nn.Linear(settings.hidden_size, 3 * settings.hidden_size, bias=False)
        self.wo = nn.Linear(settings.hidden_size, settings.hidden_size, bias=False)
        self.ffn = SwiGLU(settings)
        self.attention_norm = RMSNorm(settings.hidden_size, settings.norm_eps)
        self.ffn_norm = RMSNorm(settings.hidden_size, settings.norm_eps)

    def _attention(self, x: torch.Tensor, attention_bias: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
        # The published view is (batch, seq, heads, 3 * head_dim) then chunk: q, k and v
        # rows interleave per head, they are not three stacked blocks.
        q, k, v = self.qkv(x).unflatten(-1, (self.num_heads, 3 * self.head_dim)).chunk(3, dim=-1)
        q, k = apply_rotary(q, cos, sin).transpose(1, 2), apply_rotary(k, cos, sin).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim) + attention_bias
        context = torch.matmul(scores.softmax(dim=-1), v.transpose(1, 2))
        return self.wo(context.transpose(1, 2).flatten(2))

    def forward(self, x: torch.Tensor, attention_bias: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        x = x + self._attention(self.attention_norm(x), attention_bias, cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class NeoBertModel(nn.Module):
    """The base model: ``encoder`` (token embeddings), ``transformer_encoder.N``, ``layer_norm``."""

    base_model_prefix = "model"

    def __init__(self, settings: NeoBertSettings):
        super().__init__()
        self.settings = settings
        self.encoder = nn.Embedding(settings.vocab_size, settings.hidden_size)
        self.transformer_encoder = nn.ModuleList(NeoBertEncoderBlock(settings) for _ in range(settings.num_layers))
        self.layer_norm = RMSNorm(settings.hidden_size, settings.norm_eps)
        dim = settings.head_dim
        inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @property
    def base_model(self) -> nn.Module:
        return self

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, return_dict: bool = True):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        x = self.encoder(input_ids)
        cos, sin = rotary_tables(self.inv_freq, input_ids.shape[1])
        bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        for block in self.transformer_encoder:
            x = block(x, bias, cos, sin)
        x = self.layer_norm(x)
        return BaseModelOutput(last_hidden_state=x) if return_dict else (x,)


class NeoBertForSequenceClassification(nn.Module):
    """``classifier(tanh(dense(h[:, 0])))`` over ``model.`` (published ``NeoBERTForSequenceClassification``)."""

    base_model_prefix = "model"

    def __init__(self, settings: NeoBertSettings):
        super().__init__()
        self.model = NeoBertModel(settings)
        self.dense = nn.Linear(settings.hidden_size, settings.hidden_size)
        self.classifier = nn.Linear(settings.hidden_size, settings.num_labels)

    @property
    def base_model(self) -> nn.Module:
        return self.model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, return_dict: bool = True):
        hidden = self.model(input_ids, attention_mask).last_hidden_state
        logits = self.classifier(torch.tanh(self.dense(hidden[:, 0])))
        return SequenceClassifierOutput(logits=logits) if return_dict else (logits,)
