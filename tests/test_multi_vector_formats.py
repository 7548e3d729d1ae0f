"""Late-interaction (ColBERT) folders read as sentence-transformers' ``MultiVectorEncoder`` reads them.

For each save format (its own, PyLate 3's, Stanford ColBERT's; seeded tiny models
from ``helpers/colbert_models.py``) and the settings that change what a side
does (fixed or min expansion, attended or not, skiplists on either side,
kept-only ids, a prompt named ``passage``, the similarity):
``read_multi_vector`` finds what ``MultiVectorEncoder`` loaded (prompts,
truncation lengths, expansion, skiplist ids, projection, similarity), the served
tokenizer with the markers added gives the ids sentence-transformers feeds the
encoder, and the numpy head on the encoder's token states gives the vectors of
``encode_query`` / ``encode_document``.  Then the folders the export refuses,
each named in the error.
"""

from __future__ import annotations

import json
import shutil
import string

import numpy as np
import pytest
import torch
from sentence_transformers import MultiVectorEncoder
from sentence_transformers.base.modules import Dense, Normalize
from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask
from tokenizers import Tokenizer

from nexus_sli.exporter.errors import NexusError, UnsupportedModelError
from nexus_sli.exporter.export.multi_vector import (NATIVE, PYLATE, STANFORD, add_markers, is_multi_vector,
                                                    multi_vectors, read_multi_vector)
from nexus_sli.exporter.triton.python_models.sides import DOCUMENT, QUERY
from helpers.colbert_models import PYLATE_MARKERS, UNUSED, colbert_folder, colbert_tokenizer, sample_texts

POSITIONS = 128
FORMAT_NAMES = {"native": NATIVE, "pylate": PYLATE, "stanford": STANFORD}


def _keep_ids() -> list[int]:
    """Ids of tokens the sample texts have (and of a marker's pieces): the only ones documents score."""
    return sorted(set(colbert_tokenizer().encode("[D] the capital, of.", add_special_tokens=False).ids))


