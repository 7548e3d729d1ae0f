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
    from nexus_sli.tasks.model_parameters import (ID2LABEL, IMPOSSIBLE_ANSWER, MULTI_LABEL, NORMALIZE, POOLING,
                                                  SCORE_FUNCTION, SPLADE_ACTIVATION, SPLADE_POOLING, TOP_K)

    from .encoding import l2_normalize, pool, splade
else:  # a file copied beside model.py in a Triton repository
    from encoding import l2_normalize, pool, splade
    from model_parameters import (ID2LABEL, IMPOSSIBLE_ANSWER, MULTI_LABEL, NORMALIZE, POOLING, SCORE_FUNCTION,
                                  SPLADE_ACTIVATION, SPLADE_POOLING, TOP_K)

#: Longest answer span considered, in tokens: transformers' run_qa.py's default ``max_answer_length``
#: (its QuestionAnsweringPipeline's ``max_answer_len`` defaults to 15).
MAX_ANSWER_TOKENS = 30
#: The best-scoring (start, end) pairs of a window kept as candidates, out of every pair the pipeline scores
SPAN_CANDIDATES = 400
#: Answers the server returns per question (clients keep their ``top_k``).
TOP_ANSWERS = 20


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    x = x - x.max(axis=axis, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=axis, keepdims=True)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


#: How a classifier's logits become scores, transformers' TextClassificationPipeline's ``function_to_apply``.
SCORE_FUNCTIONS = {"softmax": softmax, "sigmoid": sigmoid, "none": lambda logits: logits}


def class_scores(logits: np.ndarray, function: str) -> np.ndarray:
    """Scores per label by ``function`` (:data:`SCORE_FUNCTIONS`): one softmax, independent sigmoids, or the
    raw values (regression)."""
    if function not in SCORE_FUNCTIONS:
        raise ValueError(f"unknown score function {function!r}; known: {', '.join(SCORE_FUNCTIONS)}")
    return SCORE_FUNCTIONS[function](logits)


def _score_function(params: dict) -> str:
    """The classification step's score function; a repository written before the parameter existed says
    only whether its labels are independent (sigmoid) or not (softmax)."""
    return SCORE_FUNCTION.read(params, None) or ("sigmoid" if MULTI_LABEL.read(params, False) else "softmax")


def _tag(label: str) -> tuple[str, str]:
    """transformers' ``TokenClassificationPipeline.get_tag``: ('B', 'PER') for 'B-PER', ('I', 'PER') for
    'I-PER'; any other label is the whole type, read as a continuation: ('I', 'E-PER'), ('I', 'O')."""
    if label.startswith(("B-", "I-")):
        return label[0], label[2:]
    return "I", label


def entities(text: str, logits: np.ndarray, offsets: np.ndarray, mask: np.ndarray, id2label: dict) -> list[dict]:
    """Token labels grouped into entities with character offsets into ``text``, as transformers'
    TokenClassificationPipeline groups them with ``aggregation_strategy="simple"``.

    ``mask``: 1 for the tokens that count (real, not special; a token with an empty span counts).  A token
    joins the previous token's group where its tag (:func:`_tag`) is that group's and it is no ``B-``; a
    group's label is its first token's after the first ``-`` (``E-PER`` -> ``PER``), groups labelled ``O``
    are dropped, and a group's score is the mean of its tokens' top probabilities.
    """
    probs = softmax(logits.astype(np.float64))
    groups: list[list[tuple[str, int, int, float]]] = []
    last_tag = None
    for position in np.flatnonzero(np.asarray(mask).astype(bool)):
        label_id = int(probs[position].argmax())
        label = str(id2label.get(label_id, id2label.get(str(label_id), label_id)))
        prefix, tag = _tag(label)
        start, end = (int(v) for v in offsets[position])
        if not groups or tag != last_tag or prefix == "B":
            groups.append([])
        groups[-1].append((label, start, end, float(probs[position, label_id])))
        last_tag = tag
    found = []
    for group in groups:
        label, start, end = group[0][0].split("-", 1)[-1], group[0][1], group[-1][2]
        if label != "O":
            found.append({"text": text[start:end], "label": label, "start": start, "end": end,
                          "score": float(np.mean([score for *_, score in group]))})
    return found


