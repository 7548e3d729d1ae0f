"""TEI's ``GET /info``, ``POST /tokenize``, ``/decode`` and ``/similarity`` through the gateway.

One Triton server (a seeded tiny embedder with named prompts, a tiny classifier, and a copy of the
embedder whose configs are as exports made before the text modes and the token count wrote them) and
one gateway pinned to the embedder.  Every answer is checked against TEI's OpenAPI description, the tokens
against the checkpoint's own ``tokenizers.Tokenizer``, the similarities against the client's vectors.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from helpers import task_models
from helpers.fake_triton import ConfigTriton
from helpers.http_api import call, schema_problems, tei, tei_schema
from helpers.servers import gateway_to, serving, step_counts
from helpers.waiting import wait_until
from nexus_sli.bench.served import Gateway
from nexus_sli.client import EncoderClient
from nexus_sli.client.error_codes import DECODED_OUTPUT, IDS_INPUT, TOKEN_COUNT_OUTPUT, TOKENS_OUTPUT
from nexus_sli.exporter.export.pipeline import ExportOptions, run_export
from nexus_sli.exporter.triton import config as triton_config
from nexus_sli.gateway import GatewayConfig
from nexus_sli.gateway.discovery import Catalog

PROMPTS = {"query": "query: ", "doc": "passage: "}
# ASCII, accents the normaliser strips, CJK the pre-tokenizer splits per character, an emoji outside the BMP
TEXTS = ["Hello world, the tokenizer speaks.", "Grüße aus Köln: naïve café", "日本語のテキスト", "emoji 🙂 then text",
         "unusualwordpieces"]


def test_the_schema_checker_reads_maps_by_their_values_schema():
    """TEI's label maps are objects of any keys (additionalProperties): their values are what is checked."""
    labels = {"id2label": {"0": "negative"}, "label2id": {"negative": 0}}
    assert schema_problems(labels, tei_schema("ClassifierModel")) == []
    assert schema_problems({**labels, "id2label": {"0": 0}}, tei_schema("ClassifierModel")) != []
    assert schema_problems({**labels, "extra": 1}, tei_schema("ClassifierModel")) != []


def test_discovery_pairs_each_model_with_its_tokenizer_step_and_one_model_is_one():
    def params(**values):
        return {key: {"string_value": value} for key, value in values.items()}

    step = {"model_name": "emb_tokenizer"}
    configs = {
        "emb": {"platform": "ensemble", "max_batch_size": 64, "parameters": params(task="embedding"),
                "ensemble_scheduling": {"step": [step]}},
        "emb_tokens": {"platform": "ensemble", "parameters": params(task="token-embedding"),
                       "ensemble_scheduling": {"step": [step]}},
        "emb_tokenizer": {"backend": "python", "max_batch_size": 64, "instance_group": [{"count": 2}],
                          "parameters": params(max_length="256", truncate="false"),
                          "input": [{"name": "TEXT"}, {"name": IDS_INPUT}],
                          "output": [{"name": "input_ids"}, {"name": TOKENS_OUTPUT}, {"name": DECODED_OUTPUT}]},
    }
    model = asyncio.run(Catalog(ConfigTriton(configs), ttl_s=10).only())  # its NAME_tokens is no second model
    assert model.name == "emb"
    step = model.tokenizer_step
    assert (step.max_length, step.truncate, step.instances, step.rows) == (256, False, 2, 64)
    assert step.tokenizes and step.decodes
    configs["emb_tokenizer"]["output"] = [{"name": "input_ids"}]  # as exports before the text modes
    assert not asyncio.run(Catalog(ConfigTriton(configs), ttl_s=10).only()).tokenizer_step.tokenizes


