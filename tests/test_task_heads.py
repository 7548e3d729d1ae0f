"""The post-processing heads give transformers' pipelines' answers on the same logits and tokens: the
TextClassificationPipeline's score function, the TokenClassificationPipeline's grouping (``simple``), the
QuestionAnsweringPipeline's spans (whole words) and scores ([CLS] in the softmax); and the task parsers refuse
a ``top_k`` that would drop results."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import BertConfig, PreTrainedTokenizerFast

from conftest import TINY_TOKENIZER
from helpers.qa_reference import pipeline_answers
from helpers.tiny_models import COMMON
from nexus_sli.exporter.triton.python_models.encoding import load_tokenizer, to_arrays, windows
from nexus_sli.exporter.triton.python_models.heads import HEADS, MAX_ANSWER_TOKENS, class_scores
from nexus_sli.tasks import get_task
from nexus_sli.tasks.spec import TaskError

QA_ARRAYS = ["offsets", "context_mask", "word_spans"]
CLS = "[CLS]"
NER_ARRAYS = ["attention_mask", "offsets", "special_tokens_mask"]


def _wordpiece() -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_file=str(TINY_TOKENIZER), unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", pad_token="[PAD]", mask_token="[MASK]")


# ------------------------------------------------------------------ classification


def _classifier(num_labels: int, **config) -> transformers.BertForSequenceClassification:
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(BertConfig(**COMMON, num_labels=num_labels, **config)).eval()
    with torch.no_grad():  # scores away from 0 and 1, where every function would look alike
        model.classifier.weight.mul_(20)
    return model


@pytest.mark.parametrize("num_labels, config, function", [
    (3, {"problem_type": "regression"}, "none"),
    (1, {}, "sigmoid"),
    (3, {"problem_type": "multi_label_classification"}, "sigmoid"),
    (3, {}, "softmax"),
    (2, {"problem_type": "single_label_classification"}, "softmax"),
])
def test_classification_scores_are_the_text_classification_pipelines(num_labels, config, function):
    model, tokenizer = _classifier(num_labels, **config), _wordpiece()
    text = "the plan is that they start after the first year"
    params = get_task("classification").post_params(model.config, None)
    assert params["function_to_apply"] == function
    with torch.no_grad():
        logits = model(**tokenizer([text], return_tensors="pt")).logits.numpy()
    served = HEADS["classification"]({"logits": logits}, params)["SCORES"][0]
    expected = transformers.pipeline("text-classification", model=model, tokenizer=tokenizer, top_k=None)(text)
    expected = {row["label"]: row["score"] for row in (expected[0] if isinstance(expected[0], list) else expected)}
    np.testing.assert_allclose(served, [expected[model.config.id2label[i]] for i in range(num_labels)], rtol=1e-5)


def test_repositories_without_the_score_function_keep_their_meaning_and_a_bad_one_is_named():
    logits = np.array([[0.5, -1.0, 2.0]])
    for params, expected in (({"multi_label": "true"}, 1 / (1 + np.exp(-logits))),
                             ({"multi_label": "false"}, np.exp(logits) / np.exp(logits).sum()), ({}, None)):
        expected = np.exp(logits) / np.exp(logits).sum() if expected is None else expected
        # the head and the expectation are numpy's float64 on three logits (no kernel's summation order), apart
        # only by the head's float32 answer: 6e-8 relative at most
        np.testing.assert_allclose(HEADS["classification"]({"logits": logits}, params)["SCORES"], expected, rtol=1e-6)
    with pytest.raises(ValueError, match="unknown score function 'tanh'; known: softmax, sigmoid, none"):
        class_scores(logits, "tanh")


# ------------------------------------------------------------------ token classification


def _pipeline_entities(tokenizer, labels: list[str], text: str, logits: np.ndarray) -> list[tuple]:
    """transformers' TokenClassificationPipeline (``aggregation_strategy="simple"``) on ``logits``."""
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, num_labels=len(labels), id2label=dict(enumerate(labels)),
                        label2id={label: i for i, label in enumerate(labels)})
    pipe = transformers.pipeline("token-classification", model=transformers.BertForTokenClassification(config),
                                 tokenizer=tokenizer, aggregation_strategy="simple")
    encoded = tokenizer(text, return_tensors="pt", return_offsets_mapping=True, return_special_tokens_mask=True)
    outputs = {"logits": torch.tensor(logits)[None], "sentence": text, "input_ids": encoded["input_ids"],
               "offset_mapping": encoded["offset_mapping"], "special_tokens_mask": encoded["special_tokens_mask"]}
    found = pipe.postprocess([outputs], aggregation_strategy="simple")
    return [(e["entity_group"], e["start"], e["end"], float(e["score"])) for e in found]