#: id -> (format, colbert_folder options)
CASES = {
    "native-fixed": ("native", {}),
    "native-min-attend": ("native", {"strategy": "min", "attend": True, "query_length": 20, "bias": True}),
    "native-min-model-length": ("native", {"strategy": "min", "expansion_length": 6, "document_length": None}),
    "native-no-expansion": ("native", {"strategy": None, "query_length": 10, "similarity": "meanmaxsim"}),
    "native-skiplists": ("native", {"skiplist_words": [*string.punctuation, "the", "zzzz"],
                                    "skiplist_tasks": ["query", "document"], "keep_only_token_ids": "keep",
                                    "prompts": {"query": "[Q] ", "passage": "[P] "}}),
    "pylate": ("pylate", {"bias": True}),
    "pylate-no-expansion": ("pylate", {"strategy": None}),
    "pylate-attend-meanmaxsim": ("pylate", {"attend": True, "similarity": "meanmaxsim",
                                            "skiplist_words": [",", "."]}),
    "stanford": ("stanford", {}),
    "stanford-attend": ("stanford", {"attend": True, "document_length": 16}),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(format, folder, the loaded MultiVectorEncoder, the folder's config, the served tokenizer as the
    export writes it: the folder's with the markers added)."""
    format, options = CASES[request.param]
    if options.get("keep_only_token_ids") == "keep":
        options = {**options, "keep_only_token_ids": _keep_ids()}
    folder = colbert_folder(tmp_path_factory.mktemp(request.param), format, **options)
    torch.manual_seed(0)
    model = MultiVectorEncoder(str(folder), device="cpu")
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    config = read_multi_vector(folder, tokenizer, POSITIONS)
    served = tmp_path_factory.mktemp("served") / "tokenizer.json"
    add_markers(tokenizer, config).save(str(served))
    return format, folder, model, config, Tokenizer.from_file(str(served))


def _mask_module(model) -> MultiVectorMask:
    return next(module for module in model if isinstance(module, MultiVectorMask))


def test_the_folder_reads_as_sentence_transformers_loads_it(case):
    format, folder, model, config, _ = case
    transformer, mask = model[0], _mask_module(model)
    assert is_multi_vector(folder) and config.format == FORMAT_NAMES[format]
    assert config.similarity == model.similarity_fn_name
    assert config.sides.query.prompt == (model.prompts.get("query") or "")
    assert config.sides.document.prompt == (model.prompts.get("document") or "")
    expected_skiplist = () if mask._skiplist_ids is None else tuple(mask._skiplist_ids.tolist())
    assert config.sides.skiplist_ids == expected_skiplist
    for name, side in ((QUERY, config.sides.query), (DOCUMENT, config.sides.document)):
        assert side.skiplist == (bool(expected_skiplist) and name in mask.skiplist_tasks)
    assert config.sides.document.keep_only_ids == (tuple(mask.keep_only_token_ids)
                                                    if mask.keep_only_token_ids else None)
    assert config.sides.query.keep_only_ids is None
    expansion = transformer.query_expansion
    if expansion is None:
        assert config.sides.query.expansion is None
    else:
        got = config.sides.query.expansion
        assert (got.strategy, got.length, got.attend) == (expansion["strategy"], expansion["length"],
                                                          expansion["attend"])
        assert got.token_id == model.tokenizer.mask_token_id
    assert config.normalize == any(isinstance(module, Normalize) for module in model)
    projections = [module for module in model if isinstance(module, Dense)]
    assert len(config.dense) == len(projections)
    for ours, theirs in zip(config.dense, projections):
        np.testing.assert_array_equal(ours.weight, theirs.linear.weight.detach().numpy())
        if theirs.linear.bias is None:
            assert ours.bias is None
        else:
            np.testing.assert_array_equal(ours.bias, theirs.linear.bias.detach().numpy())
    markers = {"native": (), "pylate": PYLATE_MARKERS, "stanford": UNUSED}[format]
    assert config.added_special_tokens == markers


def _st_features(model, texts: list[str], side: str) -> dict:
    """sentence-transformers' arrays for ``texts`` on ``side``, with the prompt its encode method picks."""
    prompt = model.prompts.get("query") if side == QUERY else model.prompts.get("document")
    return model.preprocess(texts, prompt=prompt, task=side)


def _score_mask(features: dict, side, sides) -> np.ndarray:
    """The scoring mask from sentence-transformers' tokenization and the folder's side settings."""
    ids = features["input_ids"].numpy()
    expanded = features.get("query_expansion_positions")
    score = features["attention_mask"].numpy().astype(bool)
    if expanded is not None:
        score |= expanded.numpy()
    if side.skiplist:
        score &= ~np.isin(ids, sides.skiplist_ids)
    if side.keep_only_ids is not None:
        score &= np.isin(ids, side.keep_only_ids)
    return score


@pytest.mark.parametrize("side_name", [QUERY, DOCUMENT])
def test_the_served_tokenizer_gives_sentence_transformers_ids(case, side_name):
    """The prompt, the registered markers and the side's truncation length, as the served tokenizer applies
    them: the real tokens equal those sentence-transformers feeds the encoder, expansion positions hold the
    expansion token."""
    _, _, model, config, tokenizer = case
    side = config.sides.side(side_name)
    tokenizer.enable_truncation(side.max_length)
    features = _st_features(model, sample_texts(), side_name)
    ids = features["input_ids"].numpy()
    expanded = features.get("query_expansion_positions")
    for row, text in enumerate(sample_texts()):
        ours = tokenizer.encode(side.prompt + text).ids
        assert ids[row, : len(ours)].tolist() == ours
        if side.expansion is not None:
            assert expanded[row].numpy().tolist() == [len(ours) <= i < side.expansion.length
                                                      for i in range(ids.shape[1])]
            assert (ids[row][expanded[row].numpy()] == side.expansion.token_id).all()


@pytest.mark.parametrize("side_name", [QUERY, DOCUMENT])
def test_the_numpy_head_gives_sentence_transformers_vectors(case, side_name):
    _, _, model, config, _ = case
    side = config.sides.side(side_name)
    features = _st_features(model, sample_texts(), side_name)
    with torch.inference_mode():
        hidden = model[0](dict(features))["token_embeddings"].numpy()
    ours = multi_vectors(hidden, _score_mask(features, side, config.sides), config)
    encode = model.encode_query if side_name == QUERY else model.encode_document
    theirs = encode(sample_texts(), convert_to_numpy=True)
    for mine, reference in zip(ours, theirs):
        assert mine.shape == reference.shape
        if not len(mine):  # every token of this document skipped or not kept
            continue
        cosines = (mine * reference).sum(-1) / (np.linalg.norm(mine, axis=-1) * np.linalg.norm(reference, axis=-1))
        assert cosines.min() >= 0.9999
        if config.normalize:
            np.testing.assert_allclose(np.linalg.norm(mine, axis=-1), 1.0, rtol=1e-5)


def test_a_plain_model_folder_is_not_multi_vector(tiny_checkpoint):
    assert not is_multi_vector(tiny_checkpoint("bert"))


@pytest.fixture(scope="module")
def native_folder(tmp_path_factory):
    return colbert_folder(tmp_path_factory.mktemp("refused"), "native")


def _copy(folder, tmp_path):
    return shutil.copytree(folder, tmp_path / "model")


def _edit(file, change) -> None:
    file.write_text(json.dumps(change(json.loads(file.read_text()))))


def _read(folder, **options):
    return read_multi_vector(folder, Tokenizer.from_file(str(folder / "tokenizer.json")),
                             options.pop("max_positions", POSITIONS), **options)


@pytest.mark.parametrize("module", ["HierarchicalTokenPooling", "LambdaTokenPooling", "Pooling"])
def test_a_module_the_export_leaves_out_is_refused(native_folder, tmp_path, module):
    folder = _copy(native_folder, tmp_path)
    entry = {"idx": 4, "name": "4", "path": f"4_{module}", "type": f"sentence_transformers.modules.{module}"}
    _edit(folder / "modules.json", lambda modules: [*modules, entry])
    with pytest.raises(NexusError, match=rf"modules\.json.*{module}") as refused:
        _read(folder)
    if module.endswith("TokenPooling"):
        assert "clusters document vectors at encode time; the export does not reproduce it" in str(refused.value)


def test_a_retrieval_architecture_is_refused(native_folder, tmp_path):
    folder = _copy(native_folder, tmp_path)
    _edit(folder / "config.json", lambda config: {**config, "architectures": ["ColPaliForRetrieval"]})
    with pytest.raises(UnsupportedModelError, match=r"config\.json names ColPaliForRetrieval"):
        _read(folder)


def test_a_side_longer_than_the_positions_is_refused(native_folder):
    with pytest.raises(NexusError, match="document length is 24 tokens; the encoder has 16 positions"):
        _read(native_folder, max_positions=16)


def test_a_similarity_asked_for_must_be_a_late_interaction_one(native_folder):
    assert _read(native_folder, similarity="meanmaxsim").similarity == "meanmaxsim"
    with pytest.raises(NexusError, match="unknown similarity 'cosine'"):
        _read(native_folder, similarity="cosine")


def test_a_saved_similarity_that_is_not_late_interaction_falls_back_to_maxsim(native_folder, tmp_path):
    folder = _copy(native_folder, tmp_path)
    _edit(folder / "config_sentence_transformers.json", lambda config: {**config, "similarity_fn_name": "cosine"})
    assert _read(folder).similarity == MultiVectorEncoder(str(folder), device="cpu").similarity_fn_name == "maxsim"


def test_a_stanford_checkpoint_without_its_projection_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = colbert_folder(tmp_path / "stanford", "stanford")
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["linear.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(NexusError, match="linear.weight"):
        _read(folder)
