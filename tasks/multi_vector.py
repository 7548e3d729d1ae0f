"""Late interaction (ColBERT): one normalised vector per scored token of a text, on its query or document side.

The encoder graph ends in the model's projection (sentence-transformers' Dense
modules on the token states) and L2 normalisation per token, times the scoring
mask (``export/pooling.py``): it answers ``MULTI_VECTOR``, ``[sequence, dim]``
per text, exact zeros off the mask.  The scoring mask is made by the tokenizer
step (mode ``sided``: the request parameter ``input_type`` picks the query or
the document side, ``python_models/sides.py``), fed to the encoder, and
answered beside the vectors as ``SCORE_MASK``: text ``i``'s vectors are
``MULTI_VECTOR[i][SCORE_MASK[i, :sequence] == 1]``, in token order.  The mask
may be wider than the vectors (the encoder cuts trailing padding), never
narrower in what it scores.

``--task auto`` picks it for a sentence-transformers ``MultiVectorEncoder``
folder, a PyLate one, or a Stanford ColBERT checkpoint (``HF_ColBERT``).
"""

from __future__ import annotations

import numpy as np

from . import model_parameters
from .model_parameters import NORMALIZE, SIMILARITY, VECTOR_SIZE, write
from .spec import EMBEDDED, HIDDEN, TaskSpec, Tensor, register, text

#: The tokenizer step's scoring mask (``python_models/sides.py``'s ``SCORE_MASK``, which this layer
#: cannot import): a graph input of the encoder and, as ``SCORE_MASK``, an output of the ensemble.
SCORE_MASK = "score_mask"
#: The sides a request may name (``input_type``; absent: the document side), and as the ensemble lists
#: them for clients.  The tokenizer step's copy (``python_models/sides.py``, which imports nothing of
#: nexus-sli) is held to these names by a test.
QUERY, DOCUMENT = "query", "document"
INPUT_TYPES = f"{QUERY},{DOCUMENT}"


def parse(answers: list[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
    """Each text's vectors ``[scored tokens, dim]`` from every chunk's (``MULTI_VECTOR``, ``SCORE_MASK``)."""
    return [vectors[mask[:len(vectors)].astype(bool)] for got, masks in answers for vectors, mask in zip(got, masks)]


def post_params(config, embedder) -> dict[str, str]:
    """How the vectors are made and compared: the model's similarity (``maxsim`` or ``meanmaxsim``), the
    vectors' size and the sides a request may name; ``normalize`` for the post-processing head."""
    return write({SIMILARITY: embedder.similarity, VECTOR_SIZE: embedder.vector_size,
                  model_parameters.INPUT_TYPES: INPUT_TYPES, NORMALIZE: embedder.normalize})


SPEC = register(TaskSpec(
    name="multi-vector",
    auto_class="AutoModel",
    outputs=(("last_hidden_state", "last_hidden_state"),),
    inputs=(text("TEXT"),),
    results=(Tensor("MULTI_VECTOR", "FP32", (-1, EMBEDDED)), Tensor("SCORE_MASK", "INT64", (-1,))),
    encoder_outputs=(Tensor("last_hidden_state", "FP32", (-1, HIDDEN)),),
    post_inputs=("last_hidden_state", SCORE_MASK),
    tokenizer_mode="sided",
    head="multi-vector",
    agreement=None,  # cosine per scored token
    parse=parse,
    # a Stanford ColBERT checkpoint; sentence-transformers and PyLate folders say so themselves (export/pipeline.py)
    inferred_from=lambda architecture, config: architecture == "HF_ColBERT",
    post_params=post_params,
    token_extras=(Tensor(SCORE_MASK, "INT64", (-1,)),),
    per_token=True,
    pooled_by="multi-vector",
    token_results=(("SCORE_MASK", SCORE_MASK),),
    head_tensors=("linear.weight",),
))