def _old_export(repo: Path, name: str, old: str) -> None:
    """A copy of ``name`` as exports before the text modes and the token count wrote it: its tokenizer lacks
    them, and its ensemble answers no ``TOKEN_COUNT``."""
    for folder in [f for f in repo.iterdir() if f.name == name or f.name.startswith(f"{name}_")]:
        copy = shutil.copytree(folder, repo / folder.name.replace(name, old, 1))
        config = copy / "config.pbtxt"
        config.write_text(config.read_text().replace(f'"{name}', f'"{old}'))
    path = repo / f"{old}_tokenizer"
    tokenizer = triton_config.read(path / "config.pbtxt")
    kept_inputs = [t for t in tokenizer.input if t.name != IDS_INPUT]
    kept_outputs = [t for t in tokenizer.output if t.name not in (TOKENS_OUTPUT, DECODED_OUTPUT, TOKEN_COUNT_OUTPUT)]
    del tokenizer.input[:], tokenizer.output[:]
    tokenizer.input.extend(kept_inputs)
    tokenizer.output.extend(kept_outputs)
    for model_input in tokenizer.input:
        model_input.optional = False
    triton_config.write(tokenizer, path)
    ensemble = triton_config.read(repo / old / "config.pbtxt")
    kept_outputs = [t for t in ensemble.output if t.name != TOKEN_COUNT_OUTPUT]
    del ensemble.output[:]
    ensemble.output.extend(kept_outputs)
    del ensemble.ensemble_scheduling.step[0].output_map[TOKEN_COUNT_OUTPUT]
    triton_config.write(ensemble, repo / old)


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_tokenizer, tiny_checkpoint):
    root = tmp_path_factory.mktemp("tei-routes")
    embedder = shutil.copytree(tiny_checkpoint("bert"), root / "embedder")
    (embedder / "config_sentence_transformers.json").write_text(json.dumps({"prompts": PROMPTS}))
    repo = root / "repo"
    run_export(ExportOptions(model=str(embedder), name="embedder", out=repo, precision="fp32"))
    run_export(ExportOptions(model=str(task_models.classifier(tiny_tokenizer, root / "classifier")),
                             name="classifier", out=repo, precision="fp32"))
    _old_export(repo, "embedder", "older")
    with serving(repo) as server:
        yield {**server, "checkpoint": embedder}


@pytest.fixture(scope="module")
def gateway(served, tmp_path_factory):
    with gateway_to(served["grpc"], "--tei-model", "embedder", log=tmp_path_factory.mktemp("gw") / "gateway.log") as started:
        yield started


@pytest.fixture(scope="module")
def tokenizer(served):
    """The checkpoint's own tokenizer, as it ships (no truncation: /tokenize shows every token)."""
    found = Tokenizer.from_file(str(served["checkpoint"] / "tokenizer.json"))
    found.no_truncation()
    found.no_padding()
    return found


def tei_answer(gateway: Gateway, route: str, body: dict, request_schema: str, response_schema: str):
    """The route's answer, both ways checked against TEI's schemas."""
    status, _, answer = tei(gateway, route, body, request_schema)
    assert status == 200, answer
    assert schema_problems(answer, tei_schema(response_schema)) == []
    return answer


def _info_problems(info: dict) -> list[str]:
    """TEI's Info schema, with the fields the gateway adds beside it (tei_info.EXTENSIONS)."""
    schema = tei_schema("Info")
    extended = {**schema, "properties": {**schema["properties"], "dimensions": {"type": "integer", "minimum": 1},
                                         "backend": {"type": "string", "nullable": True}}}
    return schema_problems(info, extended)


def test_info_describes_the_export_and_the_gateways_limits(gateway, served):
    status, _, info = call(f"{gateway.url}/info")
    assert status == 200 and _info_problems(info) == []
    tokenizer = triton_config.read(served["repo"] / "embedder_tokenizer" / "config.pbtxt")
    ensemble = triton_config.read(served["repo"] / "embedder" / "config.pbtxt")
    max_length = int(tokenizer.parameters["max_length"].string_value)
    assert info["model_id"] == info["served_model_name"] == "embedder"
    assert info["model_type"] == {"embedding": {"pooling": ensemble.parameters["pooling"].string_value}}
    assert info["model_dtype"] == "float32" and info["auto_truncate"] is True
    assert info["backend"] == ensemble.parameters["backend"].string_value == "onnxruntime"
    assert info["max_input_length"] == max_length == 128
    assert info["max_batch_requests"] == ensemble.max_batch_size == 64
    assert info["max_batch_tokens"] == 64 * max_length
    assert info["max_client_batch_size"] == GatewayConfig().max_inputs
    assert info["tokenization_workers"] == tokenizer.instance_group[0].count
    assert info["version"] == version("nexus-sli")
    assert info["dimensions"] == dict((o.name, list(o.dims)) for o in ensemble.output)["EMBEDDING"][-1]


def test_info_of_a_named_classifier_lists_its_labels(gateway):
    status, _, info = call(f"{gateway.url}/info?model=classifier")
    assert status == 200 and _info_problems(info) == []
    labels = {"0": "negative", "1": "neutral", "2": "positive"}
    assert info["model_type"] == {"classifier": {"id2label": labels, "label2id": {v: int(k) for k, v in labels.items()}}}