def _served_entities(tokenizer: Tokenizer, labels: list[str], text: str, logits: np.ndarray) -> list[tuple]:
    encoding = tokenizer.encode(text)
    arrays = to_arrays([encoding], NER_ARRAYS, 0, len(encoding.ids))
    answer = HEADS["token-classification"]({"TEXT": np.array([[text.encode()]], dtype=object),
                                             "logits": logits[None], **arrays},
                                            {"id2label": json.dumps(dict(enumerate(labels)))})
    found = json.loads(answer["ENTITIES"].reshape(-1)[0])
    assert all(e["text"] == text[e["start"]:e["end"]] for e in found)
    return [(e["label"], e["start"], e["end"], e["score"]) for e in found]


def _same_entities(served: list[tuple], expected: list[tuple]) -> None:
    assert [e[:3] for e in served] == [e[:3] for e in expected]
    np.testing.assert_allclose([e[3] for e in served], [e[3] for e in expected], rtol=1e-5)


def _byte_level() -> Tokenizer:
    """A byte-level BPE tokenizer (RoBERTa's kind), whose lone spaces are tokens with empty spans."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(["Anna moved to Berlin last year"] * 50, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0), trim_offsets=True,
                                                            add_prefix_space=False)
    return tokenizer


def test_a_token_with_an_empty_span_counts_and_only_special_tokens_are_skipped():
    tokenizer, labels, text = _byte_level(), ["O", "B-PER", "I-PER"], "Anna  Berlin"
    encoding = tokenizer.encode(text)
    assert [encoding.offsets[i] for i, t in enumerate(encoding.tokens) if t == "Ġ"] == [(5, 5)]  # a real token
    logits = np.full((len(encoding.ids), 3), -4.0, np.float32)
    for position, token in enumerate(encoding.tokens):
        logits[position, {"Anna": 1, "ĠBerlin": 2}.get(token, 0)] = 4.0
    served = _served_entities(tokenizer, labels, text, logits)
    assert [e[:3] for e in served] == [("PER", 0, 4), ("PER", 6, 12)]  # the space's O parts them
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                 unk_token="<unk>", cls_token="<s>", sep_token="</s>")
    _same_entities(served, _pipeline_entities(hf, labels, text, logits))


def test_bioes_and_unprefixed_labels_group_as_the_token_classification_pipeline():
    """transformers reads only B- and I-: ``E-PER`` after ``B-PER`` is a new group, ``S-PER S-PER`` is one,
    and a label without a prefix continues its own kind; random labels over several texts agree too."""
    tokenizer = Tokenizer.from_file(str(TINY_TOKENIZER))
    labels = ["O", "B-PER", "I-PER", "E-PER", "S-PER", "B-LOC", "I-LOC", "MISC", "E-LOC"]
    text = "the plan is that they start after the first year"
    encoding = tokenizer.encode(text)
    wanted = {"plan": "B-PER", "is": "E-PER", "that": "S-PER", "they": "S-PER", "start": "MISC", "after": "MISC",
              "first": "I-LOC", "year": "E-LOC"}
    logits = np.full((len(encoding.ids), len(labels)), -4.0, np.float32)
    for position, token in enumerate(encoding.tokens):
        logits[position, labels.index(wanted.get(token, "O"))] = 4.0
    served = _served_entities(tokenizer, labels, text, logits)
    assert [(label, text[a:b]) for label, a, b, _ in served] == [
        ("PER", "plan"), ("PER", "is"), ("PER", "that they"), ("MISC", "start after"), ("LOC", "first"),
        ("LOC", "year")]
    hf = _wordpiece()
    _same_entities(served, _pipeline_entities(hf, labels, text, logits))
    rng = np.random.default_rng(0)
    for text in ("Anna moved from Paris to Berlin last year.", "the waterproof box, in the cellar, was found"):
        logits = rng.normal(0, 3, (len(tokenizer.encode(text).ids), len(labels))).astype(np.float32)
        _same_entities(_served_entities(tokenizer, labels, text, logits), _pipeline_entities(hf, labels, text, logits))


# ------------------------------------------------------------------ question answering


def _qa(question: str, context: str, marks: dict, max_length: int = 128):
    """The tokenizer step's windows of (question, context), their arrays, and logits of -5 but where ``marks``
    says: (text in the context, piece of it) -> (start logit, end logit) of the context token starting at that
    piece, in the first window holding it; ``CLS`` -> [CLS]'s, in every window."""
    tokenizer = load_tokenizer(str(TINY_TOKENIZER), max_length, True, 32, "only_second")
    encodings = windows(tokenizer, question, context)
    arrays = to_arrays(encodings, QA_ARRAYS, 0, max(len(e.ids) for e in encodings))
    start = np.full(arrays["context_mask"].shape, -5.0, np.float32)
    end = start.copy()
    for mark, logits in marks.items():
        if mark == CLS:
            start[:, 0], end[:, 0] = logits
            continue
        text, piece = mark
        char = context.index(text) + text.index(piece)
        window, position = next((w, p) for w, encoding in enumerate(encodings) for p in range(len(encoding.ids))
                                if arrays["context_mask"][w, p] and arrays["offsets"][w, p, 0] == char)
        start[window, position], end[window, position] = logits
    return encodings, arrays, start, end, tokenizer.token_to_id("[CLS]")


