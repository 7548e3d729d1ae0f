"""Retrieval models as their authors meant them, checked against sentence-transformers on seeded models:
named prompts and Matryoshka sizes through the client, TEI's routes and the ``openai`` SDK; sparse
(SPLADE) and token embeddings through the client and TEI's ``/embed_sparse`` and ``/embed_all``.

One Triton server for the module, serving a seeded tiny sentence-transformers model
saved with prompts (``query: ``, ``passage: ``, the default ``query``) and a model
card naming its Matryoshka sizes, and a seeded tiny SparseEncoder (BERT masked-LM,
SPLADE max pooling, a ``query`` prompt), both exported with ``auto``; one gateway
in front of them.
"""

from __future__ import annotations

import json

import numpy as np
import openai
import pytest
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer import modules as models
from tokenizers import Tokenizer

from nexus_sli.bench.served import Gateway
from nexus_sli.client import AsyncEncoderClient, EncoderClient, InvalidInputError
from nexus_sli.exporter.errors import NexusError
from nexus_sli.exporter.export.pipeline import ExportOptions, run_export
from nexus_sli.exporter.export.st_folder import matryoshka_dims, prompts
from nexus_sli.exporter.export.validate import validation_texts
from helpers.servers import gateway_to, serving
from helpers import task_models
from helpers.http_api import call, schema_problems, tei_schema
from helpers.vectors import cosines

NAME = "retriever"
SPLADE = "splade"
LAYER_NORMED = "layer_normed"
PROMPTS = {"query": "query: ", "passage": "passage: "}
TRAINED = [32, 16, 8]
TEXTS = validation_texts()[:12] + ["", "a", "x " * 300]  # empty, one character, past the model's length
#: What the gateway is sent: the same but the empty text, which it refuses as OpenAI and TEI do
#: (tests/test_gateway_requests.py)
GATEWAY_TEXTS = [text for text in TEXTS if text]
#: the fp32 bar of every served vector against sentence-transformers'
COSINE = 0.9999

# sentence-transformers writes a MatryoshkaLoss's sizes into the card it saves (README.md) like this
CARD = """
### Training Hyperparameters
```json
{
    "loss": "MultipleNegativesRankingLoss",
    "matryoshka_dims": [
        8,
        32,
        16
    ],
    "matryoshka_weights": [1, 1, 1]
}
```
"""


@pytest.fixture(scope="module")
def retriever(tmp_path_factory, tiny_checkpoint):
    """A sentence-transformers folder: tiny BERT, mean pooling, normalisation, prompts and a Matryoshka card."""
    folder = tmp_path_factory.mktemp("retriever") / "model"
    transformer = models.Transformer(str(tiny_checkpoint("bert")), max_seq_length=64)
    st = SentenceTransformer(modules=[transformer, models.Pooling(32, "mean"), models.Normalize()],
                             prompts=PROMPTS, default_prompt_name="query", device="cpu")
    st.save(str(folder))
    with open(folder / "README.md", "a") as card:
        card.write(CARD)
    return folder


