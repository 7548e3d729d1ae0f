"""sentence-transformers' Dense modules in the exported graph, checked against sentence-transformers.

Three seeded tiny sentence-transformers models, each BERT with mean pooling and Dense modules
(exporter/export/dense.py): a Dense with Tanh on the pooled vector (32 -> 16); a Dense without an
activation (Identity, 32 -> 24) followed by Normalize; a Dense on the token states before the
pooling (Tanh, 32 -> 12) and a residual one after it (ReLU, 12 -> 12).  Exported in fp32, served
by one Triton server and one gateway, and compared at cosine >= 0.9999 with
``SentenceTransformer.encode`` through the client (gRPC and HTTP), OpenAI's ``/v1/embeddings``
(the official SDK) and TEI's ``/embed``; every reported size is the projected one.
"""

from __future__ import annotations

import json

import numpy as np
import openai
import pytest
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer import modules

from nexus_sli.bench.served import Gateway
from nexus_sli.client import EncoderClient
from nexus_sli.exporter.errors import ExportError, NexusError
from nexus_sli.exporter.export import dense, st_folder
from nexus_sli.exporter.export.export_report import DenseRecord
from nexus_sli.exporter.export.pipeline import ExportOptions, run_export
from nexus_sli.exporter.export.revalidate import revalidate
from nexus_sli.exporter.export.validate import validation_texts
from helpers.http_api import call
from helpers.rounding import EPS32, assert_within, matmul_atol
from helpers.servers import gateway_to, serving
from helpers.tiny_models import with_dense
from helpers.vectors import cosines

TEXTS = validation_texts()[:12] + ["", "a", "x " * 300]  # empty, one character, past the model's length
#: What the gateway is sent: the same but the empty text, which it refuses as OpenAI and TEI do
#: (tests/test_gateway_requests.py); ``GATEWAY_ROWS`` are their rows of a reference computed on ``TEXTS``
GATEWAY_ROWS = [i for i, text in enumerate(TEXTS) if text]
GATEWAY_TEXTS = [TEXTS[i] for i in GATEWAY_ROWS]
#: the fp32 bar of every served vector against sentence-transformers'
COSINE = 0.9999
#: model name -> (its Dense modules, whether a Normalize follows, the served size)
MODELS = {
    "dense_tanh": (lambda: [modules.Dense(32, 16, activation_function=torch.nn.Tanh())], False, 16),
    "dense_identity": (lambda: [modules.Dense(32, 24, activation_function=torch.nn.Identity())], True, 24),
    "dense_tokens": (lambda: [modules.Dense(32, 12, activation_function=torch.nn.Tanh(),
                                            module_input_name="token_embeddings"),
                              modules.Dense(12, 12, activation_function=torch.nn.ReLU(), use_residual=True)],
                     False, 12),
}


def _folder(root, checkpoint, name: str):
    heads, normalize, _ = MODELS[name]
    return with_dense(checkpoint, root / name, heads(), seed=sorted(MODELS).index(name) + 7, normalize=normalize)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_checkpoint):
    root = tmp_path_factory.mktemp("dense")
    return {name: _folder(root, tiny_checkpoint("bert"), name) for name in MODELS}


@pytest.fixture(scope="module")
def references(folders):
    return {name: SentenceTransformer(str(folder), device="cpu").encode(TEXTS) for name, folder in folders.items()}


@pytest.fixture(scope="module")
def served(tmp_path_factory, folders):
    repo = tmp_path_factory.mktemp("dense-repo")
    for name, folder in folders.items():
        run_export(ExportOptions(model=str(folder), name=name, out=repo, precision="fp32"))
    with serving(repo) as server:
        yield server


@pytest.fixture(scope="module")
def gateway(served, tmp_path_factory):
    with gateway_to(served["grpc"], "--tei-model", "dense_tanh", log=tmp_path_factory.mktemp("gw") / "dense.log") as started:
        yield started


@pytest.fixture(scope="module", params=["grpc", "http"])
def client(served, request):
    with EncoderClient(served[request.param], protocol=request.param) as c:
        yield c