def _answers(context: str, arrays: dict, start, end, **params) -> list[dict]:
    answer = HEADS["question-answering"]({"CONTEXT": np.array([context.encode()], dtype=object),
                                          "start_logits": start, "end_logits": end, **arrays},
                                         {key: json.dumps(value) for key, value in params.items()})
    return json.loads(answer["ANSWERS"].reshape(-1)[0])


def _same_answers(served: list[dict], expected: list[dict], rtol: float = 1e-6) -> None:
    # both sides compute in float64 (numpy, no CPU kernel) from the same float32 logits: the softmax sums
    # differ by their order at most, about 1e-16, so 1e-6 is loose on every CPU
    assert [(a["text"], a["start"], a["end"]) for a in served] == [(a["answer"], a["start"], a["end"])
                                                                   for a in expected]
    np.testing.assert_allclose([a["score"] for a in served], [a["score"] for a in expected], rtol=rtol, atol=1e-12)


def test_answers_cover_the_words_of_their_first_and_last_tokens():
    """A span that starts or ends inside a word (``waterproof``: water ##p ##ro ##o ##f) answers the whole word,
    as the pipeline's ``align_to_words`` does."""
    context = "They searched for hours. In the end they found the waterproof box in the cellar."
    encodings, arrays, start, end, cls = _qa("what did they find?", context, {("waterproof", "ro"): (6, -5),
                                                                                  ("waterproof", "of"): (-5, 6)})
    served = _answers(context, arrays, start, end, top_k=1)
    assert served[0]["text"] == "waterproof" and context[served[0]["start"]:served[0]["end"]] == "waterproof"
    # the pipeline adds the near-zero scores of the word's other token spans ((##ro, ##f) ...): 1e-4 apart
    reference = pipeline_answers(encodings, context, start, end, cls, max_answer_len=MAX_ANSWER_TOKENS)
    _same_answers(served, reference, rtol=1e-4)
    encodings, arrays, start, end, cls = _qa("what did they find?", context, {("waterproof", "p"): (6, -5),
                                                                                  ("box", "o"): (-5, 6)})
    served = _answers(context, arrays, start, end, top_k=1)
    assert served[0]["text"] == "waterproof box"
    reference = pipeline_answers(encodings, context, start, end, cls, max_answer_len=MAX_ANSWER_TOKENS)
    _same_answers(served, reference, rtol=1e-4)


