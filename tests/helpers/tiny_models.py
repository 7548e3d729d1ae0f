"""Seeded tiny checkpoints, one per family, built from configs in code.

Each is saved the way the hub ships them (config.json, model.safetensors,
tokenizer.json), with a WordPiece tokenizer trained here on the project's
validation texts, so the exporter sees exactly what it would see offline.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

VOCAB = 400
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              intermediate_size=64, max_position_embeddings=128, pad_token_id=0)

#: model_type -> (transformers architecture saved, config overrides)
TINY_CONFIGS: dict[str, tuple[str, dict]] = {
    "bert": ("BertModel", {}),
    "roberta": ("RobertaForMaskedLM", {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
                                       "max_position_embeddings": 130, "type_vocab_size": 1}),
    "deberta": ("DebertaModel", {"type_vocab_size": 0, "relative_attention": True, "max_relative_positions": -1,
                                 "pos_att_type": ["c2p", "p2c"]}),
    "deberta-v2": ("DebertaV2Model", {"type_vocab_size": 0, "relative_attention": True, "position_buckets": 32,
                                      "pos_att_type": ["c2p", "p2c"], "norm_rel_ebd": "layer_norm",
                                      "share_att_key": True, "position_biased_input": False}),
    "distilbert": ("DistilBertForMaskedLM", {"dim": 32, "n_layers": 2, "n_heads": 4, "hidden_dim": 64}),
    "albert": ("AlbertModel", {"embedding_size": 16, "num_hidden_layers": 4, "num_hidden_groups": 2,
                               "inner_group_num": 2}),
    "modernbert": ("ModernBertModel", {"bos_token_id": 2, "eos_token_id": 3, "cls_token_id": 2, "sep_token_id": 3,
                                       "global_attn_every_n_layers": 2, "local_attention": 16}),
    "electra": ("ElectraModel", {"embedding_size": 16}),
    "xlm-roberta": ("XLMRobertaModel", {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
                                        "max_position_embeddings": 130}),
    "camembert": ("CamembertModel", {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
                                     "max_position_embeddings": 130}),
    "nomic_bert": ("NomicBertModel", {}),
    "ernie": ("ErnieForMaskedLM", {"use_task_id": True, "task_type_vocab_size": 3}),
    "megatron-bert": ("MegatronBertForMaskedLM", {}),
    "roformer": ("RoFormerForMaskedLM", {"embedding_size": 32, "rotary_value": False}),
    "mobilebert": ("MobileBertForMaskedLM", {"embedding_size": 16, "intra_bottleneck_size": 16,
                                             "true_hidden_size": 16, "num_feedforward_networks": 2}),
    "xlm-roberta-xl": ("XLMRobertaXLForMaskedLM", {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
                                                   "max_position_embeddings": 130}),
    "data2vec-text": ("Data2VecTextModel", {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
                                            "max_position_embeddings": 130}),
    # EuroBERT's own special ids are past the tiny vocabulary; two key/value heads for four query heads
    "eurobert": ("EuroBertForMaskedLM", {"bos_token_id": 2, "eos_token_id": 3, "mask_token_id": 4,
                                         "num_key_value_heads": 2}),
    # MPNet fixes its padding index at 1.  Its position bias has exact buckets to distance 8,
    # log-spaced ones to 128 and one bucket past that: 256 positions reach all three kinds
    "mpnet": ("MPNetForMaskedLM", {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
                                   "max_position_embeddings": 258, "relative_attention_num_buckets": 32}),
}

#: Registered families without a tiny model here, and why (JinaBERT and NeoBERT,
#: which transformers lacks, have theirs in tiny_remote_models.py).
NO_TINY_MODEL: dict[str, str] = {}


def train_tokenizer(texts: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=VOCAB, special_tokens=SPECIALS))
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    return tokenizer


def build_tiny(model_type: str, directory: Path, tokenizer: Tokenizer, seed: int = 0) -> Path:
    """Save a seeded random ``model_type`` checkpoint into ``directory``."""
    import transformers
    from transformers import CONFIG_MAPPING

    architecture, overrides = TINY_CONFIGS[model_type]
    config = CONFIG_MAPPING[model_type](**{**COMMON, **overrides})
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def padded_feeds(lengths: list[int], width: int, vocab: int = VOCAB, seed: int = 0) -> dict[str, np.ndarray]:
    """A right-padded batch of random ids: row i has lengths[i] real tokens out of width."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, vocab, size=(len(lengths), width), dtype=np.int64)
    mask = np.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
        ids[row, n:] = 0
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}


def quiet_session(path: Path):
    """An ONNX Runtime CPU session that logs errors only (the tests' graphs would warn about their
    unused initializers on every run)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def plain_graph(model, task, folder: Path, lengths: tuple[int, ...], width: int, seed: int) -> dict:
    """``model``'s plain ONNX graph at ``folder/plain.onnx`` (what the pipeline exports before the
    pooling and the trim) and a padded batch of its inputs."""
    from nexus_sli.exporter.export.onnx_export import export_onnx, model_input_names

    names = model_input_names(model, model.config)
    export_onnx(model, task, names, VOCAB, folder / "plain.onnx")
    feeds = padded_feeds(lengths, width, seed=seed)
    return {"model": model, "names": names, "path": folder / "plain.onnx", "folder": folder,
            "feeds": {n: feeds[n] for n in names}}


def with_dense(checkpoint: Path, folder: Path, heads: list, seed: int, normalize: bool = False) -> Path:
    """A sentence-transformers folder at ``folder``: ``checkpoint`` (a tiny model above), mean pooling and the
    Dense modules ``heads`` (``sentence_transformers`` Dense instances: those reading ``token_embeddings``
    before the pooling, the others after it, in order), then a Normalize where asked.  Their weights are
    drawn again from ``seed``, wide enough that an activation sees values past its linear range."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules

    torch.manual_seed(seed)
    with torch.no_grad():
        for head in heads:
            for parameter in head.parameters():
                parameter.uniform_(-1.0, 1.0)
    before = [head for head in heads if head.module_input_name == "token_embeddings"]
    after = [head for head in heads if head.module_input_name != "token_embeddings"]
    width = before[-1].out_features if before else COMMON["hidden_size"]
    transformer = modules.Transformer(str(checkpoint), max_seq_length=64)
    tail = [modules.Normalize()] if normalize else []
    SentenceTransformer(modules=[transformer, *before, modules.Pooling(width, "mean"), *after, *tail],
                        device="cpu").save(str(folder))
    return folder
