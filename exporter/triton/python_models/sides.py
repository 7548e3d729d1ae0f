"""A late-interaction (ColBERT) model's two sides: how a query and a document are tokenized and scored.

sentence-transformers' ``MultiVectorEncoder`` treats a query and a document
differently: each side has its marker (a prompt such as ``"[Q] "``), its
truncation length, and for queries an expansion that pads short queries with a
token (``[MASK]``) the model scores as extra query vectors; a document's
punctuation (its skiplist) is not scored.  The scoring mask (which token
vectors a text answers) therefore differs from the attention mask (which tokens
the encoder attends to): an expansion position with ``attend`` false is scored
but not attended to.

The exporter reads these facts from the model's folder (``export/multi_vector.py``)
into :class:`Sides`, writes them as the tokenizer step's ``sides`` parameter
(:meth:`Sides.to_json`), and the tokenizer step (mode ``sided``) and the
exporter's validation both build the encoder's arrays with :func:`sided_arrays`,
so what is validated is what is served.

This file is copied beside the tokenizer model in every repository: it imports
only the standard library, numpy and its sibling ``encoding.py``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np

if __package__:  # imported from the nexus_sli package (validation, tests)
    from .encoding import load_tokenizer, to_arrays
else:  # copied beside the tokenizer model in a repository
    from encoding import load_tokenizer, to_arrays

#: The sides a request names (the request parameter ``error_codes.INPUT_TYPE_PARAMETER``).
QUERY, DOCUMENT = "query", "document"
SIDE_NAMES = (QUERY, DOCUMENT)
#: The extra token tensor a sided tokenizer answers: 1 where a token's vector is scored.
SCORE_MASK = "score_mask"


@dataclass(frozen=True)
class Expansion:
    """Query expansion: positions ``[n, length)`` of a row with ``n`` real tokens get ``token_id`` and are
    scored; the encoder attends to them only where ``attend``.  ``strategy`` (``fixed`` or ``min``) is
    already reflected in the side's ``max_length``; it is kept to describe the model."""

    strategy: str
    length: int
    token_id: int
    attend: bool


@dataclass(frozen=True)
class Side:
    """How one side's texts become token arrays and which of their tokens are scored."""

    #: put in front of each text before tokenizing (the side's marker), unless a request names a prompt
    prompt: str
    #: the truncation length of this side's texts (special tokens and the prompt included)
    max_length: int
    expansion: Expansion | None = None
    #: whether the tokens in :attr:`Sides.skiplist_ids` are left out of this side's scoring mask
    skiplist: bool = False
    #: where given, only tokens with these ids are scored (sentence-transformers applies it to documents)
    keep_only_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Sides:
    query: Side
    document: Side
    skiplist_ids: tuple[int, ...] = ()
    #: the first token (``[CLS]``/``<s>``) is never scored (BGE-M3's ColBERT vectors)
    drop_first: bool = False

    def side(self, name: str) -> Side:
        if name not in SIDE_NAMES:
            raise ValueError(f"unknown input_type {name!r}; known: {', '.join(SIDE_NAMES)}")
        return self.query if name == QUERY else self.document

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Sides:
        data = json.loads(text)

        def side(raw: dict) -> Side:
            expansion = Expansion(**raw["expansion"]) if raw.get("expansion") else None
            keep = raw.get("keep_only_ids")
            return Side(raw["prompt"], int(raw["max_length"]), expansion, bool(raw.get("skiplist", False)),
                        tuple(keep) if keep is not None else None)

        return cls(side(data["query"]), side(data["document"]), tuple(data.get("skiplist_ids", ())),
                   bool(data.get("drop_first", False)))


def row_width(tokens: int, side: Side) -> int:
    """The width a row of ``tokens`` real tokens needs on ``side``: an expansion fills it up to its length
    (what :func:`encoding.padded_length` is given, so that one width holds every row of an execution)."""
    return max(tokens, side.expansion.length) if side.expansion else tokens


def sided_arrays(encodings, side_name: str, sides: Sides, input_names: list[str], pad_id: int,
                 width: int) -> dict[str, np.ndarray]:
    """int64 arrays ``[batch, width]`` for ``input_names`` (which may include :data:`SCORE_MASK`) from
    ``encodings`` of texts tokenized for the side ``side_name`` (its prompt in front, truncated at its
    ``max_length``), as sentence-transformers' ``Transformer.preprocess`` (the expansion) and
    ``MultiVectorMask`` (the scoring mask) build them."""
    side = sides.side(side_name)
    needed = max((row_width(len(e.ids), side) for e in encodings), default=0)
    if width < needed:
        raise ValueError(f"width {width} is narrower than the {needed} positions a row of these texts needs")
    base = [name for name in input_names if name != SCORE_MASK]
    arrays = to_arrays(encodings, list(dict.fromkeys([*base, "input_ids", "attention_mask"])), pad_id, width)
    expansion = _expansion(arrays["attention_mask"], side.expansion)
    if side.expansion:
        arrays["input_ids"][expansion] = side.expansion.token_id
        if side.expansion.attend:
            arrays["attention_mask"][expansion] = 1
    arrays[SCORE_MASK] = _score_mask(arrays["input_ids"], arrays["attention_mask"].astype(bool) | expansion, side,
                                     sides).astype(np.int64)
    return {name: arrays[name] for name in input_names}


def _expansion(attention_mask: np.ndarray, expansion: Expansion | None) -> np.ndarray:
    """Where the expansion goes: positions ``[n, length)`` of each row of ``n`` real tokens."""
    if expansion is None:
        return np.zeros(attention_mask.shape, dtype=bool)
    real = attention_mask.sum(axis=1, keepdims=True)
    positions = np.arange(attention_mask.shape[1])[None, :]
    return (positions >= real) & (positions < expansion.length)


def _score_mask(ids: np.ndarray, scored: np.ndarray, side: Side, sides: Sides) -> np.ndarray:
    """``scored`` (real tokens and expansion) less the side's skiplist, outside its allowlist, and the first
    token where :attr:`Sides.drop_first`."""
    if side.skiplist and sides.skiplist_ids:
        scored &= ~np.isin(ids, sides.skiplist_ids)
    if side.keep_only_ids:  # an empty allowlist is no allowlist, as in sentence-transformers
        scored &= np.isin(ids, side.keep_only_ids)
    if sides.drop_first:
        scored[:, 0] = False
    return scored


def sided_encode(tokenizer, texts: list[str], side_name: str, sides: Sides, input_names: list[str], pad_id: int,
                 prompt: str | None = None) -> dict[str, np.ndarray]:
    """:func:`sided_arrays` of ``texts`` as one batch padded to its widest row; ``tokenizer`` truncates at the
    side's ``max_length`` (:func:`side_tokenizers`), ``prompt`` (a named prompt) replaces the side's."""
    side = sides.side(side_name)
    prefix = side.prompt if prompt is None else prompt
    encodings = tokenizer.encode_batch([prefix + text for text in texts])
    width = max((row_width(len(e.ids), side) for e in encodings), default=0)
    return sided_arrays(encodings, side_name, sides, input_names, pad_id, width)


def side_tokenizers(path: str, sides: Sides, truncate: bool = True) -> dict:
    """One tokenizer per side name, truncating at that side's ``max_length`` (or not)."""
    return {name: load_tokenizer(path, sides.side(name).max_length, truncate) for name in SIDE_NAMES}
