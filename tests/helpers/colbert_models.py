"""Seeded tiny late-interaction (ColBERT) models, in the three save formats ``MultiVectorEncoder`` loads.

``colbert_folder(directory, format, **options)`` writes one: a tiny BERT
(:mod:`tiny_models`), a token-level Dense projection to :data:`DIM` and the
query/document settings given as options, saved

- ``"native"``: by ``MultiVectorEncoder.save`` itself (modules.json: Transformer,
  Dense, MultiVectorMask, Normalize; the markers are plain prompts);
- ``"pylate"``: as PyLate 3 saved it (modules.json lists Transformer and
  ``pylate.models.Dense.Dense`` only; ``model_type`` ``ColBERT`` and flat keys
  in config_sentence_transformers.json; the markers ``[Q] ``/``[D] `` added to
  the tokenizer as ordinary tokens);
- ``"stanford"``: as Stanford ColBERT saves it (``HF_ColBERT``, the projection
  as the checkpoint's root ``linear.weight``, settings in ``artifact.metadata``;
  the markers ``[unused0]``/``[unused1]``).

The tokenizer is the tests' kept WordPiece tokenizer with ``[unused0]`` and
``[unused1]`` in its vocabulary (markers sentence-transformers must register as
special tokens) and half of ``string.punctuation`` (the other half resolves to
``[UNK]``, which a skiplist drops).  Load a folder with
``MultiVectorEncoder(str(folder), device="cpu")``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, models

from .tiny_models import COMMON, TINY_CONFIGS

FORMATS = ("native", "pylate", "stanford")
#: the projected size of each token vector
DIM = 16
#: markers in the WordPiece vocabulary (Stanford ColBERT's), and the ones PyLate adds as tokens
UNUSED = ("[unused0]", "[unused1]")
PYLATE_MARKERS = ("[Q] ", "[D] ")
#: the model's vocabulary: the kept tokenizer's, ``UNUSED``, and room for PyLate's two added markers
VOCAB_SIZE = 400 + len(UNUSED) + len(PYLATE_MARKERS)
_KEPT_TOKENIZER = Path(__file__).resolve().parents[1] / "data" / "tiny_tokenizer.json"
_TEXTS = ["Paris is the capital of France.", "what is a tiny model?", "Water boils at 100 degrees; ice melts."]


def colbert_tokenizer() -> Tokenizer:
    """The kept tiny WordPiece tokenizer with :data:`UNUSED` appended to its vocabulary."""
    tokenizer = Tokenizer.from_file(str(_KEPT_TOKENIZER))
    vocab = dict(tokenizer.get_vocab(with_added_tokens=False))
    for token in UNUSED:
        vocab[token] = len(vocab)
    tokenizer.model = models.WordPiece(vocab, unk_token="[UNK]")
    return tokenizer


def colbert_folder(directory: Path, format: str = "native", *, strategy: str = "fixed", attend: bool = False,
                   expansion_length: int = 12, query_length: int | None = None, document_length: int | None = 24,
                   skiplist_words: list[str] | None = None, skiplist_tasks: list[str] | None = None,
                   keep_only_token_ids: list[int] | None = None, similarity: str | None = "maxsim",
                   prompts: dict[str, str] | None = None, bias: bool = False, seed: int = 0) -> Path:
    """A seeded tiny ColBERT saved in ``format`` (one of :data:`FORMATS`) at ``directory``.

    ``strategy``/``attend``/``expansion_length``: the query expansion (``strategy=None``: none; the legacy
    formats know only ``fixed``); ``skiplist_words`` defaults to ``string.punctuation`` in the legacy formats
    (as they do) and to none in the native one; ``skiplist_tasks``, ``keep_only_token_ids`` and ``prompts``
    are the native format's only; ``similarity`` is saved as ``similarity_fn_name`` (None: not saved);
    ``bias`` gives the projection a bias (the native and PyLate formats)."""
    if format not in FORMATS:
        raise ValueError(f"unknown format {format!r}; known: {', '.join(FORMATS)}")
    directory.mkdir(parents=True, exist_ok=True)
    options = dict(strategy=strategy, attend=attend, expansion_length=expansion_length, query_length=query_length,
                   document_length=document_length, skiplist_words=skiplist_words, similarity=similarity, seed=seed)
    if format == "native":
        return _native(directory, skiplist_tasks, keep_only_token_ids, prompts, bias, **options)
    if format == "pylate":
        return _pylate(directory, bias, **options)
    return _stanford(directory, **options)


def _bert(directory: Path, tokenizer: Tokenizer, seed: int, architecture: str = "BertModel"):
    """A seeded tiny BERT (the tiny models' sizes), saved at ``directory`` with ``tokenizer``."""
    import transformers
    from transformers import CONFIG_MAPPING

    config = CONFIG_MAPPING["bert"](**{**COMMON, **TINY_CONFIGS["bert"][1], "vocab_size": VOCAB_SIZE})
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = transformers.BertModel(config).eval()
    model.save_pretrained(directory, safe_serialization=True)
    # save_pretrained names the class saved; Stanford ColBERT's config names its own
    saved = json.loads((directory / "config.json").read_text())
    _write(directory / "config.json", {**saved, "architectures": [architecture]})
    tokenizer.save(str(directory / "tokenizer.json"))
    return model


def _projection(seed: int, bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(seed + 1)
    weight = torch.empty(DIM, COMMON["hidden_size"]).uniform_(-0.5, 0.5, generator=generator)
    return weight, (torch.empty(DIM).uniform_(-0.5, 0.5, generator=generator) if bias else None)


def _native(directory: Path, skiplist_tasks, keep_only_token_ids, prompts, bias: bool, *, strategy, attend,
            expansion_length, query_length, document_length, skiplist_words, similarity, seed) -> Path:
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    backbone = directory / "backbone"
    _bert(backbone, colbert_tokenizer(), seed)
    expansion = None if strategy is None else {"strategy": strategy, "attend": attend, "length": expansion_length}
    transformer = Transformer(str(backbone), query_length=query_length, document_length=document_length,
                              query_expansion=expansion)
    weight, bias_values = _projection(seed, bias)
    dense = Dense(COMMON["hidden_size"], DIM, bias=bias, activation_function=torch.nn.Identity(), init_weight=weight,
                  init_bias=bias_values, module_input_name="token_embeddings")
    mask = MultiVectorMask(skiplist_words, skiplist_tasks=skiplist_tasks, keep_only_token_ids=keep_only_token_ids)
    model = MultiVectorEncoder(modules=[transformer, dense, mask, Normalize(module_input_name="token_embeddings")],
                               prompts=prompts if prompts is not None else {"query": "[Q] ", "document": "[D] "},
                               similarity_fn_name=similarity, device="cpu")
    model.save(str(directory))
    _remove(backbone)
    return directory


def _remove(folder: Path) -> None:
    import shutil

    shutil.rmtree(folder)


def _pylate(directory: Path, bias: bool, *, strategy, attend, expansion_length, query_length, document_length,
            skiplist_words, similarity, seed) -> Path:
    """PyLate 3's layout: the backbone at the root, ``1_Dense`` without module names, the rest flat keys."""
    if strategy not in ("fixed", None):
        raise ValueError("PyLate saves know only the fixed query expansion")
    tokenizer = colbert_tokenizer()
    tokenizer.add_tokens(list(PYLATE_MARKERS))  # as PyLate adds them: ordinary (normalized) tokens
    _bert(directory, tokenizer, seed)
    weight, bias_values = _projection(seed, bias)
    _dense_folder(directory / "1_Dense", weight, bias_values)
    _write(directory / "modules.json", [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"}])
    _write(directory / "sentence_bert_config.json", {"max_seq_length": document_length, "do_lower_case": False})
    config = {"model_type": "ColBERT", "query_prefix": PYLATE_MARKERS[0], "document_prefix": PYLATE_MARKERS[1],
              "query_length": expansion_length if query_length is None else query_length,
              "document_length": document_length, "do_query_expansion": strategy is not None,
              "attend_to_expansion_tokens": attend, "prompts": {}, "default_prompt_name": None}
    if skiplist_words is not None:
        config["skiplist_words"] = skiplist_words
    if similarity is not None:
        config["similarity_fn_name"] = similarity
    _write(directory / "config_sentence_transformers.json", config)
    return directory


def _dense_folder(folder: Path, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """A Dense module's folder as PyLate saved it: no module_input_name (the token states are implied)."""
    from safetensors.torch import save_file

    folder.mkdir()
    _write(folder / "config.json", {"in_features": weight.shape[1], "out_features": weight.shape[0],
                                    "bias": bias is not None,
                                    "activation_function": "torch.nn.modules.linear.Identity"})
    tensors = {"linear.weight": weight.contiguous()}
    if bias is not None:
        tensors["linear.bias"] = bias.contiguous()
    save_file(tensors, str(folder / "model.safetensors"))


def _stanford(directory: Path, *, strategy, attend, expansion_length, query_length, document_length,
              skiplist_words, similarity, seed) -> Path:
    """Stanford ColBERT's layout: ``bert.*`` and the root ``linear.weight`` in one file, ``artifact.metadata``."""
    from safetensors.torch import load_file, save_file

    if strategy != "fixed" or query_length is not None or similarity not in ("maxsim", None):
        raise ValueError("Stanford ColBERT saves always expand queries (fixed) and name no query_length or similarity")
    _bert(directory, colbert_tokenizer(), seed, architecture="HF_ColBERT")
    weights = directory / "model.safetensors"
    tensors = {"bert." + key: value for key, value in load_file(str(weights)).items()}
    tensors["linear.weight"] = _projection(seed, False)[0].contiguous()
    save_file(tensors, str(weights))
    metadata = {"query_token_id": UNUSED[0], "doc_token_id": UNUSED[1], "query_maxlen": expansion_length,
                "doc_maxlen": document_length, "attend_to_mask_tokens": attend, "dim": DIM,
                "mask_punctuation": skiplist_words is None or bool(skiplist_words)}
    _write(directory / "artifact.metadata", metadata)
    return directory


def _write(file: Path, data) -> None:
    file.write_text(json.dumps(data, indent=2))


def sample_texts() -> list[str]:
    """Short texts with punctuation (the skiplist) and one longer than every side's length."""
    return [*_TEXTS, " ".join(["the capital of a tiny country, and its river."] * 8)]