@pytest.fixture(scope="module")
def splade(tmp_path_factory, tiny_tokenizer):
    """A SparseEncoder folder: a tiny seeded BERT masked-LM, SPLADE max pooling, a ``query`` prompt."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling

    root = tmp_path_factory.mktemp("splade")
    mlm = task_models.save(task_models.masked_lm("bert", 21), tiny_tokenizer, root / "mlm")
    SparseEncoder(modules=[Transformer(str(mlm), transformer_task="fill-mask"), SpladePooling("max")],
                  prompts={"query": "query: "}, device="cpu").save(str(root / "model"))
    return root / "model"


@pytest.fixture(scope="module")
def layer_normed(tmp_path_factory, tiny_checkpoint):
    """Transformer -> Pooling -> LayerNorm (seeded weight and bias, not the identity) -> Normalize."""
    import torch

    folder = tmp_path_factory.mktemp("layer-normed") / "model"
    norm = models.LayerNorm(32)
    torch.manual_seed(3)
    with torch.no_grad():
        norm.norm.weight.uniform_(0.2, 3.0)
        norm.norm.bias.uniform_(-1.0, 1.0)
    transformer = models.Transformer(str(tiny_checkpoint("bert")), max_seq_length=64)
    SentenceTransformer(modules=[transformer, models.Pooling(32, "mean"), norm, models.Normalize()],
                        device="cpu").save(str(folder))
    return folder


@pytest.fixture(scope="module")
def served(tmp_path_factory, retriever, splade, layer_normed):
    repo = tmp_path_factory.mktemp("retrieval-repo")
    run_export(ExportOptions(model=str(retriever), name=NAME, out=repo))
    run_export(ExportOptions(model=str(splade), name=SPLADE, out=repo))
    run_export(ExportOptions(model=str(layer_normed), name=LAYER_NORMED, out=repo))
    with serving(repo) as server:
        yield server


@pytest.fixture(scope="module")
def reference(retriever):
    return SentenceTransformer(str(retriever), device="cpu")


@pytest.fixture(scope="module")
def gateway(served, tmp_path_factory):
    # two models serve embeddings: TEI's routes (which name none) use the retriever
    with gateway_to(served["grpc"], "--tei-model", NAME, log=tmp_path_factory.mktemp("gw") / "retrieval.log") as started:
        yield started


@pytest.fixture(scope="module", params=["grpc", "http"])
def client(served, request):
    with EncoderClient(served[request.param], protocol=request.param, model=NAME) as c:
        yield c


# --- what the export reads ------------------------------------------------------------------------

def saved_prompts(folder) -> dict[str, str]:
    """The prompts as sentence-transformers saved them (it adds its own, such as an empty ``document``)."""
    return json.loads((folder / "config_sentence_transformers.json").read_text())["prompts"]


def test_export_reads_prompts_and_trained_sizes(retriever, served):
    assert saved_prompts(retriever).items() >= PROMPTS.items()
    assert prompts(retriever) == (saved_prompts(retriever), "query")
    assert matryoshka_dims(retriever, 32) == TRAINED and matryoshka_dims(retriever, 16) == [16, 8]
    tokenizer = (served["repo"] / f"{NAME}_tokenizer" / "config.pbtxt").read_text()
    ensemble = (served["repo"] / NAME / "config.pbtxt").read_text()
    for config in (tokenizer, ensemble):
        assert '"query": "query: "' in config.replace('\\"', '"') and 'string_value: "query"' in config
    assert "matryoshka_dims" in ensemble


def test_prompt_configs_that_cannot_be_served_are_refused(tmp_path, retriever):
    folder = tmp_path / "bad"
    folder.mkdir()
    for name in ("modules.json", "config_sentence_transformers.json"):
        (folder / name).write_text((retriever / name).read_text())
    (folder / "1_Pooling").mkdir()
    pooling = json.loads((retriever / "1_Pooling" / "config.json").read_text())
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({**pooling, "include_prompt": False}))
    with pytest.raises(NexusError, match="include_prompt"):
        prompts(folder)
    config = json.loads((retriever / "config_sentence_transformers.json").read_text())
    (folder / "config_sentence_transformers.json").write_text(json.dumps({**config, "default_prompt_name": "doc"}))
    with pytest.raises(NexusError, match="default_prompt_name 'doc' is not one of its prompts"):
        prompts(folder)


# --- the client -----------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt_name", [None, "query", "passage"])
def test_client_applies_the_models_prompts(client, reference, prompt_name):
    got = client.embed(TEXTS, prompt_name=prompt_name)
    expected = reference.encode(TEXTS, prompt_name=prompt_name)  # None: the default prompt, as served
    assert cosines(got, expected).min() >= COSINE
    # the prompt changes the vectors: a test that could not tell them apart would prove nothing
    assert cosines(got, reference.encode(TEXTS, prompt="")).min() < 0.99


def test_an_unknown_prompt_is_refused_with_the_known_ones(client, served):
    with pytest.raises(InvalidInputError, match="unknown prompt_name 'instruction'.*'document', 'passage', 'query'"):
        client.embed("a text", prompt_name="instruction")
    # the tokenizer step refuses it too, for a client that sends the parameter itself
    import tritonclient.grpc as grpcclient

    raw = grpcclient.InferenceServerClient(served["grpc"])
    text = grpcclient.InferInput("TEXT", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"a text"]], dtype=object))
    with pytest.raises(Exception, match="unknown prompt_name 'instruction'; this model's prompts: 'document', 'passage', 'query'"):
        raw.infer(NAME, [text], parameters={"prompt_name": "instruction"})


@pytest.mark.parametrize("dimensions", [1, 8, 16, 31, 32])
def test_client_matryoshka_sizes_match_sentence_transformers(client, retriever, dimensions):
    got = client.embed(TEXTS, prompt_name="passage", dimensions=dimensions)
    shortened = SentenceTransformer(str(retriever), device="cpu", truncate_dim=dimensions)
    expected = shortened.encode(TEXTS, prompt_name="passage", normalize_embeddings=True)
    assert got.shape == (len(TEXTS), dimensions)
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert cosines(got, expected).min() >= COSINE
    assert np.abs(got - expected).max() < 1e-3 or dimensions == 1  # unit vectors: close element by element
    assert client.embed("one text", dimensions=dimensions).shape == (dimensions,)


@pytest.mark.parametrize("dimensions", [0, 33, -1, 2.5, True])
def test_client_refuses_sizes_outside_the_model(client, dimensions):
    with pytest.raises(InvalidInputError, match="dimensions must be an integer from 1"):
        client.embed("a text", dimensions=dimensions)


def test_async_client_takes_prompts_and_sizes(served, reference, retriever):
    import asyncio

    async def run():
        async with AsyncEncoderClient(served["grpc"], model=NAME) as c:
            return await c.embed(TEXTS, prompt_name="passage", dimensions=16)

    got = asyncio.run(run())
    expected = SentenceTransformer(str(retriever), device="cpu", truncate_dim=16).encode(
        TEXTS, prompt_name="passage", normalize_embeddings=True)
    assert cosines(got, expected).min() >= COSINE


# --- the gateway: OpenAI's route through the official SDK, and TEI's ------------------------------

def _sdk(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)


def _tokens(retriever, texts: list[str], prompt: str) -> int:
    tokenizer = Tokenizer.from_file(str(retriever / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(64)  # the model's max_seq_length
    return sum(len(e.ids) for e in tokenizer.encode_batch([prompt + t for t in texts]))


@pytest.mark.parametrize("prompt_name", [None, "passage"])
@pytest.mark.parametrize("dimensions", [None, 8, 20])
def test_openai_sdk_prompts_and_dimensions(gateway, reference, retriever, prompt_name, dimensions):
    extra = {"extra_body": {"prompt_name": prompt_name}} if prompt_name else {}
    sizes = {"dimensions": dimensions} if dimensions else {}
    response = _sdk(gateway).embeddings.create(model=NAME, input=GATEWAY_TEXTS, **sizes, **extra)
    got = np.array([item.embedding for item in response.data], dtype=np.float32)
    st = SentenceTransformer(str(retriever), device="cpu", truncate_dim=dimensions) if dimensions else reference
    expected = st.encode(GATEWAY_TEXTS, prompt_name=prompt_name, normalize_embeddings=True)
    assert got.shape == (len(GATEWAY_TEXTS), dimensions or 32)
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # unit vectors, as OpenAI's are
    assert cosines(got, expected).min() >= COSINE
    # usage counts the prompt's tokens too, as OpenAI's counts everything the model read
    prompt = PROMPTS[prompt_name or "query"]
    assert response.usage.prompt_tokens == _tokens(retriever, GATEWAY_TEXTS, prompt)
    assert response.usage.prompt_tokens > _tokens(retriever, GATEWAY_TEXTS, "")


def test_openai_refusals_name_the_field(gateway):
    with pytest.raises(openai.BadRequestError) as raised:
        _sdk(gateway).embeddings.create(model=NAME, input="a", extra_body={"prompt_name": "instruction"})
    assert raised.value.body["param"] == "prompt_name"
    assert "document, passage, query" in raised.value.body["message"]
    for bad in (0, 33):
        with pytest.raises(openai.BadRequestError) as raised:
            _sdk(gateway).embeddings.create(model=NAME, input="a", dimensions=bad)
        assert raised.value.body["param"] == "dimensions"
        assert "from 1 to 32" in raised.value.body["message"] and "trained for 32, 16, 8" in raised.value.body["message"]


def test_models_list_sizes_and_prompts(gateway, retriever):
    listed = {m.id: m for m in _sdk(gateway).models.list().data}
    model = listed[NAME].model_dump()
    assert model["dimensions"] == 32 and model["matryoshka_dimensions"] == TRAINED
    assert model["prompts"] == saved_prompts(retriever) and model["default_prompt_name"] == "query"


@pytest.mark.parametrize("prompt_name", [None, "query", "passage"])
def test_tei_embed_prompt_name_and_dimensions(gateway, reference, retriever, prompt_name):
    body = {"inputs": GATEWAY_TEXTS, **({"prompt_name": prompt_name} if prompt_name else {})}
    status, _, got = call(f"{gateway.url}/embed", body)
    assert status == 200, got
    assert cosines(np.array(got), reference.encode(GATEWAY_TEXTS, prompt_name=prompt_name)).min() >= COSINE
    status, _, short = call(f"{gateway.url}/embed", {**body, "dimensions": 16})
    assert status == 200, short
    expected = SentenceTransformer(str(retriever), device="cpu", truncate_dim=16).encode(
        GATEWAY_TEXTS, prompt_name=prompt_name, normalize_embeddings=True)
    assert np.array(short).shape == (len(GATEWAY_TEXTS), 16)
    assert np.allclose(np.linalg.norm(short, axis=1), 1.0, atol=1e-5)
    assert cosines(np.array(short), expected).min() >= COSINE


def test_tei_refuses_an_unknown_prompt(gateway):
    status, _, body = call(f"{gateway.url}/embed", {"inputs": "a", "prompt_name": "instruction"})
    assert status == 422 and body["error_type"] == "Validation"
    assert "unknown prompt_name 'instruction'" in body["error"] and "document, passage, query" in body["error"]


def test_cli_embed_takes_a_prompt_and_a_size(served, retriever, capsys):
    from nexus_sli.cli.main import main

    args = ["embed", "--model", NAME, "--url", served["grpc"], "--prompt-name", "passage", "--dimensions", "8"]
    assert main([*args, "first text", "second"]) == 0
    got = np.array(json.loads(capsys.readouterr().out))
    expected = SentenceTransformer(str(retriever), device="cpu", truncate_dim=8).encode(
        ["first text", "second"], prompt_name="passage", normalize_embeddings=True)
    assert got.shape == (2, 8) and cosines(got, expected).min() >= COSINE
    assert main([*args[:-4], "--prompt-name", "instruction", "a text"]) == 3
    assert "unknown prompt_name 'instruction'" in capsys.readouterr().err


def test_a_pipeline_with_modules_the_export_leaves_out_is_refused(tmp_path, tiny_checkpoint):
    # an LSTM over the token states changes every vector, and the export does not reproduce it: refused, not dropped
    folder = tmp_path / "with-lstm"
    transformer = models.Transformer(str(tiny_checkpoint("bert")), max_seq_length=64)
    SentenceTransformer(modules=[transformer, models.LSTM(32, 8), models.Pooling(16, "mean"), models.Normalize()],
                        device="cpu").save(str(folder))
    with pytest.raises(NexusError, match="Transformer, LSTM, Pooling, Normalize.*would leave the others out"):
        run_export(ExportOptions(model=str(folder), name="lstm", out=tmp_path / "repo"))
    assert not (tmp_path / "repo" / "lstm").exists()


@pytest.mark.parametrize("dimensions", [None, 4, 16])
def test_a_layer_norm_before_the_normalisation_is_kept_and_sizes_are_cut_after_it(served, layer_normed, client,
                                                                                  dimensions):
    """Transformer -> Pooling -> LayerNorm -> Normalize (a Matryoshka model that normalises its layer
    before cutting): the served vectors, cut to every size, match sentence-transformers' pipeline."""
    got = client.embed(TEXTS, model=LAYER_NORMED, dimensions=dimensions)
    shortened = SentenceTransformer(str(layer_normed), device="cpu", truncate_dim=dimensions)
    expected = shortened.encode(TEXTS, normalize_embeddings=True)
    assert cosines(got, expected).min() >= COSINE
    # without the layer norm the vectors differ: the test could tell a dropped module
    plain = SentenceTransformer(modules=[shortened[0], shortened[1], shortened[3]], device="cpu",
                                truncate_dim=dimensions).encode(TEXTS, normalize_embeddings=True)
    assert cosines(got, plain).min() < 0.99