def answer_spans(context: str, start_logits: np.ndarray, end_logits: np.ndarray, offsets: np.ndarray,
                 context_mask: np.ndarray, top_k: int, word_spans: np.ndarray | None = None,
                 impossible: bool = False) -> list[dict]:
    """Best answer spans over all windows of one (question, context) pair, as transformers'
    QuestionAnsweringPipeline scores them.

    Per window, start and end probabilities are a softmax over the context tokens and the first token
    where it is a special one ([CLS]: "no answer"), whose probability is then set to 0; a span's score is
    p(start) * p(end), the end not before the start and at most MAX_ANSWER_TOKENS long.  A span covers
    its tokens' words (``word_spans``, the pipeline's ``align_to_words``; None: the tokens' own
    ``offsets``).  Spans of one text, case aside, are one answer, as the pipeline merges them, over all
    windows: the best-scoring span with its score.  The pipeline adds their scores instead, so a short text
    repeated over a long context's many windows can outscore the answer, and a score past 1 is no probability.
    ``impossible``: the pipeline's ``handle_impossible_answer``, the empty answer (0, 0) scored by the
    least p([CLS] start) * p([CLS] end) over the windows.
    """
    spans = offsets if word_spans is None else word_spans
    best: dict[str, tuple[float, int, int]] = {}  # lower-cased text -> its best (score, start, end)
    null = None
    for window in range(start_logits.shape[0]):
        in_context = context_mask[window].astype(bool)
        if not in_context.any():
            continue
        cls = not in_context[0] and not offsets[window, 0].any()  # a special first token: (0, 0), no context
        kept = in_context.copy()
        kept[0] |= cls
        p_start = softmax(np.where(kept, start_logits[window], -np.inf).astype(np.float64))
        p_end = softmax(np.where(kept, end_logits[window], -np.inf).astype(np.float64))
        if cls:
            score = float(p_start[0] * p_end[0])
            null = score if null is None else min(null, score)
            p_start[0] = p_end[0] = 0.0
        starts, ends = _answer_pairs(in_context)
        scores = p_start[starts] * p_end[ends]
        for pair in np.argsort(-scores, kind="stable")[:SPAN_CANDIDATES]:
            a, b, score = int(spans[window, starts[pair], 0]), int(spans[window, ends[pair], 1]), float(scores[pair])
            key = context[a:b].lower()
            if score > best.get(key, (-1.0,))[0]:
                best[key] = (score, a, b)
    ranked = list(best.values())
    if impossible and null is not None:  # never one with a text's answer: it has none
        ranked.append((null, 0, 0))
    ranked.sort(key=lambda found: -found[0])
    return [{"text": context[a:b], "start": a, "end": b, "score": score} for score, a, b in ranked[:top_k]]


def _answer_pairs(in_context: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every (start, end) of context tokens a span may have: the end not before the start, at most
    MAX_ANSWER_TOKENS long (a band of the pipeline's start-by-end grid, which it scores whole)."""
    tokens = np.flatnonzero(in_context)
    starts = np.repeat(tokens, MAX_ANSWER_TOKENS)
    ends = starts + np.tile(np.arange(MAX_ANSWER_TOKENS), len(tokens))
    inside = ends < len(in_context)
    starts, ends = starts[inside], ends[inside]
    answerable = in_context[ends]
    return starts[answerable], ends[answerable]


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
    scores = class_scores(x["logits"].astype(np.float64), _score_function(params))
    return {"SCORES": scores.astype(np.float32)}


def rerank_head(x: dict, params: dict) -> dict:
    """The cross-encoder's logit through its activation (a repository written before the parameter: a sigmoid)."""
    function = SCORE_FUNCTION.read(params, None) or "sigmoid"
    return {"SCORES": class_scores(x["logits"].astype(np.float64)[:, 0], function).astype(np.float32)}


def token_classification_head(x: dict, params: dict) -> dict:
    id2label = ID2LABEL.read(params, {})
    texts = [t.decode("utf-8", "replace") for t in x["TEXT"].reshape(-1)]
    counted = x["attention_mask"].astype(bool) & ~x["special_tokens_mask"].astype(bool)
    found = [entities(text, x["logits"][i], x["offsets"][i], counted[i], id2label) for i, text in enumerate(texts)]
    return {"ENTITIES": _json_strings(found).reshape(-1, 1)}


def question_answering_head(x: dict, params: dict) -> dict:
    context = x["CONTEXT"].reshape(-1)[0].decode("utf-8", "replace")
    spans = answer_spans(context, x["start_logits"], x["end_logits"], x["offsets"], x["context_mask"],
                         TOP_K.read(params, TOP_ANSWERS), x["word_spans"], IMPOSSIBLE_ANSWER.read(params, False))
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
