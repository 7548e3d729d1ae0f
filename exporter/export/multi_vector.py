"""A late-interaction (ColBERT) model's folder, read as sentence-transformers' ``MultiVectorEncoder`` reads it.

Three save formats load as a ``MultiVectorEncoder``: its own (``modules.json``:
Transformer, Dense, MultiVectorMask, Normalize), PyLate's (``model_type``
``ColBERT``, flat marker and length keys) and Stanford ColBERT's (``HF_ColBERT``
with a root ``linear.weight`` and ``artifact.metadata``).  Each is read here into
one :class:`MultiVectorConfig`: the two sides (``python_models/sides.py``), the
projection, the normalisation and the similarity, without importing
sentence-transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

from nexus_sli.exporter.triton.python_models.sides import Sides

from .dense import Dense

#: The similarities a late-interaction model may name: the sum over query vectors of their best
#: document match, and that sum divided by the number of query vectors.
SIMILARITIES = ("maxsim", "meanmaxsim")


@dataclass(frozen=True)
class MultiVectorConfig:
    sides: Sides
    #: the projection(s) on the token states, in order (sentence-transformers' Dense on ``token_embeddings``)
    dense: tuple[Dense, ...]
    #: each token vector L2-normalised (the Normalize module)
    normalize: bool
    #: one of :data:`SIMILARITIES`
    similarity: str
    #: ``sentence-transformers``, ``pylate`` or ``stanford``
    format: str
    #: marker tokens sentence-transformers registers as special tokens for the legacy formats; the
    #: served tokenizer.json must have them too
    added_special_tokens: tuple[str, ...] = ()


# To be written here (see the lead's contract):
#   is_multi_vector(path) -> bool
#   read_multi_vector(path, tokenizer, max_positions) -> MultiVectorConfig
#   multi_vectors(hidden, score_mask, config) -> list[np.ndarray]   (the numpy reference head)
