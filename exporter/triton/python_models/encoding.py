"""Text to token tensors, and token states to embeddings.

Shared by the Triton tokenizer/post-processing models and by the exporter's
validation: one implementation of tokenising, padding and pooling.
"""

from __future__ import annotations

from itertools import chain

import numpy as np
from tokenizers import Tokenizer

POOLING_MODES = ("mean", "cls", "max")
#: sentence-transformers' SpladePooling: how token weights are pooled over a text, and the activation
#: before it (``relu``: log(1 + relu(x)); ``log1p_relu``: log(1 + log(1 + relu(x))))
SPLADE_STRATEGIES = ("max", "sum")
SPLADE_ACTIVATIONS = ("relu", "log1p_relu")
#: The pooling's guards (the graph's pooling, ``export/pooling.py``, uses the same): the least
#: mask count a mean divides by, the value masked positions take in a max, the least norm.
MIN_COUNT, MASKED_OUT, MIN_NORM = 1e-9, -1e9, 1e-12
#: How the tokenizer model reads a request: one text per row, (query, documents),
#: (question, context) in overlapping windows, or one text per row on the query or the document
#: side of a late-interaction model (``sides.py``); a task spec names one.
TOKENIZER_MODES = ("single", "pair", "qa", "sided")
#: The token arrays :func:`to_arrays` builds: the graph's inputs and the ones the post-processing reads.
TOKEN_ARRAYS = ("input_ids", "attention_mask", "token_type_ids", "offsets", "context_mask", "word_spans",
                "special_tokens_mask")


class TextTooLongError(ValueError):
    """A text has more tokens than the model takes and truncation is off."""

    def __init__(self, index: int, length: int, limit: int):
        super().__init__(f"text {index} has {length} tokens; the model takes at most {limit} (truncation is off)")
        self.index, self.length, self.limit = index, length, limit


def load_tokenizer(path: str, max_length: int, truncate: bool = True, stride: int = 0,
                   strategy: str = "longest_first") -> Tokenizer:
    """A ``tokenizers`` tokenizer that truncates to ``max_length`` (or not).
    ``stride`` > 0 with ``strategy="only_second"`` makes long (question, context)
    pairs overflow into overlapping windows (``Encoding.overflowing``)."""
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.no_padding()  # padding is done per batch below, to one length
    if truncate:
        tokenizer.enable_truncation(max_length, stride=stride, strategy=strategy)
    else:
        tokenizer.no_truncation()
    return tokenizer


def windows(tokenizer: Tokenizer, question: str, context: str) -> list:
    """Every window of a (question, context) pair: the first encoding and its overflow."""
    encoding = tokenizer.encode(question, context)
    return [encoding, *encoding.overflowing]


def check_lengths(encodings, max_length: int) -> None:
    """Raise :class:`TextTooLongError` for the first encoding over ``max_length`` tokens."""
    for index, enc in enumerate(encodings):
        if len(enc.ids) > max_length:
            raise TextTooLongError(index, len(enc.ids), max_length)


def padded_length(longest: int, widths: list[int], max_length: int) -> int:
    """The width a batch is padded to: the smallest of ``widths`` it fits in, else
    ``max_length``.  Triton's dynamic batcher merges only requests of equal shape.
    On the CPU there is one width, so every request joins every execution and the
    graph cuts the padding off; GPU graphs have no such cut (TensorRT may refuse
    its data-dependent shape), so there the widths are buckets (16, 32, ... 512)
    and requests of one bucket merge."""
    return next((width for width in sorted(widths) if longest <= width), max_length)


def to_arrays(encodings, input_names: list[str], pad_id: int, length: int) -> dict[str, np.ndarray]:
    """int64 arrays ``[batch, length]`` for each graph input in ``input_names``.  Each input's tokens are read
    into one flat array and spread under the mask of real positions: a copy per row and input cost more than
    the rows of a large batch took to tokenize (bench/data/tried.md, "The token arrays in one copy")."""
    ids = [encoding.ids for encoding in encodings]
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    real = np.arange(length) < lengths[:, None]
    arrays = {}
    for name in input_names:
        if name == "attention_mask":
            arrays[name] = real.astype(np.int64)
        elif name == "offsets":  # character span of each token in its own sequence; (0, 0) for specials and padding
            arrays[name] = _offsets(encodings, length)
        elif name == "word_spans":
            arrays[name] = _word_spans(encodings, length)
        else:
            array = np.full(real.shape, pad_id if name == "input_ids" else 0, dtype=np.int64)
            array[real] = np.fromiter(chain.from_iterable(_row_values(name, ids, encodings)), dtype=np.int64,
                                      count=int(lengths.sum()))
            arrays[name] = array
    return arrays


