"""Every task exported, served by the real Triton server, and called through the client."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from helpers.servers import serving
from helpers.waiting import wait_until
from helpers import task_models
from helpers.exports import MINILM
from nexus_sli.client import (
    AsyncEncoderClient,
    DeadlineExceededError,
    EncoderClient,
    InvalidInputError,
    ModelNotFoundError,
    ServerUnavailableError,
    WrongTaskError,
)
from nexus_sli.client import fan_out
from nexus_sli.exporter.export.pipeline import ExportOptions, run_export
from nexus_sli.exporter.triton.python_models.encoding import load_tokenizer, to_arrays, windows
from nexus_sli.exporter.triton.python_models.heads import answer_spans, class_scores, entities, sigmoid
from nexus_sli.exporter.export.validate import validation_texts
from nexus_sli.bench.served import free_ports

TOPICS = Path(__file__).parent / "data" / "topics.tsv"
TEXTS = validation_texts()[:12]


@pytest.fixture(scope="module")
def topics():
    rows = task_models.read_topics(TOPICS)
    random.Random(0).shuffle(rows)
    held_out = len(rows) // 5
    return rows[held_out:], rows[:held_out]


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_tokenizer, topics, exports):
    root = tmp_path_factory.mktemp("tasks")
    repo = root / "repo"
    checkpoints = {
        "classifier": task_models.classifier(tiny_tokenizer, root / "classifier"),
        "tagger": task_models.tagger(tiny_tokenizer, root / "tagger"),
        "reranker": task_models.reranker(tiny_tokenizer, root / "reranker"),
        "reader": task_models.reader(tiny_tokenizer, root / "reader"),
        "topics": task_models.topic_classifier(root / "topics", topics[0]),
    }
    # the real-weights classifier, the size of the packaged model, as its first graph alone: the tiny ones search
    reports = {name: run_export(ExportOptions(model=str(path), name=name, out=repo, search=name != "topics")).report
               for name, path in checkpoints.items()}
    reports["classifier_int8"] = run_export(ExportOptions(model=str(checkpoints["classifier"]), name="classifier_int8",
                                                          precision="int8", out=repo)).report
    exports.copy(MINILM, repo, as_name="minilm")
    with serving(repo) as server:
        yield {**server, "checkpoints": checkpoints, "reports": reports}


@pytest.fixture(params=["grpc", "http"])
def client(request, served):
    with EncoderClient(served[request.param], protocol=request.param) as c:
        yield c


def _torch(checkpoint: Path, auto_class: str):
    return getattr(transformers, auto_class).from_pretrained(checkpoint, attn_implementation="eager").eval()


def _tokenize(checkpoint: Path, items, names, pairs=False):
    tokenizer = load_tokenizer(str(checkpoint / "tokenizer.json"), 128)
    encodings = tokenizer.encode_batch(items)
    return encodings, to_arrays(encodings, names, 0, max(len(e.ids) for e in encodings))


def test_tasks_are_inferred_and_validated(served):
    reports = served["reports"]
    expected = {"classifier": "classification", "tagger": "token-classification", "reranker": "rerank",
                "reader": "question-answering", "topics": "classification"}
    for name, task in expected.items():
        validation = reports[name].validation
        assert reports[name].task == task and validation.passed, name
        assert validation.agreement == 1.0 and validation.max_abs_diff <= 1e-4
    int8 = reports["classifier_int8"].validation
    assert int8.passed and int8.agreement >= 0.98
    # the agreement above is over real decisions: few are ties PyTorch itself cannot order
    # (the QA reader's flat logits on texts without its marker make 6 of 474 at the time of writing)
    for name in expected:
        validation = reports[name].validation
        assert validation.ties < 0.05 * validation.decisions, (name, validation.ties)


def test_classification_matches_pytorch(client, served):
    checkpoint = served["checkpoints"]["classifier"]
    model = _torch(checkpoint, "AutoModelForSequenceClassification")
    _, arrays = _tokenize(checkpoint, TEXTS, ["input_ids", "attention_mask", "token_type_ids"])
    with torch.no_grad():
        logits = model(**{k: torch.from_numpy(v) for k, v in arrays.items()}).logits.numpy()
    expected = class_scores(logits, "softmax")
    served_labels = client.classify(TEXTS, model="classifier", top_k=3)
    for row, labels in zip(expected, served_labels):
        assert [lab.label for lab in labels] == [model.config.id2label[i] for i in np.argsort(-row)]
        assert np.allclose([lab.score for lab in labels], np.sort(row)[::-1], atol=1e-4)
    single = client.classify(TEXTS[0], model="classifier")
    assert len(single) == 1 and single[0].label == served_labels[0][0].label


def test_real_weights_topic_classifier_is_meaningful_and_agrees(client, served, topics):
    _, held_out = topics
    texts = [text for _, text in held_out]
    model = transformers.BertForSequenceClassification.from_pretrained(served["checkpoints"]["topics"]).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(served["checkpoints"]["topics"])
    with torch.no_grad():
        logits = model(**tokenizer(texts, padding=True, truncation=True, return_tensors="pt")).logits
    expected = [model.config.id2label[int(i)] for i in logits.argmax(-1)]
    served_labels = [labels[0].label for labels in client.classify(texts, model="topics")]
    assert served_labels == expected  # 100% agreement on held-out texts
    accuracy = np.mean([label == truth for label, (truth, _) in zip(served_labels, held_out)])
    assert accuracy >= 0.8, f"held-out accuracy {accuracy:.2f}: the trained head should mean something"


def test_ner_entities_match_pytorch_and_slice_the_text(client, served):
    checkpoint = served["checkpoints"]["tagger"]
    model = _torch(checkpoint, "AutoModelForTokenClassification")
    names = ["input_ids", "attention_mask", "token_type_ids", "offsets", "special_tokens_mask"]
    _, arrays = _tokenize(checkpoint, TEXTS, names)
    with torch.no_grad():
        logits = model(**{k: torch.from_numpy(arrays[k]) for k in names[:3]}).logits.numpy()
    counted = arrays["attention_mask"].astype(bool) & ~arrays["special_tokens_mask"].astype(bool)
    served_entities = client.ner(TEXTS, model="tagger")
    assert sum(len(found) for found in served_entities) > 0
    for i, (text, found) in enumerate(zip(TEXTS, served_entities)):
        reference = entities(text, logits[i], arrays["offsets"][i], counted[i], model.config.id2label)
        assert [(e.label, e.start, e.end) for e in found] == [(e["label"], e["start"], e["end"]) for e in reference]
        for entity in found:
            assert entity.text == text[entity.start:entity.end] and entity.label in {"PER", "LOC"}


def test_rerank_matches_pytorch(client, served):
    checkpoint = served["checkpoints"]["reranker"]
    model = _torch(checkpoint, "AutoModelForSequenceClassification")
    query, documents = TEXTS[0], TEXTS[1:]
    _, arrays = _tokenize(checkpoint, [(query, d) for d in documents], ["input_ids", "attention_mask"])
    with torch.no_grad():
        scores = sigmoid(model(**{k: torch.from_numpy(v) for k, v in arrays.items()}).logits.numpy()[:, 0])
    ranked = client.rerank(query, documents, model="reranker")
    assert [r.index for r in ranked] == list(np.argsort(-scores))
    assert np.allclose([r.score for r in ranked], np.sort(scores)[::-1], atol=1e-4)
    assert all(r.document == documents[r.index] for r in ranked)
    assert len(client.rerank(query, documents, model="reranker", top_k=2)) == 2


def test_answer_spans_slice_the_context_and_long_contexts_are_windowed(client, served):
    marker = task_models.QA_MARKER
    filler = "the plan is that they start after the first year and more time is over. "
    context = filler * 60 + f"in the end it was {marker} that they found. " + filler
    tokenizer = load_tokenizer(str(served["checkpoints"]["reader"] / "tokenizer.json"), 128, truncate=False)
    assert len(tokenizer.encode(context).ids) > 5 * 128  # 5x the model's limit
    answers = client.answer("what did they find?", context, model="reader", top_k=3)
    best = answers[0]
    assert best.text == marker == context[best.start:best.end]
    assert best.start > 0.8 * len(context)  # found near the end, past many windows
    assert all(a.text == context[a.start:a.end] for a in answers)


def test_answer_matches_pytorch_over_windows(client, served):
    checkpoint = served["checkpoints"]["reader"]
    model = _torch(checkpoint, "AutoModelForQuestionAnswering")
    question, context = "what is it?", " ".join(validation_texts()[:6])
    tokenizer = load_tokenizer(str(checkpoint / "tokenizer.json"), 128, stride=32, strategy="only_second")
    encs = windows(tokenizer, question, context)
    names = ["input_ids", "attention_mask", "token_type_ids", "offsets", "context_mask", "word_spans"]
    arrays = to_arrays(encs, names, 0, max(len(e.ids) for e in encs))
    with torch.no_grad():
        out = model(**{k: torch.from_numpy(arrays[k]) for k in names[:3]})
    expected = answer_spans(context, out.start_logits.numpy(), out.end_logits.numpy(), arrays["offsets"],
                            arrays["context_mask"], 3, arrays["word_spans"])
    served_answers = client.answer(question, context, model="reader", top_k=3)
    assert [(a.start, a.end) for a in served_answers] == [(e["start"], e["end"]) for e in expected]
    assert np.allclose([a.score for a in served_answers], [e["score"] for e in expected], atol=1e-4)


def test_an_answer_inside_a_word_is_the_whole_word(client, served):
    """The reader answers its marker token, here the first of ``waterproof``'s (water ##p ##ro ##o ##f): the
    served answer is the word, as transformers' QuestionAnsweringPipeline answers it (``align_to_words``)."""
    context = "They searched the old house for hours. In the end they found a waterproof box in the cellar."
    best = client.answer("what did they find?", context, model="reader")[0]
    assert (best.text, context[best.start:best.end]) == ("waterproof", "waterproof")


