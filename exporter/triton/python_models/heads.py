"""What each task makes of the encoder's outputs: numpy only.

:data:`HEADS` holds one function per task spec's ``head`` (:mod:`nexus_sli.tasks`):
the post-processing model calls it with the request's inputs and its config
parameters.  The same functions run, on PyTorch's logits, in the tests'
reference pipeline, so both sides agree on what a label, an entity or an answer
span is.
"""

from __future__ import annotations

import json

import numpy as np

if __package__:  # imported from the nexus_sli package (validation, tests)
    from nexus_sli.tasks.model_parameters import (ID2LABEL, MULTI_LABEL, NORMALIZE, POOLING, SPLADE_ACTIVATION,
                                                  SPLADE_POOLING, TOP_K)

    from .encoding import l2_normalize, pool, splade
else:  # a file copied beside model.py in a Triton repository
    from encoding import l2_normalize, pool, splade
    from model_parameters import ID2LABEL, MULTI_LABEL, NORMALIZE, POOLING, SPLADE_ACTIVATION, SPLADE_POOLING, TOP_K

#: Longest answer span considered, in tokens (as transformers' QA pipeline).
MAX_ANSWER_TOKENS = 30
#: Best start/end candidates tried per window.
SPAN_CANDIDATES = 20
#: Answers the server returns per question (clients keep their ``top_k``).
TOP_ANSWERS = 20


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    x = x - x.max(axis=axis, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=axis, keepdims=True)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def class_scores(logits: np.ndarray, multi_label: bool) -> np.ndarray:
    """Probabilities per label: softmax, or independent sigmoids for multi-label models."""
    return sigmoid(logits) if multi_label else softmax(logits)


def _entity_type(label: str) -> tuple[str, str]:
    """('B', 'PER') for 'B-PER'; ('', 'PER') for a label without a B-/I- prefix."""
    if len(label) > 2 and label[1] == "-" and label[0] in "BIES":
        return label[0], label[2:]
    return "", label


def entities(text: str, logits: np.ndarray, offsets: np.ndarray, mask: np.ndarray, id2label: dict) -> list[dict]:
    """Token labels grouped into entities (B-/I- scheme) with character offsets into ``text``.

    A token starts a new entity on ``B-X``, or on ``I-X`` when the previous token
    was not of type X; the score is the mean of its tokens' top probabilities.
    Special and padding tokens (offsets (0, 0)) are skipped.
    """
    probs = softmax(logits.astype(np.float64))
    found, current = [], None
    for position in range(len(mask)):
        start, end = (int(v) for v in offsets[position])
        if not mask[position] or start == end:
            continue
        label_id = int(probs[position].argmax())
        prefix, kind = _entity_type(str(id2label.get(label_id, id2label.get(str(label_id), label_id))))
        score = float(probs[position, label_id])
        if kind == "O":
            current = None
            continue
        if current is not None and current["label"] == kind and prefix != "B":
            current["end"], current["scores"] = end, current["scores"] + [score]
            continue
        current = {"label": kind, "start": start, "end": end, "scores": [score]}
        found.append(current)
    return [{"text": text[e["start"]:e["end"]], "label": e["label"], "start": e["start"], "end": e["end"],
             "score": float(np.mean(e["scores"]))} for e in found]


def answer_spans(context: str, start_logits: np.ndarray, end_logits: np.ndarray, offsets: np.ndarray,
                 context_mask: np.ndarray, top_k: int) -> list[dict]:
    """Best answer spans over all windows of one (question, context) pair.

    Per window, start and end probabilities are a softmax over the context
    tokens; a span's score is p(start) * p(end), the end not before the start
    and at most MAX_ANSWER_TOKENS long.  The best spans over every window win.
    """
    best: dict[tuple[int, int], float] = {}
    for window in range(start_logits.shape[0]):
        in_context = context_mask[window].astype(bool)
        if not in_context.any():
            continue
        p_start = softmax(np.where(in_context, start_logits[window], -np.inf).astype(np.float64))
        p_end = softmax(np.where(in_context, end_logits[window], -np.inf).astype(np.float64))
        starts = np.argsort(p_start)[::-1][:SPAN_CANDIDATES]
        ends = np.argsort(p_end)[::-1][:SPAN_CANDIDATES]
        for s in starts:
            for e in ends:
                if not (in_context[s] and in_context[e]) or e < s or e - s + 1 > MAX_ANSWER_TOKENS:
                    continue
                span = (int(offsets[window, s, 0]), int(offsets[window, e, 1]))
                best[span] = max(best.get(span, 0.0), float(p_start[s] * p_end[e]))
    ranked = sorted(best.items(), key=lambda item: -item[1])[:top_k]
    return [{"text": context[a:b], "start": a, "end": b, "score": score} for (a, b), score in ranked]