# --- sparse (SPLADE) embeddings -------------------------------------------------------------------

@pytest.fixture(scope="module")
def sparse_reference(splade):
    from sentence_transformers import SparseEncoder

    return SparseEncoder(str(splade), device="cpu")


def _dense(found, size: int) -> np.ndarray:
    return np.stack([e.dense(size) for e in found])


@pytest.mark.parametrize("prompt_name", [None, "query"])
def test_client_sparse_embeddings_match_sparse_encoder(client, sparse_reference, prompt_name):
    found = client.embed_sparse(TEXTS, model=SPLADE, prompt_name=prompt_name)
    size = client.info(SPLADE).params["vocab_size"]
    expected = sparse_reference.encode(TEXTS, prompt_name=prompt_name).to_dense().numpy()
    got = _dense(found, int(size))
    assert cosines(got, expected).min() >= COSINE
    for e, row in zip(found, expected):  # the same active terms, ids ascending, weights > 0
        assert np.array_equal(e.indices, np.flatnonzero(row)) and (np.diff(e.indices) > 0).all()
        assert (e.values > 0).all()
    # top_k keeps the largest terms, as sentence-transformers' max_active_dims does
    top = client.embed_sparse(TEXTS, model=SPLADE, prompt_name=prompt_name, top_k=5)
    expected_top = sparse_reference.encode(TEXTS, prompt_name=prompt_name, max_active_dims=5).to_dense().numpy()
    assert all(len(e.indices) <= 5 for e in top)
    assert all(set(e.indices) == set(np.flatnonzero(row)) for e, row in zip(top, expected_top))
    one = client.embed_sparse("one text", model=SPLADE)
    assert one.indices.ndim == 1 and len(one.indices) == len(one.values) > 0


