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
only the standard library and numpy.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

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


# sided_arrays(encodings, side_name, sides, input_names, pad_id, width) -> dict[str, np.ndarray]
# is to be written here: the encoder's int64 arrays [batch, width] for ``input_names`` (which may include
# SCORE_MASK) from one side's encodings, expansion and scoring masks applied as described above.
