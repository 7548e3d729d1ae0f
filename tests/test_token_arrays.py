"""The encoder's token arrays (``encoding.to_arrays``) hold each encoding's own values row by row, padded past
its tokens: single texts and (question, context) pairs of every length, a batch of one, every input."""

from __future__ import annotations

import numpy as np
import pytest

from nexus_sli.bench.stack_ceiling import packaged_tokenizer
from nexus_sli.exporter.export.validate import validation_texts
from nexus_sli.exporter.triton.python_models.encoding import load_tokenizer, to_arrays

NAMES = ["input_ids", "attention_mask", "token_type_ids", "offsets", "context_mask", "word_spans",
         "special_tokens_mask"]
PAD = 7


def _word_span(encoding, position: int) -> tuple[int, int]:
    """transformers' QuestionAnsweringPipeline's answer bound at a context token (``align_to_words``): its
    word's characters, else (no word) its own."""
    try:
        return encoding.word_to_chars(encoding.token_to_word(position), sequence_index=1)
    except Exception:  # noqa: BLE001 - as the pipeline falls back
        return encoding.offsets[position]


def _expected_row(encoding, name: str, width: int) -> np.ndarray:
    """One row as the encoding gives it, padding after it: what a row-by-row copy writes."""
    n = len(encoding.ids)
    if name in ("offsets", "word_spans"):
        row = np.zeros((width, 2), dtype=np.int64)
        row[:n] = ([(0, 0) if sid is None else span for sid, span in zip(encoding.sequence_ids, encoding.offsets)]
                   if name == "offsets" else
                   [_word_span(encoding, i) if sid == 1 else (0, 0) for i, sid in enumerate(encoding.sequence_ids)])
        return row
    values = {"input_ids": encoding.ids, "attention_mask": [1] * n, "token_type_ids": encoding.type_ids,
              "context_mask": [int(sid == 1) for sid in encoding.sequence_ids],
              "special_tokens_mask": encoding.special_tokens_mask}[name]
    return np.array(list(values) + [PAD if name == "input_ids" else 0] * (width - n), dtype=np.int64)


@pytest.mark.parametrize("pairs", [False, True])
@pytest.mark.parametrize("rows", [1, 37])
def test_each_row_holds_its_encodings_values_then_padding(pairs, rows):
    tokenizer = load_tokenizer(str(packaged_tokenizer()), 128)
    texts = validation_texts()
    items = [(texts[i], texts[i + 50]) for i in range(rows)] if pairs else texts[:rows]
    encodings = tokenizer.encode_batch(items)
    width = max(len(e.ids) for e in encodings) + 5
    arrays = to_arrays(encodings, NAMES, PAD, width)
    assert list(arrays) == NAMES
    for name in NAMES:
        assert arrays[name].dtype == np.int64
        assert arrays[name].shape[:2] == (rows, width)
        for row, encoding in enumerate(encodings):
            np.testing.assert_array_equal(arrays[name][row], _expected_row(encoding, name, width), err_msg=name)
    if pairs:  # the pairs' second texts are there: type ids and the context mask are not all zero
        assert arrays["token_type_ids"].any() and arrays["context_mask"].any()
        # and some of their words are several tokens, whose spans are the whole word's
        assert (arrays["word_spans"] != arrays["offsets"]).any()
    assert arrays["special_tokens_mask"].sum() == sum(sum(e.special_tokens_mask) for e in encodings)


def test_only_the_inputs_asked_for_are_built_and_an_unknown_one_is_named():
    tokenizer = load_tokenizer(str(packaged_tokenizer()), 128)
    encodings = tokenizer.encode_batch(["one text", "and another one"])
    assert list(to_arrays(encodings, ["attention_mask", "input_ids"], 0, 8)) == ["attention_mask", "input_ids"]
    with pytest.raises(KeyError, match="pixel_values"):
        to_arrays(encodings, ["pixel_values"], 0, 8)


def test_a_text_of_no_tokens_has_no_spans_to_copy():
    """A tokenizer without a template (no [CLS], [SEP]) makes no token of an empty text: its row is padding."""
    tokenizer = load_tokenizer(str(packaged_tokenizer()), 32)
    tokenizer.post_processor = None
    encodings = tokenizer.encode_batch(["", "two words"])
    assert len(encodings[0].ids) == 0
    arrays = to_arrays(encodings, ["input_ids", "attention_mask", "offsets", "special_tokens_mask"], PAD, 4)
    assert arrays["attention_mask"][0].sum() == 0 and not arrays["offsets"][0].any()
    for name in ("input_ids", "attention_mask", "offsets", "special_tokens_mask"):
        np.testing.assert_array_equal(arrays[name][1], _expected_row(encodings[1], name, 4))
    pair = tokenizer.encode_batch([("a question", "")])
    assert not to_arrays(pair, ["word_spans"], PAD, 4)["word_spans"].any()