def test_tei_embed_sparse(gateway, client, sparse_reference):
    status, _, got = call(f"{gateway.url}/embed_sparse", {"inputs": GATEWAY_TEXTS, "prompt_name": "query"})
    assert status == 200, got
    assert schema_problems(got, tei_schema("EmbedSparseResponse")) == []
    size = int(client.info(SPLADE).params["vocab_size"])
    dense = np.zeros((len(GATEWAY_TEXTS), size), np.float32)
    for row, terms in zip(dense, got):
        row[[t["index"] for t in terms]] = [t["value"] for t in terms]
    expected = sparse_reference.encode(GATEWAY_TEXTS, prompt_name="query").to_dense().numpy()
    assert cosines(dense, expected).min() >= COSINE
    status, _, body = call(f"{gateway.url}/embed_sparse", {"inputs": "a", "prompt_name": "passage"})
    assert status == 422 and "unknown prompt_name 'passage'" in body["error"]


# --- token embeddings -----------------------------------------------------------------------------

def _token_reference(reference, texts, prompt_name=None) -> list[np.ndarray]:
    return [t.numpy() for t in reference.encode(texts, output_value="token_embeddings", prompt_name=prompt_name)]


def _same_tokens(got: list[np.ndarray], expected: list[np.ndarray]) -> None:
    assert [len(g) for g in got] == [len(e) for e in expected]
    for g, e in zip(got, expected):
        assert cosines(np.asarray(g), e).min() >= COSINE