def test_answer_scores_keep_cls_in_the_softmax_and_no_answer_is_an_option():
    """A model that puts its mass on [CLS] ("no answer", SQuAD 2) scores every span low, as the pipeline does;
    ``handle_impossible_answer`` answers the empty span with [CLS]'s score."""
    context = "They searched for hours. In the end they found water in the cellar."  # water: one token
    encodings, arrays, start, end, cls = _qa("what did they find?", context, {("water", "w"): (3, 3), CLS: (8, 8)})
    served = _answers(context, arrays, start, end, top_k=1)
    assert served[0]["text"] == "water" and served[0]["score"] < 1e-3
    _same_answers(served, pipeline_answers(encodings, context, start, end, cls, max_answer_len=MAX_ANSWER_TOKENS))
    impossible = _answers(context, arrays, start, end, top_k=2, handle_impossible_answer=True)
    assert (impossible[0]["text"], impossible[0]["start"], impossible[0]["end"]) == ("", 0, 0)
    assert impossible[0]["score"] > 0.9 and impossible[1] == served[0]
    _same_answers(impossible, pipeline_answers(encodings, context, start, end, cls, top_k=2,
                                               max_answer_len=MAX_ANSWER_TOKENS, handle_impossible_answer=True))


def test_answers_over_windows_keep_each_spans_best_score():
    """A long context's windows are the pipeline's; where two overlapping windows find one span, it keeps its
    best score (the pipeline adds them: a score past 1 is no probability), so the scores are the pipeline's
    wherever a span is found once."""
    context = " ".join(f"word{i}" for i in range(80)) + " in the end they found the waterproof box."
    encodings, arrays, start, end, cls = _qa("what?", context, {("waterproof", "w"): (5, 5)}, max_length=64)
    assert len(encodings) > 2
    served = _answers(context, arrays, start, end, top_k=1)
    assert served[0]["text"] == "waterproof"
    _same_answers(served, pipeline_answers(encodings, context, start, end, cls, max_answer_len=MAX_ANSWER_TOKENS))
    # a word both of the first two windows hold whole: the same span in each
    spans = arrays["word_spans"]
    position = next(p for p in range(len(encodings[1].ids)) if arrays["context_mask"][1, p] and p > 8
                    and any((spans[0] == spans[1, p]).all(axis=-1)) and encodings[1].tokens[p].startswith("##"))
    other = int(np.flatnonzero((spans[0] == spans[1, position]).all(axis=-1))[0])
    start[:], end[:] = -5.0, -5.0
    start[0, other] = end[0, other] = 5.0
    start[1, position] = end[1, position] = 6.0
    served = _answers(context, arrays, start, end, top_k=1)
    expected = pipeline_answers(encodings, context, start, end, cls, max_answer_len=MAX_ANSWER_TOKENS)
    assert (served[0]["start"], served[0]["end"]) == (expected[0]["start"], expected[0]["end"])
    assert served[0]["score"] <= 1.0 < expected[0]["score"]


@pytest.mark.parametrize("filler", [0, 80], ids=["one window", "two windows"])
def test_answers_of_one_text_at_two_places_are_one_answer_as_the_pipelines(filler):
    """The same text at two places (here in other cases: ``Water``, ``water``) is one answer, as transformers'
    pipeline merges them (by lower-cased text, over all windows), not two taking two places of ``top_k``: the
    best-scoring place, with its score (the pipeline adds them)."""
    context = " ".join(["Water was what they found in the cellar."] + [f"word{i}" for i in range(filler)]
                       + ["Later they found water in the attic too."])
    marks = {("Water was", "Water"): (4, 4), ("found water", "water"): (3.9, 3.9)}
    encodings, arrays, start, end, cls = _qa("what did they find?", context, marks, max_length=64)
    assert (len(encodings) > 1) == (filler > 0)
    served = _answers(context, arrays, start, end, top_k=3)
    expected = pipeline_answers(encodings, context, start, end, cls, top_k=3, max_answer_len=MAX_ANSWER_TOKENS)
    assert [a["text"].lower() for a in served].count("water") == 1 == [a["answer"].lower() for a in expected
                                                                        ].count("water")
    assert (served[0]["text"], served[0]["start"]) == ("Water", 0) == (expected[0]["answer"], expected[0]["start"])
    assert served[0]["score"] <= 1.0


