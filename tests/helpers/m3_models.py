"""A seeded tiny BGE-M3: the tiny xlm-roberta with BGE-M3's two heads, laid out as FlagEmbedding loads it.

The folder has what BAAI/bge-m3 ships: ``config.json`` and ``model.safetensors``
(the tiny xlm-roberta of :mod:`tiny_models`), a ``tokenizer.json`` with
XLM-RoBERTa's special tokens (``<s>`` 0, ``<pad>`` 1, ``</s>`` 2, ``<unk>`` 3;
a text reads ``<s> text </s>``), ``tokenizer_config.json`` and
``special_tokens_map.json`` naming them (FlagEmbedding drops the cls, eos, pad
and unk ids from the lexical weights by those names), and the heads as
``torch.save`` state dicts: ``sparse_linear.pt`` (``Linear(hidden, 1)``) and
``colbert_linear.pt`` (``Linear(hidden, COLBERT_DIM)``).

FlagEmbedding does not install beside the product, so its outputs on this
folder are kept in ``tests/data/bge_m3/flag_reference.json``, written by
``tests/references/flag_m3.py`` in a venv of its own (``make test-real`` runs it
again).  :func:`weights_fingerprint` ties that file to the weights it was
computed on; that script imports this module in its venv, so nothing here
imports the product at module level.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, processors

from .tiny_models import COMMON, build_tiny

#: XLM-RoBERTa's special tokens, in id order from 0 (``<mask>`` takes the fifth special id here)
SPECIALS = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")
#: the ColBERT head's output size: not the hidden size, so a reader that assumes it fails
COLBERT_DIM = 16
#: the names transformers and FlagEmbedding read the special tokens by
SPECIAL_NAMES = {"bos_token": "<s>", "cls_token": "<s>", "eos_token": "</s>", "sep_token": "</s>",
                 "pad_token": "<pad>", "unk_token": "<unk>", "mask_token": "<mask>"}
#: the tiny xlm-roberta's positions past its padding offset
MAX_LENGTH = 128


def xlmr_tokenizer(tiny: Tokenizer) -> Tokenizer:
    """``tiny`` (the kept WordPiece tokenizer, whose first ids are its five special tokens) with XLM-RoBERTa's
    special tokens in their places and XLM-RoBERTa's template, ``<s> $A </s>`` (``</s> </s>`` between pairs)."""
    renamed = {SPECIALS[i] if i < len(SPECIALS) else token: i for token, i in tiny.get_vocab().items()}
    tokenizer = Tokenizer(models.WordPiece(renamed, unk_token="<unk>"))
    tokenizer.normalizer, tokenizer.pre_tokenizer, tokenizer.decoder = tiny.normalizer, tiny.pre_tokenizer, tiny.decoder
    tokenizer.add_special_tokens(list(SPECIALS))
    bos, eos = SPECIALS.index("<s>"), SPECIALS.index("</s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", bos), ("</s>", eos)])
    return tokenizer


def build_m3(directory: Path, tiny: Tokenizer, seed: int = 0) -> Path:
    """Write the seeded tiny BGE-M3 into ``directory`` (``tiny``: the kept tiny tokenizer)."""
    from nexus_sli.exporter.export.m3_heads import COLBERT_HEAD, SPARSE_HEAD

    build_tiny("xlm-roberta", directory, xlmr_tokenizer(tiny), seed)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": MAX_LENGTH, **SPECIAL_NAMES}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "special_tokens_map.json").write_text(json.dumps(SPECIAL_NAMES, indent=2) + "\n")
    torch.manual_seed(seed + 1)  # the heads' own draw, whatever the encoder's initialisation consumed
    hidden = COMMON["hidden_size"]
    for name, size in ((SPARSE_HEAD, 1), (COLBERT_HEAD, COLBERT_DIM)):
        torch.save(torch.nn.Linear(hidden, size).state_dict(), directory / name)
    return directory


def weights_fingerprint(directory: Path) -> str:
    """sha256 over every tensor of the checkpoint and its ``.pt`` heads (file, name, dtype, shape and bytes,
    in name order): equal in any venv for equal weights, whatever the files' other bytes."""
    from safetensors.torch import load_file

    tensors = {f"model.safetensors/{key}": value for key, value in load_file(directory / "model.safetensors").items()}
    for head in sorted(directory.glob("*.pt")):
        state = torch.load(head, map_location="cpu", weights_only=True)
        tensors.update({f"{head.name}/{key}": value for key, value in state.items()})
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}\n".encode())
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()
