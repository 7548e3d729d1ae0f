"""Each batched CPU ensemble's steps joined in one process (``nexus-sli serve``'s default) answer as the
ensemble does.

A tiny model per task is exported and served twice at once: as ``nexus-sli serve``
serves it (each ensemble a joined python model) and with ``separate_steps`` (the
ensembles as exported).  Every valid request gets the same outputs, to the bit,
and every bad one the same error; the joined model keeps the ensemble's
description for clients, and the repository on disk is not changed.
"""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from helpers import task_models
from helpers.servers import serving
from nexus_sli.client import EncoderClient
from nexus_sli.client.model_info import ModelInfo
from nexus_sli.exporter.export.pipeline import ExportOptions, run_export
from nexus_sli.exporter.serving import joined_steps
from nexus_sli.exporter.triton import config as tc
from nexus_sli.gateway.discovery import served_model

TEXTS = ["the cat sat on the mat", "a storm is coming", "hello", "water boils at 100 degrees " * 9]


def _bytes(items, shape=None):
    array = np.array([i if isinstance(i, bytes) else i.encode("utf-8") for i in items], dtype=object)
    return array.reshape(shape) if shape else array


def _texts(items):
    return {"TEXT": _bytes(items, (-1, 1))}


#: (model, case, inputs, request parameters): valid requests and bad ones, of every step layout
REQUESTS = [
    ("embedder", "texts", _texts(TEXTS), {}),
    ("embedder_tokens", "token states", _texts(TEXTS), {}),
    ("legacy", "texts, pooled by the post-processing step", _texts(TEXTS), {}),
    ("classifier", "texts", _texts(TEXTS), {}),
    ("tagger", "texts", _texts(["Anna lives in Berlin", "hello"]), {}),
    ("reranker", "documents", {"QUERY": _bytes(["cats"]), "DOCUMENTS": _bytes(TEXTS)}, {}),
    ("reader", "a context", {"QUESTION": _bytes(["what boils?"]), "CONTEXT": _bytes([" ".join(TEXTS * 20)])}, {}),
    ("embedder", "invalid UTF-8", _texts(["fine", b"\xc3\x28"]), {}),
    ("embedder", "an unknown prompt", _texts(["fine"]), {"prompt_name": "query"}),
    ("classifier", "invalid UTF-8", _texts([b"\xff"]), {}),
    ("reranker", "no documents", {"QUERY": _bytes(["q"]), "DOCUMENTS": _bytes([])}, {}),
    ("reader", "an empty context", {"QUESTION": _bytes(["q"]), "CONTEXT": _bytes([""])}, {}),
]


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_tokenizer, tiny_checkpoint):
    root = tmp_path_factory.mktemp("joined")
    repo = root / "repo"
    for name, path in task_models.every_task(tiny_tokenizer, tiny_checkpoint, root).items():
        run_export(ExportOptions(model=str(path), name=name, out=repo, precision="fp32",
                                 pool_in_graph=name != "legacy"))
    before = _files(repo)
    with serving(repo) as joined, serving(repo, separate_steps=True) as separate:
        yield {"repo": repo, "joined": joined, "separate": separate, "files": before}


def _infer(address: str, protocol: str, model: str, inputs: dict, parameters: dict):
    """The outputs by name, or the error's message."""
    module = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(address)
    tensors = []
    for name, array in inputs.items():
        tensor = module.InferInput(name, list(array.shape), "BYTES")
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    try:
        result = client.infer(model, tensors, parameters=parameters or None)
    except Exception as exc:  # noqa: BLE001 - the server's error, compared
        return str(exc)
    finally:
        client.close()
    outputs = result.get_response()["outputs"] if protocol == "http" else result.get_response().outputs
    return {name: result.as_numpy(name) for name in (o["name"] if protocol == "http" else o.name for o in outputs)}


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("model, case, inputs, parameters", REQUESTS, ids=[f"{m}: {c}" for m, c, _, _ in REQUESTS])
def test_a_joined_ensemble_answers_as_the_ensemble_does(served, protocol, model, case, inputs, parameters):
    joined = _infer(served["joined"][protocol], protocol, model, inputs, parameters)
    separate = _infer(served["separate"][protocol], protocol, model, inputs, parameters)
    if isinstance(separate, str):
        assert isinstance(joined, str), f"the ensemble refused ({separate}), the joined model answered"
        # Triton's ensemble may name itself in front of the step's message; the step's message is the same
        assert separate.rsplit("] ", 1)[-1].split("in ensemble")[0].strip() in joined
        return
    assert isinstance(joined, dict), joined
    assert sorted(joined) == sorted(separate)
    for name in separate:
        assert separate[name].dtype == joined[name].dtype and separate[name].shape == joined[name].shape, name
        assert np.array_equal(separate[name], joined[name]), name


def _config(address: str, model: str) -> dict:
    with urllib.request.urlopen(f"http://{address}/v2/models/{model}/config", timeout=30) as response:
        return json.loads(response.read())


#: the ensembles joined: every batched one but the token states' (``joined_steps._joinable`` says why)
JOINED = ["classifier", "embedder", "legacy", "tagger"]