def test_the_best_span_is_found_whatever_the_ranks_of_its_start_and_end():
    """The pipeline scores every (start, end) pair: the best span is found even where its start is not among the
    best starts (each of those has its best end far before it) nor its end among the best ends."""
    context = " ".join(f"word{i}" for i in range(60))
    marks = {(f"word{i}", "w"): (4.0, -5.0) for i in range(40, 60)}  # many strong starts, all after every end
    marks.update({(f"word{i}", "w"): (-5.0, 4.0) for i in range(0, 20)})  # many strong ends, before every start
    marks[("word25", "w")] = (3.0, -5.0)  # a weaker start and end a few words apart: the only valid strong pair
    marks[("word27", "w")] = (-5.0, 3.0)
    encodings, arrays, start, end, cls = _qa("which?", context, marks, max_length=256)
    assert len(encodings) == 1
    served = _answers(context, arrays, start, end, top_k=1)
    assert served[0]["text"] == "word25 word26 word27"
    _same_answers(served, pipeline_answers(encodings, context, start, end, cls, max_answer_len=MAX_ANSWER_TOKENS))


# ------------------------------------------------------------------ rerank


@pytest.mark.parametrize("named, function", [
    ({}, "sigmoid"),  # a config that names none: CrossEncoder's default for one label
    ({"sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}}, "none"),
    ({"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Sigmoid"}}, "sigmoid"),
    ({"sbert_ce_default_activation_function": "torch.nn.modules.linear.Identity"}, "none"),  # before its v4
    ({"sentence_transformers": {"activation_fn": "mypackage.Scale"}}, "sigmoid"),  # not imported: the default
])
def test_rerank_scores_are_the_cross_encoders(tmp_path, named, function):
    from sentence_transformers import CrossEncoder

    model, tokenizer = _classifier(1), _wordpiece()
    for key, value in named.items():
        setattr(model.config, key, value)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    params = get_task("rerank").post_params(model.config, None)
    assert params["function_to_apply"] == function
    pairs = [("what did they find", "it was water, in the cellar"), ("what did they find", "a plan")]
    with torch.no_grad():
        logits = model(**tokenizer([q for q, _ in pairs], [d for _, d in pairs], return_tensors="pt",
                                   padding=True)).logits.numpy()
    served = HEADS["rerank"]({"logits": logits}, params)["SCORES"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the untrusted activation's warning
        expected = CrossEncoder(str(tmp_path), device="cpu").predict(pairs)
    np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-6)


def test_a_cross_encoder_activation_the_head_does_not_apply_is_refused():
    model = _classifier(1)
    model.config.sentence_transformers = {"activation_fn": "torch.nn.modules.activation.Tanh"}
    with pytest.raises(TaskError, match="names the activation torch.nn.modules.activation.Tanh"):
        get_task("rerank").post_params(model.config, None)


# ------------------------------------------------------------------ top_k


@pytest.mark.parametrize("top_k", [0, -1, 1.5, True, "2"])
def test_a_top_k_that_would_drop_results_is_refused_by_every_task(top_k):
    scores = np.array([[0.2, 0.7, 0.1]], np.float32)
    answers = np.array([json.dumps([{"text": "a", "start": 0, "end": 1, "score": 0.5}]).encode()], dtype=object)
    calls = [lambda: get_task("classification").parse([scores], {}, top_k),
             lambda: get_task("rerank").parse([scores[0]], ["a", "b", "c"], top_k),
             lambda: get_task("question-answering").parse([answers], top_k)]
    for call in calls:
        with pytest.raises(ValueError, match=rf"top_k must be a positive integer or None .*got {top_k!r}"):
            call()


def test_top_k_none_or_positive_keeps_that_many():
    scores = np.array([[0.2, 0.7, 0.1]], np.float32)
    assert [label.label for label in get_task("classification").parse([scores], {1: "b"}, None)[0]] == ["b", "0", "2"]
    assert len(get_task("classification").parse([scores], {}, 2)[0]) == 2
    assert [r.index for r in get_task("rerank").parse([scores[0]], ["a", "b", "c"], 1)] == [1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        answers = np.array([json.dumps([{"text": "a", "start": 0, "end": 1, "score": 0.5}] * 3).encode()], dtype=object)
        assert len(get_task("question-answering").parse([answers], None)) == 3