def test_large_inputs_are_chunked_in_order(client, served):
    texts = [f"text number {i} about {TEXTS[i % len(TEXTS)][:40]}" for i in range(150)]  # > max_batch_size 64
    together = client.embed(texts, model="minilm")
    assert together.shape == (150, 384)
    one_by_one = np.stack([client.embed(t, model="minilm") for t in texts[::37]])
    assert np.allclose(together[::37], one_by_one, atol=1e-5)
    assert client.embed([], model="minilm").shape[0] == 0


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_async_client_sends_chunks_as_the_sync_one_does(served, protocol, monkeypatch):
    """One request at a time by default (``fan_out.IN_FLIGHT``), as many as it allows where raised."""
    texts = TEXTS * 12  # 144 texts: three chunks

    in_flight, most = 0, 0

    async def run():
        nonlocal most
        async with AsyncEncoderClient(served[protocol], protocol=protocol) as c:
            (connection,) = c.fleet.clients.values()
            infer = connection.infer

            async def counted(*args, **kwargs):  # how many requests are on the wire at once
                nonlocal in_flight, most
                in_flight += 1
                most = max(most, in_flight)
                try:
                    return await infer(*args, **kwargs)
                finally:
                    in_flight -= 1

            connection.infer = counted
            await c.embed(texts, model="minilm")
            one_by_one, most = most, 0
            monkeypatch.setattr(fan_out, "IN_FLIGHT", 8)
            vectors = await c.embed(texts, model="minilm")
            chunked_at_once = (one_by_one, most)
            labels = await c.classify(TEXTS, model="classifier")
            ranked = await c.rerank(TEXTS[0], TEXTS[1:], model="reranker")
            answer = await c.answer("what?", TEXTS[3], model="reader")
        return vectors, labels, ranked, answer, chunked_at_once

    vectors, labels, ranked, answer, chunked_at_once = asyncio.run(run())
    assert chunked_at_once == (1, 3), f"(by default, raised): {chunked_at_once} of the 3 chunks in flight together"
    with EncoderClient(served["grpc"]) as sync:
        assert np.allclose(vectors, sync.embed(texts, model="minilm"), atol=1e-5)
        assert [l[0].label for l in labels] == [l[0].label for l in sync.classify(TEXTS, model="classifier")]
        assert [r.index for r in ranked] == [r.index for r in sync.rerank(TEXTS[0], TEXTS[1:], model="reranker")]
        assert answer == sync.answer("what?", TEXTS[3], model="reader")
    assert sorted(r.index for r in ranked) == list(range(len(TEXTS) - 1))  # every document ranked once
    assert all(r.document == TEXTS[1 + r.index] for r in ranked)
    assert len(answer) == 1 and answer[0].text and all(a.text == TEXTS[3][a.start:a.end] for a in answer)


