"""Text to token tensors, and token states to embeddings.

Shared by the Triton tokenizer/post-processing models and by the exporter's
validation: one implementation of tokenising, padding and pooling.
"""

from __future__ import annotations

import functools
import json
import re
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


#: Pre-tokenizers that split a text at every space, whatever surrounds it, so that a word's tokens never depend
#: on anything after the next space (ByteLevel: with its regex; Metaspace: where it splits at all)
_SPLIT_AT_SPACES = ("BertPreTokenizer", "Whitespace", "WhitespaceSplit", "ByteLevel", "Metaspace")
#: Pre-tokenizers that only split further, within the pieces before them, after one of those (a Metaspace
#: after a split at spaces, as transformers 5 saves sentencepiece tokenizers, meets pieces without spaces)
_SPLIT_FURTHER = ("BertPreTokenizer", "Whitespace", "WhitespaceSplit", "Punctuation", "Digits", "UnicodeScripts",
                  "Metaspace")
#: Normalizers that change a character (or a grapheme: Precompiled) on its own, or only a text's ends
_LOCAL_NORMALIZERS = ("BertNormalizer", "NFC", "NFD", "NFKC", "NFKD", "Lowercase", "StripAccents", "Strip",
                      "Prepend", "Precompiled", "Nmt")
#: The characters a text is first cut to, per token the model takes: enough for nearly every text of words
#: (a token of a word-piece or BPE vocabulary averages well under this), the rare rest cut again, longer
CUT_CHARS_PER_TOKEN = 8
#: The whitespace a text may be cut before: what every pre-tokenizer above but Metaspace splits at, and every
#: normalizer above leaves whitespace (not all of str.isspace: BertNormalizer drops \x0b, \x0c and \x85 as
#: controls, BertPreTokenizer keeps \x1c-\x1f in words); each tokenizer cuts before those it ends a word at
#: (:func:`cut_characters`)
CUT_BEFORE = " \t\n\r\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + "\u2028\u2029\u202f\u205f\u3000"


@functools.lru_cache(maxsize=None)
def _cut_patterns(characters: str) -> tuple[re.Pattern, re.Pattern]:
    """A cut's character and the non-space before it: in the reversed text, and forward (matched from the
    character, the rarer of the two, with a look behind)."""
    cut = "[" + "".join(f"\\u{ord(character):04x}" for character in characters) + "]"
    return re.compile(cut + r"\S"), re.compile(cut + r"(?<=\S.)", re.DOTALL)


def _splits_at_spaces(pre: dict | None) -> bool:
    kind = (pre or {}).get("type")
    if kind == "Sequence":
        first, *rest = pre["pretokenizers"] or [None]
        return _splits_at_spaces(first) and all(p.get("type") in _SPLIT_FURTHER for p in rest)
    if kind == "ByteLevel":
        return pre.get("use_regex", True)
    if kind == "Metaspace":
        return pre.get("split", True)
    return kind in _SPLIT_AT_SPACES


def _local(normalizer: dict | None) -> bool:
    kind = (normalizer or {}).get("type")
    if normalizer is None:
        return True
    if kind == "Sequence":
        return all(_local(n) for n in normalizer["normalizers"])
    if kind == "Replace":  # a literal without whitespace cannot match across the whitespace a text is cut before
        literal = normalizer.get("pattern", {}).get("String")
        return literal is not None and not any(character.isspace() for character in literal)
    return kind in _LOCAL_NORMALIZERS


def cut_characters(tokenizer: Tokenizer) -> str:
    """The characters of :data:`CUT_BEFORE` a text may be cut before (a non-space before it) so that it
    tokenizes to a prefix of the whole text's tokens; "" where no cut is safe.  Then a text far longer than
    the model takes may be tokenized only as far as truncation keeps (:func:`encode_cut`).  Safe where the
    normalizer changes characters on their own, the pre-tokenizer splits at every space, and no added token
    holds whitespace (added tokens are matched in the text, across words; a normalizer may make a space of
    other whitespace); then before each character that ends the word before it as a space does, probed
    through the tokenizer's own steps (a Metaspace splits only at spaces: there a newline ends a word only
    where the normalizer makes it a space, as sentencepiece's does)."""
    described = json.loads(tokenizer.to_str())
    if not (_local(described.get("normalizer")) and _splits_at_spaces(described.get("pre_tokenizer"))
            and not any(character.isspace() for token in described.get("added_tokens") or []
                        for character in token["content"])):
        return ""
    normalize = tokenizer.normalizer.normalize_str if tokenizer.normalizer is not None else str
    split = tokenizer.pre_tokenizer.pre_tokenize_str
    return "".join(character for character in CUT_BEFORE
                   if all(split(normalize(word + character + "b"))[0] == split(normalize(word + " b"))[0]
                          for word in ("a", ".", "7")))


def _cut(text: str, chars: int, characters: str) -> str | None:
    """``text`` up to the last of ``characters`` at or before ``chars`` that follows a non-space, else up to the
    first such after it; None where it is no longer than ``chars`` or has none."""
    if len(text) <= chars:
        return None
    last_cut, next_cut = _cut_patterns(characters)
    last = last_cut.search(text[chars::-1])  # reversed: the cut's character, then the non-space before it
    if last is not None:
        return text[:chars - last.start()]
    after = next_cut.search(text, chars + 1)
    return text[:after.start()] if after is not None else None


def encode_cut(encode, texts: list[str], max_length: int, first: tuple[str, int] | None = None,
               characters: str = " ") -> list:
    """``encode(texts)`` (a truncating tokenizer's ``encode_batch``) for a tokenizer whose
    :func:`cut_characters` are ``characters``, tokenizing each long text only as far as truncation keeps: cut
    before one of them past :data:`CUT_CHARS_PER_TOKEN` characters a token, a cut whose tokens did not
    overflow ``max_length`` cut again four times as long, up to the whole text.  A cut's tokens are the whole
    text's first ones, so once they overflow, truncation keeps the same tokens (and offsets) as from the whole
    text; a megabyte of text then costs what its first few thousand characters do.  A text without such
    whitespace (CJK, one long word) is tokenized whole: within a word a cut may change its tokens.

    ``first``: (a text, its token count without special tokens) that each of ``texts`` is the second of a
    pair with, truncated longest first.  A cut is kept where it overflowed with that text whole: then the
    first is the pair's shorter side, whose length alone sets both sides' (tokenizers' ``LongestFirst``),
    as with the whole second text, no shorter than its cut."""
    pair = (lambda text: text) if first is None else (lambda text: (first[0], text))
    found: list = [None] * len(texts)
    waiting, chars = list(range(len(texts))), CUT_CHARS_PER_TOKEN * max_length
    while waiting:
        cuts = [_cut(texts[index], chars, characters) for index in waiting]
        encodings = encode([pair(texts[index] if cut is None else cut) for index, cut in zip(waiting, cuts)])
        again = []
        for index, cut, encoding in zip(waiting, cuts, encodings):
            if cut is None or encoding.overflowing and (first is None or encoding.sequence_ids.count(0) == first[1]):
                found[index] = encoding
            else:
                again.append(index)
        waiting, chars = again, chars * 4
    return found


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
    On the CPU every request that fits in 512 tokens has one width, so it joins every
    execution and the graph cuts the padding off; GPU graphs have no such cut (TensorRT
    may refuse its data-dependent shape), so there the widths are buckets (16, 32, ...
    512) and requests of one bucket merge.  Past 512 both double."""
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
