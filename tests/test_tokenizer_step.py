"""The tokenizer step tokenizes an execution's texts in one call and answers each request its own rows: as
tokenized alone, with its own prompt, and its own error (a text past the limit, bytes that are no UTF-8)
for it alone.  The exported step is loaded as Triton's python backend loads it, from its folder, with the
C++ side of ``triton_python_backend_utils`` (tensors, responses) replaced by plain records."""

from __future__ import annotations

import pytest

from helpers.python_steps import load_step, unload
from nexus_sli.bench.joined_profile import TextRequest
from nexus_sli.exporter.serving.joined_steps import triton_json
from nexus_sli.exporter.triton import config as tc


@pytest.fixture
def strict_step(exports, tmp_path, monkeypatch):
    """The tokenizer step of the packaged model exported with truncation off, its ``_encode`` calls counted."""
    folder = exports.copy("minilm_strict", tmp_path, as_name="strict") / "strict_tokenizer"
    step = load_step(monkeypatch, folder / "1", "strict_tokenizer_model",
                     triton_json(tc.read(folder / "config.pbtxt")), folder)
    calls = []
    encode = step._encode
    monkeypatch.setattr(step, "_encode",
                        lambda tokenizer, texts, limit: calls.append(len(texts)) or encode(tokenizer, texts, limit))
    yield step, calls
    unload()


def _rows(answer) -> list[list[int]]:
    ids, mask = answer.tensors["input_ids"], answer.tensors["attention_mask"]
    return [row[:int(m.sum())].tolist() for row, m in zip(ids, mask)]


def test_an_executions_requests_of_several_texts_are_tokenized_in_one_call_each_answered_its_own(strict_step):
    step, calls = strict_step
    requests = [TextRequest(["a short text", "another, a little longer, text"]), TextRequest(["fine", "word " * 300]),
                TextRequest([b"\xc3\x28", "fine"]), TextRequest(["the third", "good request", "of three"]),
                TextRequest(["one text alone"]), TextRequest([])]
    together = step.execute(requests)
    # the texts of the requests of several texts that decode in one call (the one past the limit is refused
    # after it), then each request of one text or none alone
    assert calls == [7, 1, 0]
    assert "text 1 has 302 tokens" in together[1].error and "not valid UTF-8" in together[2].error
    for number in (0, 3, 4, 5):
        calls.clear()
        (alone,) = step.execute([requests[number]])
        assert together[number].error is None and calls == [len(requests[number].texts)]
        assert _rows(together[number]) == _rows(alone)  # the same tokens, whatever the width they share
        assert (together[number].tensors["TOKEN_COUNT"] == alone.tensors["TOKEN_COUNT"]).all()
    widths = {together[n].tensors["input_ids"].shape[1] for n in (0, 3, 4)}
    assert len(widths) == 1  # one width for the execution, so the encoder merges them


def test_a_call_that_fails_is_retried_request_by_request(strict_step, monkeypatch):
    """Where the one call raises (tokenizers' Rust panics are BaseExceptions), each request is tokenized alone,
    so that only the request whose text fails it is answered an error."""
    step, calls = strict_step
    encode = step._encode

    def failing(tokenizer, texts, limit):
        if any("panic" in text for text in texts):
            raise BaseException("a Rust panic")  # noqa: TRY002 - what pyo3's PanicException derives from
        return encode(tokenizer, texts, limit)

    monkeypatch.setattr(step, "_encode", failing)
    good, bad = step.execute([TextRequest(["fine", "also fine"]), TextRequest(["fine", "panic here"])])
    assert good.error is None and [row[0] for row in _rows(good)] == [101, 101]  # [CLS] first
    assert "could not be tokenized" in bad.error and "a Rust panic" in bad.error


def test_a_request_whose_arrays_cannot_be_built_fails_alone(strict_step, monkeypatch):
    step, _ = strict_step
    tensors = step._tensors

    def failing(encodings, side, length):
        if any(len(encoding.ids) > 5 for encoding in encodings):  # the longer text's: 6 tokens
            raise ValueError("this request's arrays")
        return tensors(encodings, side, length)

    monkeypatch.setattr(step, "_tensors", failing)
    good, bad = step.execute([TextRequest(["a text"]), TextRequest(["a text a little longer"])])
    assert good.error is None and _rows(good)
    assert bad.error is not None and "this request's arrays" in bad.error