def test_every_batched_ensemble_but_the_token_states_is_joined_and_keeps_its_description(served):
    ensembles = [tc.read(path) for path in sorted(served["repo"].glob("*/config.pbtxt"))]
    ensembles = [config for config in ensembles if config.platform == "ensemble"]
    assert {c.name for c in ensembles} == {*JOINED, "embedder_tokens", "reranker", "reader"}
    for exported in ensembles:
        config = _config(served["joined"]["http"], exported.name)
        if exported.name not in JOINED:
            assert config == _config(served["separate"]["http"], exported.name)
            continue
        assert config["backend"] == "python" and not config.get("platform")
        steps = ",".join(step.model_name for step in exported.ensemble_scheduling.step)
        assert config["parameters"]["joined_steps"]["string_value"] == steps
        joined, as_exported = ModelInfo.from_config(exported.name, config), ModelInfo.from_config(
            exported.name, _config(served["separate"]["http"], exported.name))
        for field in ("task", "max_batch_size", "dimensions", "tokenizer", "outputs"):
            assert getattr(joined, field) == getattr(as_exported, field), field
        assert {k: v for k, v in joined.params.items() if not k.startswith("joined_")} == as_exported.params
        assert served_model(exported.name, config) is not None  # the gateway finds it
    steps = _config(served["joined"]["http"], "embedder_tokenizer")
    assert steps == _config(served["separate"]["http"], "embedder_tokenizer")  # the steps are served as exported


def test_the_joined_model_batches_with_the_longest_delay_no_queue_policy_and_the_encoders_instances(served):
    """Batched as its steps are; without their queue policy (``joined_steps.joined_config`` says why)."""
    config = _config(served["joined"]["http"], "embedder")
    tokenizer = _config(served["joined"]["http"], "embedder_tokenizer")
    encoder = _config(served["joined"]["http"], "embedder_encoder")
    assert "default_queue_policy" in tokenizer["dynamic_batching"]
    assert config["dynamic_batching"].get("default_queue_policy", {}).get("max_queue_size", 0) == 0
    delays = [int(c["dynamic_batching"].get("max_queue_delay_microseconds", 0)) for c in (config, tokenizer, encoder)]
    assert delays[0] == max(delays[1:])
    assert [(g["kind"], g["count"]) for g in config["instance_group"]] == [
        (g["kind"], g["count"]) for g in encoder["instance_group"]]


def test_a_step_config_reads_as_triton_hands_it_to_the_step(served):
    """What the joined model initializes each step with is what Triton gives a python model: the served config
    (Triton fills in defaults, which are left out here) agrees on every field the export wrote."""
    for step in ("embedder_tokenizer", "embedder_encoder", "legacy_postprocess"):
        written = joined_steps.triton_json(tc.read(served["repo"] / step / "config.pbtxt"))
        served_config = _config(served["separate"]["http"], step)
        for field in ("input", "output", "parameters", "max_batch_size", "default_model_filename"):
            if field in written:
                assert _subset(written[field], served_config[field]), field
        assert all(isinstance(d, int) for tensor in written["output"] for d in tensor["dims"])


def _subset(written, served) -> bool:
    if isinstance(written, dict):
        return all(_subset(value, served.get(key)) for key, value in written.items())
    if isinstance(written, list):
        return len(written) == len(served) and all(_subset(a, b) for a, b in zip(written, served))
    return written == served


def test_the_repository_on_disk_is_not_changed(served):
    assert _files(served["repo"]) == served["files"]


def _files(repo):
    """The repository's files, less the bytecode python imports write beside a model's modules (they do too
    where the steps are served as exported)."""
    return {path: path.read_bytes() for path in sorted(repo.rglob("*"))
            if path.is_file() and "__pycache__" not in path.parts}


def test_the_client_and_its_token_counts_through_a_joined_model(served):
    with EncoderClient(served["joined"]["grpc"], model="embedder") as joined, \
            EncoderClient(served["separate"]["grpc"], model="embedder") as separate:
        assert np.array_equal(joined.embed(TEXTS), separate.embed(TEXTS))
        assert joined.info("embedder").tokenizer == "embedder_tokenizer"
        for texts in (["hello"], TEXTS):
            vectors, tokens = joined.embed_counted(texts)
            assert vectors.shape[0] == len(texts) and tokens == separate.embed_counted(texts)[1] > 2 * len(texts)


def test_a_refused_start_leaves_no_folder_behind(tmp_path, monkeypatch):
    """The backend folder is made before the repository is checked: a refusal removes it."""
    import tempfile

    from nexus_sli.exporter.serving.binary import ServerError
    from nexus_sli.exporter.serving.server import start

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "temporary"))  # this test's folders alone
    (tmp_path / "temporary").mkdir()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ServerError, match="holds no model"):
        start(tmp_path / "empty")
    assert list((tmp_path / "temporary").iterdir()) == []


def test_only_ensembles_whose_steps_one_process_can_run_are_joined(served, tmp_path):
    repo = tmp_path / "repo"
    for name in ("embedder", "embedder_tokenizer", "embedder_encoder", "embedder_tokens"):
        (repo / name).mkdir(parents=True)
        for entry in (served["repo"] / name).iterdir():
            (repo / name / entry.name).symlink_to(entry)
    encoder = tc.read(served["repo"] / "embedder_encoder" / "config.pbtxt")
    encoder.platform, encoder.backend = "tensorrt_plan", ""
    (repo / "embedder_encoder" / "config.pbtxt").unlink()
    tc.write(encoder, repo / "embedder_encoder")
    assert joined_steps.join(repo, tmp_path / "backends") is None