def _row_values(name: str, ids: list, encodings):
    """Each row's values of the input ``name``, one per token."""
    if name == "input_ids":
        return ids
    if name == "token_type_ids":
        return (encoding.type_ids for encoding in encodings)
    if name == "context_mask":  # 1 where a token belongs to the second sequence (the context of a QA pair)
        return ((sid == 1 for sid in encoding.sequence_ids) for encoding in encodings)
    if name == "special_tokens_mask":  # 1 where the tokenizer's template added the token ([CLS], [SEP], <s> ...)
        return (encoding.special_tokens_mask for encoding in encodings)
    raise KeyError(f"no token array {name!r}; known: {', '.join(TOKEN_ARRAYS)}")


def _offsets(encodings, length: int) -> np.ndarray:
    offsets = np.zeros((len(encodings), length, 2), dtype=np.int64)
    for row, encoding in enumerate(encodings):
        # reshaped: a text of no tokens (a tokenizer without a template, an empty text) has offsets []
        offsets[row, :len(encoding.ids)] = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
        offsets[row, [i for i, sid in enumerate(encoding.sequence_ids) if sid is None]] = 0
    return offsets


def _word_spans(encodings, length: int) -> np.ndarray:
    """Per token of the second sequence (a QA pair's context), the character span of the word it is part of,
    words as the tokenizer's pre-tokenizer splits them (``Encoding.word_to_chars``), which transformers'
    QuestionAnsweringPipeline widens answers to (``align_to_words``); a token of no word keeps its own span,
    as there; (0, 0) for the other tokens and padding."""
    spans = np.zeros((len(encodings), length, 2), dtype=np.int64)
    for row, encoding in enumerate(encodings):
        words, found = {}, []
        for sequence, word, own in zip(encoding.sequence_ids, encoding.word_ids, encoding.offsets):
            if sequence == 1 and word is not None and word not in words:
                words[word] = encoding.word_to_chars(word, 1)
            found.append((0, 0) if sequence != 1 else words.get(word) or own)
        spans[row, :len(found)] = np.asarray(found, dtype=np.int64).reshape(-1, 2)
    return spans


def encode(
    tokenizer: Tokenizer,
    texts: list,
    input_names: list[str],
    pad_id: int,
    max_length: int,
    truncate: bool = True,
) -> dict[str, np.ndarray]:
    """Tokenise and pad ``texts`` (strings, or (first, second) pairs) to the longest one."""
    encodings = tokenizer.encode_batch(list(texts))
    if not truncate:
        check_lengths(encodings, max_length)
    return to_arrays(encodings, input_names, pad_id, max((len(e.ids) for e in encodings), default=0))


def pool(hidden: np.ndarray, mask: np.ndarray, mode: str) -> np.ndarray:
    """Sentence embedding ``[batch, hidden]`` from token states ``[batch, seq, hidden]``."""
    hidden = hidden.astype(np.float32, copy=False)
    if mode == "cls":
        return hidden[:, 0]
    weights = mask[..., None].astype(np.float32)
    if mode == "mean":
        return (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), MIN_COUNT)
    if mode == "max":
        return np.where(weights > 0, hidden, np.float32(MASKED_OUT)).max(axis=1)
    raise ValueError(f"unknown pooling mode {mode!r}; known modes: {', '.join(POOLING_MODES)}")


def splade(logits: np.ndarray, mask: np.ndarray, strategy: str = "max", activation: str = "relu") -> np.ndarray:
    """Sparse embedding ``[batch, vocab]`` from masked-LM logits ``[batch, seq, vocab]``, as
    sentence-transformers' SpladePooling: logits times the mask, ``log1p(relu(.))`` (twice for
    ``log1p_relu``), then the max or the sum over the sequence."""
    if strategy not in SPLADE_STRATEGIES or activation not in SPLADE_ACTIVATIONS:
        raise ValueError(f"unknown SPLADE pooling {strategy!r} / activation {activation!r}; known: "
                         f"{', '.join(SPLADE_STRATEGIES)} / {', '.join(SPLADE_ACTIVATIONS)}")
    weights = np.log1p(np.maximum(logits.astype(np.float32) * mask[..., None].astype(np.float32), 0))
    if activation == "log1p_relu":
        weights = np.log1p(weights)
    return weights.max(axis=1) if strategy == "max" else weights.sum(axis=1)


def l2_normalize(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
    return vectors / np.maximum(norms, MIN_NORM)