@pytest.mark.parametrize("prompt_name", [None, "passage"])
def test_client_token_embeddings_match_sentence_transformers(client, reference, prompt_name):
    got = client.embed_tokens(TEXTS, prompt_name=prompt_name)
    _same_tokens(got, _token_reference(reference, TEXTS, prompt_name))
    assert client.embed_tokens("one text").shape[1] == 32


def test_token_embeddings_of_a_model_without_them_is_a_clear_error(client):
    from nexus_sli.client import WrongTaskError

    with pytest.raises(WrongTaskError, match=f"model '{SPLADE}' serves no token embeddings"):
        client.embed_tokens("a text", model=SPLADE)


def test_async_client_sparse_and_token_embeddings(served, reference, sparse_reference):
    import asyncio

    async def run():
        async with AsyncEncoderClient(served["grpc"], model=NAME) as c:
            return await c.embed_tokens(TEXTS), await c.embed_sparse(TEXTS, model=SPLADE)

    tokens, sparse = asyncio.run(run())
    _same_tokens(tokens, _token_reference(reference, TEXTS))
    expected = sparse_reference.encode(TEXTS).to_dense().numpy()
    assert cosines(_dense(sparse, expected.shape[1]), expected).min() >= COSINE


def test_tei_embed_all(gateway, reference):
    status, _, got = call(f"{gateway.url}/embed_all", {"inputs": GATEWAY_TEXTS, "prompt_name": "passage"})
    assert status == 200, got
    assert schema_problems(got, tei_schema("EmbedAllResponse")) == []
    _same_tokens([np.array(vectors) for vectors in got], _token_reference(reference, GATEWAY_TEXTS, "passage"))


def test_the_token_ensemble_is_no_model_of_its_own_in_the_list(gateway):
    listed = {m.id: m.model_dump()["task"] for m in _sdk(gateway).models.list().data}
    assert listed == {NAME: "embedding", SPLADE: "sparse-embedding", LAYER_NORMED: "embedding"}
