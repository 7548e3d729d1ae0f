"""The model description the client and the gateway share, built from config dicts (no server)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nexus_sli.client import InvalidInputError, WrongTaskError
from nexus_sli.client import calls
from nexus_sli.client.error_codes import TOKEN_COUNT_OUTPUT
from nexus_sli.client.errors import DimensionsError, UnknownPromptError
from nexus_sli.client.model_info import UNSTATED_ROWS, ModelInfo

PROMPTS = {"query": "query: ", "passage": "passage: "}


def _config(spelling: str = "string_value", **params: str) -> dict:
    """An embedding ensemble's config as Triton's JSON writes it, parameters in ``spelling``."""
    params = {"task": "embedding", "normalize": "true", "prompts": json.dumps(PROMPTS),
              "default_prompt_name": "query", "matryoshka_dims": "[32, 16, 8]", **params}
    return {"name": "retriever", "platform": "ensemble", "max_batch_size": 64,
            "parameters": {k: {spelling: v} for k, v in params.items()},
            "output": [{"name": "EMBEDDING", "data_type": "TYPE_FP32", "dims": ["32"]}],
            "ensemble_scheduling": {"step": [{"model_name": "retriever_tokenizer"},
                                             {"model_name": "retriever_encoder"}]}}


@pytest.mark.parametrize("spelling", ["string_value", "stringValue"])
def test_parameters_are_read_in_either_spelling(spelling):
    info = ModelInfo.from_config("retriever", _config(spelling))
    assert info.task == "embedding" and info.max_batch_size == 64 and info.dimensions == 32
    assert info.tokenizer == "retriever_tokenizer"
    assert info.prompts == PROMPTS and info.default_prompt_name == "query"
    assert info.trained_dimensions == [32, 16, 8] and info.normalizes


def test_grpc_wrapping_and_missing_parameters():
    info = ModelInfo.from_config("retriever", {"config": _config()})  # gRPC's answer wraps the config
    assert info.prompts == PROMPTS and info.dimensions == 32
    bare = ModelInfo.from_config("plain", {"name": "plain", "output": [{"dims": [-1]}]})
    assert (bare.task, bare.dimensions, bare.tokenizer, bare.prompts) == ("", 0, None, {})
    assert bare.trained_dimensions == [] and not bare.normalizes and bare.default_prompt_name is None
    with pytest.raises(WrongTaskError, match="serves task 'unknown', not 'embedding'"):
        bare.expect("embedding")


def test_labels_are_read_by_id():
    info = ModelInfo.from_config("topics", _config(task="classification", id2label='{"0": "sports", "1": "food"}'))
    assert info.id2label == {0: "sports", 1: "food"}


def test_prompt_names_are_checked_against_the_models_prompts():
    info = ModelInfo.from_config("retriever", _config())
    assert info.check_prompt(None) is None and info.check_prompt("passage") == "passage"
    for bad in ("instruction", 3):
        with pytest.raises(UnknownPromptError, match=r"unknown prompt_name .* for model 'retriever'; "
                                                     r"its prompts: 'query', 'passage'") as raised:
            info.check_prompt(bad)
        assert isinstance(raised.value, InvalidInputError) and raised.value.known == ["query", "passage"]
    plain = ModelInfo.from_config("plain", _config(prompts="{}"))
    with pytest.raises(UnknownPromptError, match=r"its prompts: none \(this model has no prompts\)"):
        plain.check_prompt("query")


@pytest.mark.parametrize("dimensions", [0, 33, -1, 2.5, True, "8"])
def test_sizes_outside_the_model_are_refused(dimensions):
    info = ModelInfo.from_config("retriever", _config())
    with pytest.raises(DimensionsError, match="dimensions must be an integer from 1 to the model's 32") as raised:
        info.check_dimensions(dimensions)
    assert isinstance(raised.value, InvalidInputError) and raised.value.trained == [32, 16, 8]


def test_any_size_up_to_the_models_is_accepted():
    info = ModelInfo.from_config("retriever", _config())
    assert [info.check_dimensions(d) for d in (None, 1, 20, 32, np.int64(8))] == [None, 1, 20, 32, 8]


def test_the_cut_keeps_each_vectors_first_values_unnormalised():
    info = ModelInfo.from_config("retriever", _config())
    vectors = np.arange(2 * 32, dtype=np.float32).reshape(2, 32)
    assert info.cut(vectors, None) is vectors
    np.testing.assert_array_equal(info.cut(vectors, 8), vectors[:, :8])
    np.testing.assert_array_equal(info.cut(vectors[0], 8), vectors[0, :8])
    with pytest.raises(DimensionsError, match="from 1 to the model's 16"):  # checked against the vectors' own size
        info.cut(vectors[:, :16], 20)


def test_the_clients_embed_call_cuts_then_normalises():
    info = ModelInfo.from_config("retriever", _config())
    vectors = np.random.default_rng(0).normal(size=(3, 32)).astype(np.float32)
    call = calls.embed(["a", "b", "c"], info, prompt_name="passage", dimensions=8)
    assert call.parameters == {"prompt_name": "passage"}
    got = call.read([(vectors,)])
    expected = vectors[:, :8] / np.linalg.norm(vectors[:, :8], axis=1, keepdims=True)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert calls.embed("a", info).read([(vectors[:1],)]).shape == (32,)
    with pytest.raises(UnknownPromptError):
        calls.embed("a", info, prompt_name="instruction")


def test_the_counted_call_asks_for_the_token_count_only_where_the_ensemble_answers_it():
    """An ensemble that declares TOKEN_COUNT answers the vectors and their tokens in one call; one exported
    before it does not say so, and the counted call is refused before anything is sent."""
    config = _config()
    config["output"].append({"name": TOKEN_COUNT_OUTPUT, "data_type": "TYPE_INT64", "dims": ["1"]})
    info = ModelInfo.from_config("retriever", config)
    assert info.counts_tokens and info.dimensions == 32  # the count comes after the embedding
    vectors = np.ones((3, 32), dtype=np.float32)
    call = calls.embed_counted("a", info, prompt_name="passage")
    assert call.outputs == ("EMBEDDING", TOKEN_COUNT_OUTPUT) and call.parameters == {"prompt_name": "passage"}
    got, tokens = call.read([(vectors[:2], np.array([[5], [7]])), (vectors[2:], np.array([[4]]))])
    assert got.shape == (3, 32) and tokens == 16
    older = ModelInfo.from_config("retriever", _config())
    assert not older.counts_tokens
    with pytest.raises(WrongTaskError, match="exported before they were served"):
        calls.embed_counted(["a"], older)


def test_the_gateway_keeps_its_own_error_shape():
    from nexus_sli.gateway.discovery import served_model
    from nexus_sli.gateway.embeddings import check_dimensions, check_prompt
    from nexus_sli.gateway.errors import GatewayError

    model = served_model("retriever", _config("stringValue"))
    assert model.prompts == PROMPTS and check_prompt("query", model) == "query"
    with pytest.raises(GatewayError) as raised:
        check_prompt("instruction", model)
    assert (raised.value.param, raised.value.code) == ("prompt_name", "prompt_not_found")
    assert raised.value.message == "unknown prompt_name 'instruction' for model 'retriever'; its prompts: query, passage"
    with pytest.raises(GatewayError) as raised:
        check_dimensions(33, model)
    assert raised.value.param == "dimensions"
    assert raised.value.message == ("dimensions must be an integer from 1 to 32 for model 'retriever'; it was "
                                    "trained for 32, 16, 8; got 33")
    # only the ensemble is the model: its steps carry the task too
    assert served_model("retriever_tokenizer", {**_config(), "platform": "python"}) is None


def _reranker_config() -> dict:
    """A cross-encoder's ensemble as exported: unbatched (one query and its documents a request)."""
    return {"name": "reranker", "platform": "ensemble", "max_batch_size": 0,
            "parameters": {"task": {"string_value": "rerank"}}, "output": [{"name": "SCORES", "dims": ["-1"]}],
            "ensemble_scheduling": {"step": [{"model_name": "reranker_tokenizer"},
                                             {"model_name": "reranker_encoder"}]}}


def test_an_unbatched_ensembles_documents_a_request_are_its_tokenizer_steps_rows():
    info = ModelInfo.from_config("reranker", _reranker_config())
    assert info.bound_by_step and info.rows_per_request == UNSTATED_ROWS  # its step not read yet
    step = {"name": "reranker_tokenizer", "max_batch_size": 0, "parameters": {"max_rows": {"string_value": "16"}}}
    assert info.with_tokenizer_step(step).rows_per_request == 16
    assert info.with_tokenizer_step({**step, "parameters": {}}).rows_per_request == UNSTATED_ROWS  # states none
    call = calls.rerank("q", [f"d{n}" for n in range(40)], info.with_tokenizer_step({"config": step}))
    assert [len(request["DOCUMENTS"]) for request in call.requests] == [16, 16, 8]


def test_a_batched_ensemble_states_its_own_rows():
    info = ModelInfo.from_config("retriever", _config())
    assert not info.bound_by_step and info.rows_per_request == 64
    step = {"name": "retriever_tokenizer", "max_batch_size": 64}
    assert info.with_tokenizer_step(step).rows_per_request == 64