def _expected(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[dict]:
    """TEI's SimpleTokens of ``text`` from the tokenizer itself: a special token has its own string and no span;
    the span of any other is in UTF-8 bytes, as TEI's Rust tokenizer counts it (Python's counts characters)."""
    encoding = tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def byte(index: int) -> int:
        return len(text[:index].encode("utf-8"))

    return [{"id": i, "text": token if special else text[start:stop], "special": bool(special),
             "start": None if special else byte(start), "stop": None if special else byte(stop)}
            for i, token, special, (start, stop) in zip(encoding.ids, encoding.tokens, encoding.special_tokens_mask,
                                                        encoding.offsets)]


@pytest.mark.parametrize("prompt_name", [None, "query"])
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_tokenize_is_the_models_own_tokenizer(gateway, tokenizer, prompt_name, add_special_tokens):
    body = {"inputs": TEXTS, "add_special_tokens": add_special_tokens,
            **({"prompt_name": prompt_name} if prompt_name else {})}
    found = tei_answer(gateway, "/tokenize", body, "TokenizeRequest", "TokenizeResponse")
    prompt = PROMPTS.get(prompt_name, "")
    assert found == [_expected(tokenizer, prompt + text, add_special_tokens) for text in TEXTS]
    # the offsets are UTF-8 bytes of the prompted text, as TEI's ("这" is (0, 3)), not its characters
    for text, tokens in zip(TEXTS, found):
        prompted = (prompt + text).encode("utf-8")
        assert all(prompted[t["start"]:t["stop"]].decode("utf-8") == t["text"] for t in tokens if not t["special"])
    cjk = [(t["start"], t["stop"]) for t in found[2] if not t["special"] and t["start"] >= len(prompt)]  # ASCII prompt
    assert cjk[0] == (len(prompt), len(prompt) + 3) and cjk[-1][1] == len((prompt + TEXTS[2]).encode("utf-8"))


def test_tokenize_one_string_and_a_long_text_untruncated(gateway, tokenizer):
    long = " ".join(TEXTS * 20)
    found = tei_answer(gateway, "/tokenize", {"inputs": long}, "TokenizeRequest", "TokenizeResponse")
    assert len(found) == 1 and found[0] == _expected(tokenizer, long, True) and len(found[0]) > 128


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_round_trips_the_tokenized_ids(gateway, tokenizer, skip_special_tokens):
    tokens = tei_answer(gateway, "/tokenize", {"inputs": TEXTS}, "TokenizeRequest", "TokenizeResponse")
    ids = [[t["id"] for t in row] for row in tokens]
    texts = tei_answer(gateway, "/decode", {"ids": ids, "skip_special_tokens": skip_special_tokens}, "DecodeRequest",
                "DecodeResponse")
    assert texts == [tokenizer.decode(row, skip_special_tokens=skip_special_tokens) for row in ids]
    single = tei_answer(gateway, "/decode", {"ids": ids[0]}, "DecodeRequest", "DecodeResponse")  # skips by default
    assert single == [tokenizer.decode(ids[0], skip_special_tokens=True)]


def test_similarity_is_the_cosine_of_the_served_embeddings(gateway, served):
    body = {"inputs": {"source_sentence": TEXTS[0], "sentences": TEXTS[1:]}, "parameters": {"prompt_name": "doc"}}
    found = tei_answer(gateway, "/similarity", body, "SimilarityRequest", "SimilarityResponse")
    with EncoderClient(served["grpc"]) as client:
        vectors = client.embed(TEXTS, model="embedder", prompt_name="doc")
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    assert np.allclose(found, unit[1:] @ unit[0], atol=1e-5)
    plain = tei_answer(gateway, "/similarity", {"inputs": body["inputs"]}, "SimilarityRequest", "SimilarityResponse")
    assert not np.allclose(plain, found, atol=1e-5)  # the prompt was applied


MANY = GatewayConfig().max_inputs + 1


# TEI's statuses (router/src/http/server.rs): Validation 422, Empty 400, a model that cannot serve the route 424
@pytest.mark.parametrize("route, body, status, error_type, words", [
    ("/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"]}, "model": "classifier"}, 424, "Backend",
     "serves task 'classification'"),
    ("/similarity", {"inputs": {"source_sentence": "a", "sentences": []}}, 400, "Empty", "inputs.sentences"),
    ("/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"] * MANY}}, 422, "Validation", "at most"),
    ("/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"]},
                     "parameters": {"truncation_direction": "Left"}}, 422, "Validation", "truncation_direction"),
    ("/tokenize", {"inputs": []}, 400, "Empty", "empty"),
    ("/tokenize", {"inputs": ["a"] * MANY}, 422, "Validation", "at most"),
    ("/tokenize", {"inputs": "x", "prompt_name": "nope"}, 422, "Validation", "unknown prompt_name"),
    ("/tokenize", {"inputs": "x", "model": "older"}, 424, "Backend", "export the model again"),
    ("/decode", {"ids": [[1, 2]], "model": "older"}, 424, "Backend", "export the model again"),
    ("/decode", {"ids": [[1]] * MANY}, 422, "Validation", "at most"),
    ("/decode", {"ids": [[-1]]}, 422, "Validation", "integers from 0"),
    ("/decode", {"ids": [[2**63]]}, 422, "Validation", "integers from 0 to 4294967295"),
    ("/decode", {"ids": [[10**6]]}, 422, "Validation", "outside this model's vocabulary"),
    ("/tokenize", {"inputs": "x", "model": "nope"}, 404, "Validation", "'nope' is not served"),
])
def test_errors_in_teis_shape_and_status(gateway, route, body, status, error_type, words):
    got, _, answer = call(f"{gateway.url}{route}", body)
    assert schema_problems(answer, tei_schema("ErrorResponse")) == [], answer
    assert (got, answer["error_type"]) == (status, error_type) and words in answer["error"], answer