def _sdk(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("name", MODELS)
def test_client_vectors_match_sentence_transformers(client, references, name):
    got = client.embed(TEXTS, model=name)
    assert got.shape == (len(TEXTS), MODELS[name][2]) and client.info(name).dimensions == MODELS[name][2]
    assert cosines(got, references[name]).min() >= COSINE


def test_the_projection_is_what_makes_them_match(client, folders, references):
    # the pipeline without its Dense module answers other vectors: the test could tell a dropped module
    st = SentenceTransformer(str(folders["dense_identity"]), device="cpu")
    unprojected = SentenceTransformer(modules=[st[0], st[1], st[3]], device="cpu").encode(TEXTS)
    got = client.embed(TEXTS, model="dense_identity")
    assert unprojected.shape[1] == 32 and got.shape[1] == 24
    assert cosines(references["dense_identity"], got).min() >= COSINE
    assert cosines(unprojected[:, :24], got).min() < 0.99


@pytest.mark.parametrize("name", ["dense_tanh", "dense_identity"])
def test_openai_sdk_vectors_sizes_and_the_model_list(gateway, folders, references, name):
    size = MODELS[name][2]
    response = _sdk(gateway).embeddings.create(model=name, input=GATEWAY_TEXTS)
    got = np.array([item.embedding for item in response.data], dtype=np.float32)
    assert got.shape == (len(GATEWAY_TEXTS), size) and cosines(got, references[name][GATEWAY_ROWS]).min() >= COSINE
    short = _sdk(gateway).embeddings.create(model=name, input=GATEWAY_TEXTS, dimensions=8)
    expected = SentenceTransformer(str(folders[name]), device="cpu", truncate_dim=8).encode(GATEWAY_TEXTS)
    assert cosines(np.array([item.embedding for item in short.data]), expected).min() >= COSINE
    with pytest.raises(openai.BadRequestError) as raised:  # the sizes end at the projected one
        _sdk(gateway).embeddings.create(model=name, input="a", dimensions=size + 1)
    assert f"from 1 to {size}" in raised.value.body["message"]
    listed = {m.id: m.model_dump() for m in _sdk(gateway).models.list().data}
    assert listed[name]["dimensions"] == size


@pytest.mark.parametrize("name", ["dense_tanh", "dense_identity"])
def test_tei_embed(gateway, references, name):
    status, _, got = call(f"{gateway.url}/embed", {"inputs": GATEWAY_TEXTS, "model": name})
    assert status == 200, got
    assert np.array(got).shape == (len(GATEWAY_TEXTS), MODELS[name][2])
    assert cosines(np.array(got), references[name][GATEWAY_ROWS]).min() >= COSINE


def test_the_export_records_the_modules_and_revalidates_with_them(served):
    for name in MODELS:
        report = json.loads((served["repo"] / f"{name}_encoder" / "validation.json").read_text())
        assert [module["input"] for module in report["dense"]] == (
            ["token_embeddings", "sentence_embedding"] if name == "dense_tokens" else ["sentence_embedding"])
        assert revalidate(served["repo"], name)["passed"]


# --- what the export refuses -----------------------------------------------------------------------

def _edit_config(folder, **changes) -> None:
    file = folder / "2_Dense" / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))


@pytest.mark.parametrize("activation, message", [
    ("torch.nn.modules.activation.GELU", "not reproduced by the export; known: torch.nn.Identity"),
    ("my_package.Swish", "not a torch.nn module class"),
    ("torch.nn.functional.tanh", "not a torch.nn module class"),
])
def test_an_activation_the_export_cannot_reproduce_is_refused(tmp_path, tiny_checkpoint, activation, message):
    folder = _folder(tmp_path, tiny_checkpoint("bert"), "dense_tanh")
    _edit_config(folder, activation_function=activation)
    with pytest.raises(NexusError, match=message):
        run_export(ExportOptions(model=str(folder), name="refused", out=tmp_path / "repo", precision="fp32"))


def test_a_dense_that_reads_another_feature_than_its_place_gives_is_refused(tmp_path, tiny_checkpoint):
    folder = _folder(tmp_path, tiny_checkpoint("bert"), "dense_tanh")
    _edit_config(folder, module_input_name="token_embeddings", module_output_name="token_embeddings")
    with pytest.raises(NexusError, match="must read and write 'sentence_embedding'"):
        run_export(ExportOptions(model=str(folder), name="refused", out=tmp_path / "repo", precision="fp32"))


def test_the_python_post_processing_step_refuses_dense_modules(tmp_path, tiny_checkpoint):
    folder = _folder(tmp_path, tiny_checkpoint("bert"), "dense_tanh")
    with pytest.raises(ExportError, match="does not apply Dense modules.*pooling in the graph"):
        run_export(ExportOptions(model=str(folder), name="refused", out=tmp_path / "repo", precision="fp32",
                                 pool_in_graph=False))


# --- what the export reads -------------------------------------------------------------------------

@pytest.mark.parametrize("safe", [True, False])
def test_a_dense_module_is_read_as_sentence_transformers_runs_it(tmp_path, safe):
    # pickle weights (pytorch_model.bin) too, only where allowed (exporter/export/pickles.py); a residual through
    # its projection
    module = modules.Dense(8, 5, activation_function=torch.nn.Sigmoid(), use_residual=True)
    torch.manual_seed(4)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.uniform_(-1.0, 1.0)
    module.save(str(tmp_path), safe_serialization=safe)
    assert (tmp_path / ("model.safetensors" if safe else "pytorch_model.bin")).is_file()
    read = st_folder.read_dense(tmp_path, dense.SENTENCE, allow_pickle=not safe)
    x = torch.randn(3, 8)
    with torch.no_grad():
        expected = module({"sentence_embedding": x})["sentence_embedding"].numpy()
    assert (read.in_features, read.out_features, read.activation) == (8, 5, "Sigmoid")
    # ours adds in float64, PyTorch's float32 kernels in their own order: the two products' rounding (the
    # sigmoid only shrinks it), then the sigmoid's and the residual's sum's own, relative to the output
    with_bias = np.concatenate([x.numpy(), np.ones((3, 1), np.float32)], axis=1)
    rounding = matmul_atol(with_bias, np.vstack([read.weight.T, read.bias])) + matmul_atol(x.numpy(), read.residual.T)
    assert_within(read(x.numpy()), expected, rounding, rtol=2 * EPS32)
    # the record keeps the float32 weights exactly, and the same arithmetic runs on them: the same bits
    stored = DenseRecord.from_dict(json.loads(json.dumps(read.record().to_dict())))
    assert np.array_equal(dense.Dense.from_record(stored)(x.numpy()), read(x.numpy()))
