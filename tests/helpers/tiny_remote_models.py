"""Seeded tiny checkpoints of the families transformers lacks (JinaBERT v2, NeoBERT, GTE v1.5 / mGTE).

The tensors are written from name/shape tables taken from the published code
(jinaai/jina-bert-implementation ``modeling_bert.py``, chandar-lab/NeoBERT
``model.py``, Alibaba-NLP/new-impl ``modeling.py``), not from the project's
modules, so a wrong module or parameter name in the project's code fails the
strict walk instead of agreeing with itself.  Configs look like the hub's
(``config.json`` keys of jina-embeddings-v2-small-en, chandar-lab/NeoBERT and
new-impl's ``NewConfig``), shrunk to hidden 32, 2 layers, 4 heads and the 400-token test vocabulary.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from .tiny_models import VOCAB

#: Families covered here (the coverage test counts them).
REMOTE_TINY = ("jinabert", "neobert", "gte")
TASKS = ("embedding", "classification")
NUM_LABELS = 3
#: Position limit of the tiny configs; longer than the ONNX export example (16 tokens).
MAX_LENGTH = 128

_JINA_AUTO_MAP = {
    "AutoConfig": "jinaai/jina-bert-implementation--configuration_bert.JinaBertConfig",
    "AutoModel": "jinaai/jina-bert-implementation--modeling_bert.JinaBertModel",
    "AutoModelForMaskedLM": "jinaai/jina-bert-implementation--modeling_bert.JinaBertForMaskedLM",
    "AutoModelForSequenceClassification":
        "jinaai/jina-bert-implementation--modeling_bert.JinaBertForSequenceClassification",
}
_NEOBERT_AUTO_MAP = {
    "AutoConfig": "model.NeoBERTConfig",
    "AutoModel": "model.NeoBERT",
    "AutoModelForMaskedLM": "model.NeoBERTLMHead",
    "AutoModelForSequenceClassification": "model.NeoBERTForSequenceClassification",
}

_GTE_AUTO_MAP = {
    "AutoConfig": "Alibaba-NLP/new-impl--configuration.NewConfig",
    "AutoModel": "Alibaba-NLP/new-impl--modeling.NewModel",
    "AutoModelForMaskedLM": "Alibaba-NLP/new-impl--modeling.NewForMaskedLM",
    "AutoModelForSequenceClassification": "Alibaba-NLP/new-impl--modeling.NewForSequenceClassification",
}


def tiny_config(model_type: str, task: str = "embedding", **overrides) -> dict:
    """A hub-shaped config.json for ``model_type`` serving ``task``."""
    if model_type == "jinabert":
        config = {
            "_name_or_path": "jinaai/jina-bert-implementation",
            "architectures": ["JinaBertForMaskedLM"], "auto_map": _JINA_AUTO_MAP,
            "attention_probs_dropout_prob": 0.0, "classifier_dropout": None, "emb_pooler": "mean",
            "feed_forward_type": "geglu", "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "hidden_size": 32,
            "initializer_range": 0.02, "intermediate_size": 64, "layer_norm_eps": 1e-12,
            "max_position_embeddings": MAX_LENGTH, "model_max_length": MAX_LENGTH, "model_type": "bert",
            "num_attention_heads": 4, "num_hidden_layers": 2, "pad_token_id": 0,
            "position_embedding_type": "alibi", "torch_dtype": "float32", "transformers_version": "4.26.0",
            "type_vocab_size": 2, "use_cache": True, "vocab_size": VOCAB,
        }
        classifier = "JinaBertForSequenceClassification"
    elif model_type == "neobert":
        config = {
            "architectures": ["NeoBERTLMHead"], "auto_map": _NEOBERT_AUTO_MAP,
            "classifier_init_range": 0.02, "decoder_init_range": 0.02, "dim_head": 8,
            "embedding_init_range": 0.02, "hidden_size": 32, "intermediate_size": 64, "max_length": MAX_LENGTH,
            "model_type": "neobert", "norm_eps": 1e-05, "num_attention_heads": 4, "num_hidden_layers": 2,
            "pad_token_id": 0, "torch_dtype": "float32", "transformers_version": "4.48.2", "vocab_size": VOCAB,
        }
        classifier = "NeoBERTForSequenceClassification"
    elif model_type == "gte":
        # the test's own values: fixed NTK scaling, no segment embeddings
        config = {
            "architectures": ["NewModel"], "auto_map": _GTE_AUTO_MAP, "attention_probs_dropout_prob": 0.0,
            "classifier_dropout": None, "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "hidden_size": 32,
            "initializer_range": 0.02, "intermediate_size": 64, "layer_norm_eps": 1e-12,
            "layer_norm_type": "layer_norm", "logn_attention_clip1": False, "logn_attention_scale": False,
            "max_position_embeddings": MAX_LENGTH, "model_type": "new", "num_attention_heads": 4,
            "num_hidden_layers": 2, "pack_qkv": True, "pad_token_id": 0, "position_embedding_type": "rope",
            "rope_scaling": {"factor": 2.0, "type": "ntk"}, "rope_theta": 500000, "torch_dtype": "float32",
            "transformers_version": "4.39.1", "type_vocab_size": 0, "unpad_inputs": False,
            "use_memory_efficient_attention": False, "vocab_size": VOCAB,
        }
        classifier = "NewForSequenceClassification"
        if task == "classification":  # the other layout: one segment embedding, another NTK base and factor
            config.update(type_vocab_size=1, rope_theta=160000, rope_scaling={"factor": 8.0, "type": "ntk"})
    else:
        raise ValueError(f"no tiny remote-code model for {model_type!r}")
    if task == "classification":
        labels = {str(i): f"LABEL_{i}" for i in range(NUM_LABELS)}
        config.update(architectures=[classifier], id2label=labels, label2id={v: int(k) for k, v in labels.items()})
    return {**config, **overrides}


def _jina_shapes(c: dict, task: str) -> dict[str, tuple[int, ...]]:
    h, i = c["hidden_size"], c["intermediate_size"]
    shapes = {
        "embeddings.word_embeddings.weight": (c["vocab_size"], h),
        "embeddings.token_type_embeddings.weight": (c["type_vocab_size"], h),
        "embeddings.LayerNorm.weight": (h,), "embeddings.LayerNorm.bias": (h,),
        "pooler.dense.weight": (h, h), "pooler.dense.bias": (h,),
    }
    for n in range(c["num_hidden_layers"]):
        p = f"encoder.layer.{n}."
        for proj in ("query", "key", "value"):
            shapes.update({f"{p}attention.self.{proj}.weight": (h, h), f"{p}attention.self.{proj}.bias": (h,)})
        shapes.update({
            f"{p}attention.output.dense.weight": (h, h), f"{p}attention.output.dense.bias": (h,),
            f"{p}attention.output.LayerNorm.weight": (h,), f"{p}attention.output.LayerNorm.bias": (h,),
        })
        if c["feed_forward_type"].endswith("glu"):
            shapes.update({
                f"{p}mlp.gated_layers.weight": (2 * i, h), f"{p}mlp.wo.weight": (h, i), f"{p}mlp.wo.bias": (h,),
                f"{p}mlp.layernorm.weight": (h,), f"{p}mlp.layernorm.bias": (h,),
            })
        else:  # feed_forward_type "original": BERT's intermediate/output
            shapes.update({
                f"{p}intermediate.dense.weight": (i, h), f"{p}intermediate.dense.bias": (i,),
                f"{p}output.dense.weight": (h, i), f"{p}output.dense.bias": (h,),
                f"{p}output.LayerNorm.weight": (h,), f"{p}output.LayerNorm.bias": (h,),
            })
    if task == "classification":
        shapes = {"bert." + k: v for k, v in shapes.items()}
        shapes.update({"classifier.weight": (NUM_LABELS, h), "classifier.bias": (NUM_LABELS,)})
    return shapes


def neobert_ffn_size(intermediate_size: int) -> int:
    """The published EncoderBlock's SwiGLU width: 2/3 of intermediate_size, rounded up to 8."""
    return 8 * math.ceil(int(2 * intermediate_size / 3) / 8)


