"""FlagEmbedding's BGE-M3 outputs on a tiny BGE-M3 folder, written as JSON: the reference the product is held to.

Runs in FlagEmbedding's own venv (``.venv-flag``, which ``make test-real`` builds:
FlagEmbedding needs transformers 4, the product transformers 5):

    .venv-flag/bin/python tests/references/flag_m3.py FOLDER OUT.json

FOLDER is the seeded tiny BGE-M3 that ``tests/helpers/m3_models.py`` writes;
``tests/data/bge_m3/flag_reference.json`` is this script's output on it.  The
file records the weights' fingerprint, the texts and their token ids,
``BGEM3FlagModel.encode``'s dense vectors, lexical weights and ColBERT vectors
(``use_fp16=False``: fp32 on the CPU), and the score matrices of the queries
against the documents (``colbert_score``, ``compute_lexical_matching_score``).
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import metadata
from pathlib import Path

#: short queries, and documents with punctuation, a repeated word (the lexical weight is the largest of its
#: tokens'), a character the vocabulary lacks (``<unk>``, dropped) and one text longer than the others
QUERIES = ["what is the capital of france?", "how do bees make honey", "ciudad de méxico 東京"]
DOCUMENTS = [
    "Paris is the capital and largest city of France.",
    "Bees make honey from nectar; honey, more honey, and honey again!",
    "The river runs through the old city, past the market, the bridge and the station, before it reaches the "
    "sea after a long, slow journey across the plain.",
    "ok",
]


def reference(folder: Path) -> dict:
    import torch
    from FlagEmbedding import BGEM3FlagModel

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the helpers' fingerprint
    from helpers.m3_models import weights_fingerprint

    colbert_dim = torch.load(folder / "colbert_linear.pt", weights_only=True)["weight"].shape[0]
    model = BGEM3FlagModel(str(folder), use_fp16=False, devices="cpu", colbert_dim=colbert_dim)
    queries, documents = (model.encode(texts, return_dense=True, return_sparse=True, return_colbert_vecs=True)
                          for texts in (QUERIES, DOCUMENTS))
    colbert = [[float(model.colbert_score(q, d)) for d in documents["colbert_vecs"]] for q in queries["colbert_vecs"]]
    lexical = model.compute_lexical_matching_score(queries["lexical_weights"], documents["lexical_weights"])
    return {"flag_embedding": metadata.version("FlagEmbedding"), "transformers": metadata.version("transformers"),
            "torch": metadata.version("torch"), "fingerprint": weights_fingerprint(folder),
            "queries": _side(model, QUERIES, queries), "documents": _side(model, DOCUMENTS, documents),
            "colbert_scores": colbert, "lexical_scores": lexical.astype(float).tolist()}


def _side(model, texts: list[str], out: dict) -> dict:
    """One side's texts, token ids and outputs as JSON values (lexical weights keyed by the id as a string)."""
    ids = model.tokenizer(texts, truncation=True, max_length=model.passage_max_length)["input_ids"]
    return {"texts": texts, "input_ids": ids, "dense": out["dense_vecs"].tolist(),
            "lexical_weights": [{key: float(w) for key, w in weights.items()} for weights in out["lexical_weights"]],
            "colbert": [vectors.tolist() for vectors in out["colbert_vecs"]]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="the tiny BGE-M3 folder (tests/helpers/m3_models.py)")
    parser.add_argument("out", type=Path, help="where the JSON is written")
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(reference(args.folder), indent=1) + "\n")


if __name__ == "__main__":
    main()