def test_truncate_false_refuses_a_text_the_export_would_cut_and_serves_the_rest(gateway, served):
    """The embedder's export truncates at 128 tokens (TEI's --auto-truncate); TEI refuses a longer text when asked
    truncate=false, and so does the gateway, counting the tokens first.  A text within the length is embedded."""
    long = " ".join(TEXTS * 20)
    status, _, answer = tei(gateway, "/embed", {"inputs": [TEXTS[0], long], "truncate": False}, "EmbedRequest")
    assert (status, answer["error_type"]) == (422, "Validation") and "inputs[1] has" in answer["error"], answer
    assert "more than model 'embedder' takes (128)" in answer["error"]
    status, _, cut = tei(gateway, "/embed", {"inputs": [TEXTS[0], long]}, "EmbedRequest")  # the export's choice
    assert status == 200 and len(cut) == 2
    status, _, whole = tei(gateway, "/embed", {"inputs": TEXTS, "truncate": False}, "EmbedRequest")
    assert status == 200 and np.allclose(whole[0], cut[0], atol=1e-6)


@pytest.mark.parametrize("prompt_name", [None, "query"])
def test_openai_usage_is_the_models_tokens_from_the_ensemble_and_from_an_older_exports_second_call(
        gateway, served, tokenizer, prompt_name):
    """The embedder's ensemble answers the count with the vectors; the older copy, without that output, is
    counted by its tokenizer step asked again (twice its texts): both are the model's own tokens, prompt included."""
    def tokenized() -> int:
        return step_counts(served["http"], "older", "tokenizer")[0]

    body = {"input": TEXTS, **({"prompt_name": prompt_name} if prompt_name else {})}
    expected = sum(len(tokenizer.encode(PROMPTS.get(prompt_name, "") + text).ids) for text in TEXTS)
    before = tokenized()
    for model in ("embedder", "older"):
        status, _, answer = call(f"{gateway.url}/v1/embeddings", {**body, "model": model})
        assert status == 200 and answer["usage"] == {"prompt_tokens": expected, "total_tokens": expected}, answer
    # Triton may answer before a step has counted its execution
    wait_until(lambda: tokenized() >= before + 2 * len(TEXTS), "the older tokenizer to count both calls", timeout=30)
    assert tokenized() == before + 2 * len(TEXTS)


def test_the_older_export_still_embeds_and_its_info_answers(gateway, served):
    """The text modes are optional: an export without them serves every other route as before."""
    status, _, info = call(f"{gateway.url}/info?model=older")
    assert status == 200 and _info_problems(info) == []
    with EncoderClient(served["grpc"]) as client:
        assert np.allclose(client.embed(TEXTS, model="older"), client.embed(TEXTS, model="embedder"), atol=1e-6)