def _neobert_shapes(c: dict, task: str) -> dict[str, tuple[int, ...]]:
    h, f = c["hidden_size"], neobert_ffn_size(c["intermediate_size"])
    shapes = {"encoder.weight": (c["vocab_size"], h), "layer_norm.weight": (h,)}
    for n in range(c["num_hidden_layers"]):
        p = f"transformer_encoder.{n}."
        shapes.update({
            f"{p}qkv.weight": (3 * h, h), f"{p}wo.weight": (h, h),
            f"{p}ffn.w12.weight": (2 * f, h), f"{p}ffn.w3.weight": (h, f),
            f"{p}attention_norm.weight": (h,), f"{p}ffn_norm.weight": (h,),
        })
    shapes = {"model." + k: v for k, v in shapes.items()}
    if task == "classification":
        shapes.update({"dense.weight": (h, h), "dense.bias": (h,),
                       "classifier.weight": (NUM_LABELS, h), "classifier.bias": (NUM_LABELS,)})
    else:  # saved as NeoBERTLMHead, like chandar-lab/NeoBERT: the MLM decoder rides along
        shapes.update({"decoder.weight": (c["vocab_size"], h), "decoder.bias": (c["vocab_size"],)})
    return shapes


def _gte_shapes(c: dict, task: str) -> dict[str, tuple[int, ...]]:
    h, i = c["hidden_size"], c["intermediate_size"]
    shapes = {"embeddings.word_embeddings.weight": (c["vocab_size"], h),
              "embeddings.LayerNorm.weight": (h,), "embeddings.LayerNorm.bias": (h,)}
    if c["type_vocab_size"] > 0:
        shapes["embeddings.token_type_embeddings.weight"] = (c["type_vocab_size"], h)
    for n in range(c["num_hidden_layers"]):
        p = f"encoder.layer.{n}."
        shapes.update({
            f"{p}attention.qkv_proj.weight": (3 * h, h), f"{p}attention.qkv_proj.bias": (3 * h,),
            f"{p}attention.o_proj.weight": (h, h), f"{p}attention.o_proj.bias": (h,),
            f"{p}mlp.up_gate_proj.weight": (2 * i, h),
            f"{p}mlp.down_proj.weight": (h, i), f"{p}mlp.down_proj.bias": (h,),
            f"{p}attn_ln.weight": (h,), f"{p}attn_ln.bias": (h,), f"{p}mlp_ln.weight": (h,), f"{p}mlp_ln.bias": (h,),
        })
    if task == "classification":  # NewModel(add_pooling_layer=True) under ``new.``
        labels = len(c["id2label"])  # one for a reranker
        shapes = {"new." + k: v for k, v in shapes.items()}
        shapes.update({"new.pooler.dense.weight": (h, h), "new.pooler.dense.bias": (h,),
                       "classifier.weight": (labels, h), "classifier.bias": (labels,)})
    return shapes


