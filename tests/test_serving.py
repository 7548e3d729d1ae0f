"""The exported repository served by the real Triton server on loopback."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from sentence_transformers import SentenceTransformer

from helpers.servers import serving, step_counts
from helpers.waiting import wait_until
from nexus_sli.client import EncoderClient, InvalidInputError, fan_out
from nexus_sli.exporter.triton import config as triton_config
from nexus_sli.exporter.export import export_report
from nexus_sli.exporter.export.source import resolve_model
from nexus_sli.exporter.targets.cpu import supports_bf16
from nexus_sli.exporter.export.validate import validation_texts

from helpers.exports import MINILM
from helpers.vectors import cosines

NAME = MINILM


@pytest.fixture(scope="module")
def server(tmp_path_factory, exports):
    repo = tmp_path_factory.mktemp("served")
    # the default export, int8, the earlier layout (tokenizer -> encoder -> python post-processing, as
    # repositories exported before pooling moved into the graph: it must keep serving, and the client reads
    # it the same), OpenVINO bf16 (or its fp32 fallback) and NNCF's int8 IR, what auto keeps where it is
    # fastest (written even where no variant keeps the bar on this CPU: the test below checks serving, the
    # exporter's validation the bar); helpers.exports.PACKAGED has their options
    for name in (NAME, "minilm_int8", "minilm_strict", "minilm_openvino", "minilm_openvino_int8"):
        exports.copy(name, repo)
    with serving(repo) as server:
        yield server


@pytest.fixture(scope="module")
def reference():
    return SentenceTransformer(str(resolve_model(None).path), device="cpu")


def _text_input(module, texts):
    tensor = module.InferInput("TEXT", [len(texts), 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[t.encode("utf-8") for t in texts]], dtype=object).reshape(-1, 1))
    return tensor


def _embed(url, texts, model=NAME, protocol="http"):
    module = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(url)
    result = client.infer(model, [_text_input(module, texts)])
    return result.as_numpy("EMBEDDING")


def test_configs_parse_back_through_the_schema(server):
    ensemble = triton_config.read(server["repo"] / NAME / "config.pbtxt")
    assert ensemble.platform == "ensemble" and ensemble.parameters["task"].string_value == "embedding"
    # the encoder graph pools and normalises: no post-processing step
    assert [s.model_name for s in ensemble.ensemble_scheduling.step] == [f"{NAME}_tokenizer", f"{NAME}_encoder"]
    assert not (server["repo"] / f"{NAME}_postprocess").exists()
    encoder = triton_config.read(server["repo"] / f"{NAME}_encoder" / "config.pbtxt")
    assert encoder.platform == "onnxruntime_onnx" and encoder.max_batch_size > 0
    # the encoder keeps the token states beside the embedding for NAME_tokens; NAME maps the embedding only,
    # and the tokenizer's count of each text's tokens (OpenAI's usage, from the same call)
    assert [(o.name, list(o.dims)) for o in encoder.output] == [("EMBEDDING", [384]), ("TOKEN_EMBEDDINGS", [-1, 384])]
    assert [(o.name, list(o.dims)) for o in ensemble.output] == [("EMBEDDING", [384]), ("TOKEN_COUNT", [1])]
    assert ensemble.ensemble_scheduling.step[0].output_map["TOKEN_COUNT"] == "TOKEN_COUNT"
    assert [i.name for i in encoder.input] == ["input_ids", "attention_mask", "token_type_ids"]
    assert encoder.model_warmup and encoder.HasField("dynamic_batching")
    # a CPU encoder runs at once: waiting for company only delays a lone query (GPU: test_gpu_target)
    assert encoder.dynamic_batching.max_queue_delay_microseconds == triton_config.CPU_QUEUE_DELAY_US == 0
    tokenizer = triton_config.read(server["repo"] / f"{NAME}_tokenizer" / "config.pbtxt")
    # the token tensors the encoder reads, each text's token count, then the text modes' outputs (/tokenize,
    # /decode), asked for by name
    assert [o.name for o in tokenizer.output] == [i.name for i in encoder.input] + ["TOKEN_COUNT", "TOKENS", "DECODED"]
    assert tokenizer.backend == "python" and tokenizer.HasField("dynamic_batching")
    # the python steps batch what queued while they ran, without waiting (a lone query would pay it)
    assert tokenizer.dynamic_batching.max_queue_delay_microseconds == triton_config.TOKENIZER_QUEUE_DELAY_US == 0
    post = triton_config.read(server["repo"] / "minilm_strict_postprocess" / "config.pbtxt")
    assert post.HasField("dynamic_batching") and post.dynamic_batching.max_queue_delay_microseconds == 0
    # every batching step's queue is bounded and drops what waited past its timeout (test_queue_policy)
    for step in (tokenizer, encoder, post):
        assert step.dynamic_batching.default_queue_policy == triton_config.queue_policy()
    # an ensemble has no batcher of its own; its steps batch
    assert not ensemble.HasField("dynamic_batching")


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_served_embeddings_match_sentence_transformers(server, reference, protocol):
    texts = validation_texts()[:64]  # one request of 64 texts
    served = _embed(server[protocol], texts, protocol=protocol)
    expected = reference.encode(texts, normalize_embeddings=True)
    assert served.shape == (64, 384)
    assert cosines(served, expected).min() >= 0.9999


def test_a_repository_with_the_python_post_processing_step_still_serves_the_same(server, reference):
    """minilm_strict has the earlier three-step ensemble: the client reads it as it reads the pooled one."""
    strict = triton_config.read(server["repo"] / "minilm_strict" / "config.pbtxt")
    assert [s.model_name for s in strict.ensemble_scheduling.step][-1] == "minilm_strict_postprocess"
    texts = [t for t in validation_texts() if len(t) < 400][:40]  # minilm_strict refuses texts past 256 tokens
    with EncoderClient(server["grpc"]) as client:
        older, pooled = client.embed(texts, model="minilm_strict"), client.embed(texts, model=NAME)
    assert older.shape == pooled.shape == (40, 384)
    assert cosines(older, reference.encode(texts, normalize_embeddings=True)).min() >= 0.9999
    assert np.abs(older - pooled).max() < 1e-5


def test_served_int8_meets_its_thresholds(server, reference):
    texts = validation_texts()
    served = np.concatenate([_embed(server["http"], texts[i:i + 64], "minilm_int8") for i in range(0, len(texts), 64)])
    cos = cosines(served, reference.encode(texts, normalize_embeddings=True))
    assert cos.mean() >= 0.99 and cos.min() >= 0.95


def test_edge_inputs_then_server_keeps_serving(server, reference):
    long_text = "word " * 4000  # 20,000 characters, truncated to the model's 256 tokens
    served = _embed(server["http"], ["", long_text])
    assert np.isfinite(served).all() and np.allclose(np.linalg.norm(served, axis=1), 1.0, atol=1e-5)
    expected = reference.encode(["", long_text], normalize_embeddings=True)
    assert cosines(served, expected).min() >= 0.9999
    with pytest.raises(Exception, match="at most 256"):
        _embed(server["http"], ["short", long_text], "minilm_strict")
    assert _embed(server["grpc"], ["still alive"], protocol="grpc").shape == (1, 384)


def test_invalid_utf8_is_a_clear_error(server):
    client = httpclient.InferenceServerClient(server["http"])
    tensor = httpclient.InferInput("TEXT", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[b"\xff\xfe bad"]], dtype=object), binary_data=True)
    with pytest.raises(Exception, match="not valid UTF-8"):
        client.infer(NAME, [tensor])
    assert _embed(server["http"], ["fine again"]).shape == (1, 384)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_calls_chunks_are_sent_at_once_and_answer_in_order(server, protocol, monkeypatch):
    monkeypatch.setattr(fan_out, "IN_FLIGHT", 8)  # the client's default sends them one after another
    texts = validation_texts()[:200]  # requests of 64, 64, 64 and 8 texts
    in_flight, most, lock = 0, 0, threading.Lock()
    with EncoderClient(server[protocol], protocol=protocol, model=NAME) as client:
        (connection,) = client.fleet.clients.values()
        infer = connection.infer

        def counted(*args, **kwargs):  # how many requests are on the wire at once
            nonlocal in_flight, most
            with lock:
                in_flight += 1
                most = max(most, in_flight)
            try:
                return infer(*args, **kwargs)
            finally:
                with lock:
                    in_flight -= 1

        connection.infer = counted
        together = client.embed(texts)
    assert most == 4, f"{most} of the 4 requests were in flight together"
    each = np.concatenate([_embed(server[protocol], texts[i:i + 64], protocol=protocol) for i in range(0, 200, 64)])
    assert together.shape == (200, 384) and np.allclose(together, each, atol=1e-5)  # each text's own row, in order


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_failed_chunk_raises_its_error_the_first_in_order(server, protocol, monkeypatch):
    """minilm_strict refuses texts past its 256 tokens.  Two requests of one call fail: the second (302 tokens
    at its row 63, the caller's texts[127]) and the fourth (502 tokens, alone in it: it fails first); the call
    raises the second's, as one sending them in turn would, with its type and the text's place in the caller's
    list, and the client serves the next call."""
    monkeypatch.setattr(fan_out, "IN_FLIGHT", 8)  # the client's default sends them one after another
    short = [t for t in validation_texts() if len(t) < 400]
    texts = [*short[:64], *short[:63], "word " * 300, *short[:64], "word " * 500]
    with EncoderClient(server[protocol], protocol=protocol, model="minilm_strict") as client:
        with pytest.raises(InvalidInputError, match=r"texts\[127\] has 302 tokens"):
            client.embed(texts)
        assert client.embed(short[:130]).shape == (130, 384)


def test_concurrent_single_texts_share_encoder_executions(server):
    """32 clients send one text each at once (texts of different lengths): Triton
    merges them, as the tokenizer pads every row to one width."""
    def counts():
        return step_counts(server["http"], NAME, "encoder")

    texts = validation_texts()[:32]
    assert len({len(t.split()) for t in texts}) > 8  # lengths differ: no equal-shape luck
    clients = [grpcclient.InferenceServerClient(server["grpc"]) for _ in texts]
    start = threading.Barrier(len(texts))

    def send(index):
        start.wait()  # every client connected and ready: the requests arrive together
        result = clients[index].infer(NAME, [_text_input(grpcclient, [texts[index]])])
        return result.as_numpy("EMBEDDING")

    before = counts()
    with ThreadPoolExecutor(len(texts)) as pool:
        results = list(pool.map(send, range(len(texts))))
    # the encoder is the ensemble's last step: Triton may answer before it has counted the execution
    def all_counted():
        now = counts()
        return now if now[0] - before[0] >= 32 else None

    after = wait_until(all_counted, "the encoder to count every request", timeout=5)
    inferences, executions = after[0] - before[0], after[1] - before[1]
    assert inferences == 32 and all(r.shape == (1, 384) for r in results)
    assert executions <= inferences / 4, f"{executions} encoder executions for {inferences} requests"
    expected = np.concatenate([_embed(server["http"], [t]) for t in texts[:4]])
    assert np.allclose(np.concatenate(results[:4]), expected, atol=1e-5)  # merged rows answer their own text


def _openvino_precision(server) -> tuple[str, str]:
    config = triton_config.read(server["repo"] / "minilm_openvino_encoder" / "config.pbtxt")
    report = export_report.read(server["repo"] / "minilm_openvino_encoder").validation
    return config.parameters["HINT_BF16"].string_value, report.precision


@pytest.mark.skipif(not supports_bf16(), reason="the CPU has no avx512_bf16/amx_bf16: bf16 is not served here")
def test_openvino_bf16_is_served_where_the_cpu_has_bf16(server):
    assert _openvino_precision(server) == ("YES", "bf16")


@pytest.mark.skipif(supports_bf16(), reason="the CPU has avx512_bf16/amx_bf16: the fp32 fallback is not used here")
def test_openvino_asked_for_bf16_serves_fp32_where_the_cpu_has_none(server):
    assert _openvino_precision(server) == ("NO", "fp32")


def test_openvino_int8_ir_serves_what_its_validation_measured(server, reference):
    """The IR (model.xml) behind the same ensemble, in requests of another size than validation's:
    the served embeddings score against sentence-transformers what validation.json recorded."""
    folder = server["repo"] / "minilm_openvino_int8_encoder"
    config = triton_config.read(folder / "config.pbtxt")
    assert config.backend == "openvino" and config.default_model_filename == "model.xml"
    assert (folder / "1" / "model.xml").is_file() and not (folder / "1" / "model.onnx").exists()
    report = export_report.read(folder).validation
    texts = validation_texts()  # the 240 texts validation measured
    got = np.concatenate([_embed(server["grpc"], texts[i:i + 60], model="minilm_openvino_int8", protocol="grpc")
                          for i in range(0, len(texts), 60)])
    cos = cosines(got, reference.encode(texts, batch_size=32))
    assert report.precision == "int8" and got.shape == (240, 384)
    assert abs(cos.mean() - report.cosine_mean) < 1e-4 and abs(cos.min() - report.cosine_min) < 1e-4, (
        cos.mean(), cos.min(), report.cosine_mean, report.cosine_min)


def test_openvino_backend_serves_the_same_embeddings(server, reference):
    """The encoder on the openvino backend (bf16 or its fp32 fallback) behind the same ensemble."""
    config = triton_config.read(server["repo"] / "minilm_openvino_encoder" / "config.pbtxt")
    assert config.backend == "openvino"
    texts = validation_texts()[:48]
    got = _embed(server["grpc"], texts, model="minilm_openvino", protocol="grpc")
    cos = cosines(got, reference.encode(texts, batch_size=16))
    assert got.shape == (48, 384) and cos.min() >= 0.999, cos.min()