def _json_strings(items) -> np.ndarray:
    return np.array([json.dumps(item).encode("utf-8") for item in items], dtype=object)


def embedding_head(x: dict, params: dict) -> dict:
    vectors = pool(x["last_hidden_state"], x["attention_mask"], POOLING.read(params))
    if NORMALIZE.read(params, False):
        vectors = l2_normalize(vectors)
    return {"EMBEDDING": vectors.astype(np.float32)}


def sparse_embedding_head(x: dict, params: dict) -> dict:
    vectors = splade(x["logits"], x["attention_mask"], SPLADE_POOLING.read(params), SPLADE_ACTIVATION.read(params))
    return {"SPARSE_EMBEDDING": vectors.astype(np.float32)}


def multi_vector_head(x: dict, params: dict) -> dict:
    """Each token's state, normalised, zero off the scoring mask: the late-interaction answer without the
    model's projection.  Exports put the whole head in the encoder graph (``export/pooling.py``), whose
    padding trim alone keeps the scored positions the encoder does not attend to."""
    vectors = x["last_hidden_state"].astype(np.float32)
    if NORMALIZE.read(params, False):
        vectors = l2_normalize(vectors)
    mask = x["score_mask"][:, :vectors.shape[1], None].astype(np.float32)
    return {"MULTI_VECTOR": (vectors * mask).astype(np.float32)}


def bge_m3_head(x: dict, params: dict) -> dict:
    """BGE-M3's heads run inside the encoder graph (``export/m3_heads.py``); this step has no copy of their
    weights, and an export never writes a BGE-M3 ensemble with a post-processing step."""
    raise ValueError("BGE-M3's outputs come from its encoder graph: export the model with the heads in the graph")


def classification_head(x: dict, params: dict) -> dict:
    scores = class_scores(x["logits"].astype(np.float64), MULTI_LABEL.read(params, False))
    return {"SCORES": scores.astype(np.float32)}


def rerank_head(x: dict, params: dict) -> dict:
    return {"SCORES": sigmoid(x["logits"].astype(np.float64)[:, 0]).astype(np.float32)}


def token_classification_head(x: dict, params: dict) -> dict:
    id2label = ID2LABEL.read(params, {})
    texts = [t.decode("utf-8", "replace") for t in x["TEXT"].reshape(-1)]
    found = [entities(text, x["logits"][i], x["offsets"][i], x["attention_mask"][i], id2label)
             for i, text in enumerate(texts)]
    return {"ENTITIES": _json_strings(found).reshape(-1, 1)}


def question_answering_head(x: dict, params: dict) -> dict:
    context = x["CONTEXT"].reshape(-1)[0].decode("utf-8", "replace")
    spans = answer_spans(context, x["start_logits"], x["end_logits"], x["offsets"], x["context_mask"],
                         TOP_K.read(params, TOP_ANSWERS))
    return {"ANSWERS": _json_strings([spans])}


#: head name (a task spec's ``head``) -> function(inputs by name, config parameters) -> outputs by name
HEADS = {
    "embedding": embedding_head,
    "classification": classification_head,
    "rerank": rerank_head,
    "token-classification": token_classification_head,
    "question-answering": question_answering_head,
    "sparse-embedding": sparse_embedding_head,
    "multi-vector": multi_vector_head,
    "bge-m3": bge_m3_head,
}