def checkpoint_shapes(model_type: str, task: str, config: dict) -> dict[str, tuple[int, ...]]:
    """Published tensor names and shapes of a ``task`` checkpoint for ``config``."""
    return {"jinabert": _jina_shapes, "neobert": _neobert_shapes, "gte": _gte_shapes}[model_type](config, task)


def _random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    noise = torch.randn(shape, generator=generator)
    if len(shape) == 1 and name.endswith("bias"):
        return 0.05 * noise
    if len(shape) == 1:  # LayerNorm / RMSNorm gains
        return 1.0 + 0.1 * noise
    if "embedding" in name or name.endswith("encoder.weight"):
        return noise
    return noise / math.sqrt(shape[1])  # unit-gain projections keep activations O(1)


def build_tiny_remote(model_type: str, directory: Path, tokenizer: Tokenizer, task: str = "embedding",
                      seed: int = 0, **overrides) -> Path:
    """Save a seeded ``model_type`` checkpoint for ``task`` (config.json, model.safetensors,
    tokenizer.json, and a tokenizer_config.json naming the trained length, as hub repos do)."""
    config = tiny_config(model_type, task, **overrides)
    generator = torch.Generator().manual_seed(seed)
    tensors = {name: _random_tensor(name, shape, generator).contiguous()
               for name, shape in sorted(checkpoint_shapes(model_type, task, config).items())}
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"model_max_length": MAX_LENGTH}) + "\n")
    return directory
