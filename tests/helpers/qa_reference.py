"""transformers' QuestionAnsweringPipeline (v4.53, fast tokenizer, question first) from the model's logits to its
answers: the reference the question-answering head is checked against.  transformers 5 dropped that pipeline,
so its post-processing is transcribed here (``select_starts_ends``, ``decode_spans`` and ``postprocess``), on the
tokenizer step's own windows (the pipeline's encodings, made with the same truncation and stride)."""

from __future__ import annotations

import numpy as np


def _decode_spans(start, end, top_k, max_answer_len, undesired):
    outer = np.matmul(start[:, :, None], end[:, None, :])
    candidates = np.tril(np.triu(outer), max_answer_len - 1)
    flat = candidates.flatten()
    if top_k == 1:
        order = [np.argmax(flat)]
    elif len(flat) < top_k:
        order = np.argsort(-flat)
    else:
        best = np.argpartition(-flat, top_k)[0:top_k]
        order = best[np.argsort(-flat[best])]
    starts, ends = np.unravel_index(order, candidates.shape)[1:]
    wanted = np.isin(starts, undesired.nonzero()) & np.isin(ends, undesired.nonzero())
    starts, ends = starts[wanted], ends[wanted]
    return starts, ends, candidates[0, starts, ends]


def _select_starts_ends(start, end, p_mask, min_null_score, top_k, impossible, max_answer_len):
    undesired = np.abs(np.array(p_mask) - 1)  # 1 where a token may be part of an answer (the context, [CLS])
    masked = undesired == 0
    start, end = np.where(masked, -10000.0, start), np.where(masked, -10000.0, end)
    start = np.exp(start - start.max(axis=-1, keepdims=True))
    start = start / start.sum()
    end = np.exp(end - end.max(axis=-1, keepdims=True))
    end = end / end.sum()
    if impossible:
        min_null_score = min(min_null_score, (start[0, 0] * end[0, 0]).item())
    start[0, 0] = end[0, 0] = 0.0  # [CLS] is no span
    return (*_decode_spans(start, end, top_k, max_answer_len, undesired), min_null_score)


def pipeline_answers(encodings, context: str, start_logits, end_logits, cls_id: int, top_k: int = 1,
                     max_answer_len: int = 15, handle_impossible_answer: bool = False,
                     align_to_words: bool = True) -> list[dict]:
    """The pipeline's answers, ``{"score", "start", "end", "answer"}``, best first, for the windows
    ``encodings`` and their logits ``[windows, width]``."""
    min_null_score, answers = 1000000, []
    for window, encoding in enumerate(encodings):
        n = len(encoding.ids)
        p_mask = [0 if encoding.ids[i] == cls_id else int(sid != 1) for i, sid in enumerate(encoding.sequence_ids)]
        start, end = (logits[window:window + 1, :n].astype(np.float64) for logits in (start_logits, end_logits))
        starts, ends, scores, min_null_score = _select_starts_ends(
            start, end, np.array([p_mask]), min_null_score, top_k * 2 + 10 if align_to_words else top_k,
            handle_impossible_answer, max_answer_len)
        for s, e, score in zip(starts, ends, scores):
            a, b = encoding.offsets[s][0], encoding.offsets[e][1]
            if align_to_words:
                try:
                    a, b = (encoding.word_to_chars(encoding.token_to_word(s), sequence_index=1)[0],
                            encoding.word_to_chars(encoding.token_to_word(e), sequence_index=1)[1])
                except Exception:  # noqa: BLE001, S110 - the pipeline falls back to the tokens' own offsets
                    pass
            text = context[a:b]
            same = next((answer for answer in answers if answer["answer"].lower() == text.lower()), None)
            if same:  # the pipeline adds the scores of answers of one text
                same["score"] += score.item()
            else:
                answers.append({"score": score.item(), "start": a, "end": b, "answer": text})
    if handle_impossible_answer:
        answers.append({"score": min_null_score, "start": 0, "end": 0, "answer": ""})
    return sorted(answers, key=lambda answer: answer["score"], reverse=True)[:top_k]