def test_client_errors_are_clear(client, served):
    with pytest.raises(WrongTaskError, match="serves task 'embedding', not 'classification'"):
        client.classify("text", model="minilm")
    with pytest.raises(ModelNotFoundError, match="no_such_model"):
        client.embed("text", model="no_such_model")
    with pytest.raises(InvalidInputError, match=r"texts\[1\] is int"):
        client.embed(["fine", 3], model="minilm")
    with pytest.raises(InvalidInputError, match="context is empty"):
        client.answer("what?", "   ", model="reader")
    assert client.rerank("q", [], model="reranker") == []
    assert client.embed(["still serving"], model="minilm").shape == (1, 384)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_call_past_its_deadline_on_a_loaded_server_is_its_own_error_sent_once(served, protocol):
    """Under load, a call whose deadline is shorter than its wait raises DeadlineExceededError at that
    deadline, not after a retry budget of copies; the server is up, and answers the next call."""
    retry_s = 30.0  # the call's retry budget, which copies of it would spend
    done, answered, failures = threading.Event(), [], []

    def load():
        with EncoderClient(served["grpc"], model="minilm") as loader:
            while not done.is_set():
                try:
                    answered.append(len(loader.embed(TEXTS * 4)))
                except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                    failures.append(exc)

    def loading() -> bool:
        """Whether the loaders are past their start: answered as often as there are loaders, each sending its
        next batch at once."""
        assert not failures, failures
        return len(answered) >= len(loaders)

    loaders = [threading.Thread(target=load) for _ in range(2)]
    for loader in loaders:
        loader.start()
    try:
        wait_until(loading, "the loaders' batches to keep the steps busy")
        url = served[protocol]
        with EncoderClient(url, protocol=protocol, model="minilm", timeout_s=0.005, retry_s=retry_s) as client:
            started = time.monotonic()
            with pytest.raises(DeadlineExceededError, match="did not answer within"):
                client.embed("a query")
            # one attempt, and the retry budget not spent on copies of it
            assert client.replicas.failed[url] == 1 and time.monotonic() - started < retry_s
    finally:
        done.set()
        for loader in loaders:
            loader.join()
    assert answered and not failures, failures
    with EncoderClient(served[protocol], protocol=protocol) as client:
        assert client.embed("the next query", model="minilm").shape == (384,)


def test_unreachable_server_is_retryable_error():
    port = free_ports(1)[0]
    for protocol in ("grpc", "http"):  # a 1 s retry budget, not the default 15 s (test_failover checks it)
        with pytest.raises(ServerUnavailableError, match="unreachable"):
            EncoderClient(f"127.0.0.1:{port}", protocol=protocol, retry_s=1.0).embed("x", model="minilm")


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_clients_default_model_serves_the_calls_that_name_none(served, protocol):
    with EncoderClient(served[protocol], protocol=protocol, model="minilm") as client:
        # the same request twice: the same batch, kernels and order of summation, so the same bits
        assert np.array_equal(client.embed("a text"), client.embed("a text", model="minilm"))
        with pytest.raises(WrongTaskError, match="serves task 'embedding'"):
            client.classify("a text")
        assert len(client.classify("a text", model="classifier", top_k=2)) == 2  # a named model wins

    async def run():
        async with AsyncEncoderClient(served[protocol], protocol=protocol, model="minilm") as c:
            return await c.embed("a text")

    with EncoderClient(served[protocol], protocol=protocol) as client:
        assert np.allclose(asyncio.run(run()), client.embed("a text", model="minilm"), atol=1e-6)
