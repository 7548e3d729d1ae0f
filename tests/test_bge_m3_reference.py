"""BGE-M3's three outputs (exporter/export/m3_heads.py) against FlagEmbedding's ``BGEM3FlagModel``.

FlagEmbedding does not install beside the product (it needs transformers 4), so
its outputs on the seeded tiny BGE-M3 (:mod:`helpers.m3_models`) are kept in
``tests/data/bge_m3/flag_reference.json``, written by
``tests/references/flag_m3.py`` in a venv of its own.  Here the folder is built
again and its weights' fingerprint checked against the file's.  The numpy
reference on PyTorch's token states, and the tiny encoder's ONNX graph with the
heads' nodes appended (run by ONNX Runtime on one padded batch, with and without
the padding trim; first held to the numpy reference of the same batch), must give
FlagEmbedding's outputs: dense and ColBERT vectors at cosine >= 0.9999 per
vector, the same lexical ids wherever FlagEmbedding's weight is >= 1e-4, weights
and both scores within 1e-4 relative.

The last test (``real_checkpoint``: ``make test-real``, which builds the venv)
runs the script again and checks that it reproduces the kept file.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from nexus_sli.exporter.errors import CheckpointError, UnsafeCheckpointError
from nexus_sli.exporter.export import m3_heads
from nexus_sli.exporter.export.m3_heads import (M3Output, add_m3_heads, colbert_score, dropped_token_ids, is_bge_m3,
                                                lexical_score, lexical_weights, m3_arrays, m3_outputs,
                                                read_m3_heads)
from nexus_sli.exporter.export.onnx_export import export_onnx, model_input_names
from nexus_sli.exporter.export.padding_trim import add_padding_trim
from nexus_sli.exporter.triton.python_models.sides import SCORE_MASK
from nexus_sli.tasks import get_task
from helpers.m3_models import COLBERT_DIM, build_m3, weights_fingerprint
from helpers.tiny_models import COMMON, VOCAB, quiet_session
from helpers.vectors import cosines

REFERENCE = Path(__file__).parent / "data" / "bge_m3" / "flag_reference.json"
SIDES = ("queries", "documents")
#: the issue's bars: per-vector cosine, the weight from which an id must be present, relative tolerance
COSINE, PRESENT, RELATIVE = 0.9999, 1e-4, 1e-4
OUTPUTS = ("EMBEDDING", "SPARSE_WEIGHTS", "MULTI_VECTOR")


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads(REFERENCE.read_text())


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tiny_tokenizer) -> Path:
    return build_m3(tmp_path_factory.mktemp("bge-m3"), tiny_tokenizer)


@pytest.fixture(scope="module")
def m3(folder):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return {"tokenizer": tokenizer, "dropped": dropped_token_ids(folder, tokenizer),
            "heads": read_m3_heads(folder, COMMON["hidden_size"], allow_pickle=True)}


@pytest.fixture(scope="module")
def encoder(folder):
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(folder), attn_implementation="eager").eval()


def _expected(reference: dict, side: str) -> list[M3Output]:
    data = reference[side]
    return [M3Output(np.asarray(dense, np.float32), {int(i): w for i, w in lexical.items()},
                     np.asarray(colbert, np.float32).reshape(-1, COLBERT_DIM))
            for dense, lexical, colbert in zip(data["dense"], data["lexical_weights"], data["colbert"])]


def _assert_like_flag(got: list[M3Output], expected: list[M3Output], what: str) -> None:
    for row, (mine, flag) in enumerate(zip(got, expected, strict=True)):
        assert cosines(mine.dense, flag.dense) >= COSINE, f"{what} text {row}: dense vector"
        assert mine.colbert.shape == flag.colbert.shape, f"{what} text {row}: ColBERT vector count"
        assert cosines(mine.colbert, flag.colbert).min() >= COSINE, f"{what} text {row}: ColBERT vectors"
        assert {i for i, w in flag.lexical.items() if w >= PRESENT} <= set(mine.lexical), f"{what} text {row}: ids"
        assert all(w < PRESENT for i, w in mine.lexical.items() if i not in flag.lexical), f"{what} text {row}: ids"
        shared = sorted(set(mine.lexical) & set(flag.lexical))
        np.testing.assert_allclose([mine.lexical[i] for i in shared], [flag.lexical[i] for i in shared],
                                   rtol=RELATIVE, err_msg=f"{what} text {row}: lexical weights")


def _assert_scores_like_flag(queries: list[M3Output], documents: list[M3Output], reference: dict) -> None:
    colbert = [[colbert_score(q.colbert, d.colbert) for d in documents] for q in queries]
    lexical = [[lexical_score(q.lexical, d.lexical) for d in documents] for q in queries]
    np.testing.assert_allclose(colbert, reference["colbert_scores"], rtol=RELATIVE, err_msg="ColBERT scores")
    np.testing.assert_allclose(lexical, reference["lexical_scores"], rtol=RELATIVE, err_msg="lexical scores")


def test_the_folder_has_the_weights_the_reference_was_computed_on(folder, reference):
    assert weights_fingerprint(folder) == reference["fingerprint"], (
        "the tiny BGE-M3 (tests/helpers/m3_models.py) is no longer the model FlagEmbedding's outputs were kept "
        "for: run `make test-real`, which runs tests/references/flag_m3.py again and says how to keep its output")


def test_the_served_tokenizer_gives_flag_embeddings_token_ids(m3, reference):
    for side in SIDES:
        encodings = m3["tokenizer"].encode_batch(reference[side]["texts"])
        assert [e.ids for e in encodings] == reference[side]["input_ids"]
    assert m3["dropped"] == (0, 1, 2, 3)  # <s>, <pad>, </s>, <unk>


def test_the_numpy_reference_on_pytorch_states_gives_flag_embeddings_outputs(encoder, m3, reference):
    outputs = {}
    for side in SIDES:
        outputs[side] = []
        for ids in reference[side]["input_ids"]:
            with torch.no_grad():
                states = encoder(input_ids=torch.tensor([ids])).last_hidden_state[0].numpy()
            outputs[side].append(m3_outputs(states, np.asarray(ids), m3["heads"], m3["dropped"]))
        _assert_like_flag(outputs[side], _expected(reference, side), f"numpy reference, {side}")
    _assert_scores_like_flag(outputs["queries"], outputs["documents"], reference)


def _batch(ids: list[list[int]], names: list[str], pad_id: int) -> dict[str, np.ndarray]:
    """Right-padded arrays of ``ids``, two columns past the longest, and the scoring mask BGE-M3's tokenizer
    step answers: every real token but the first."""
    width = max(map(len, ids)) + 2
    tokens = np.full((len(ids), width), pad_id, np.int64)
    mask = np.zeros_like(tokens)
    for row, text in enumerate(ids):
        tokens[row, :len(text)], mask[row, :len(text)] = text, 1
    feeds = {"input_ids": tokens, "attention_mask": mask, "token_type_ids": np.zeros_like(tokens)}
    score_mask = mask.copy()
    score_mask[:, 0] = 0
    return {**{name: feeds[name] for name in names}, SCORE_MASK: score_mask}


def _per_text(arrays: tuple, feeds: dict, ids: list[list[int]], dropped: tuple[int, ...]) -> list[M3Output]:
    """The graph's three outputs per text (its sparse weights reduced per id, as a client does)."""
    dense, sparse, vectors = arrays
    got = []
    for row, text in enumerate(ids):
        n = len(text)
        assert not sparse[row, n:].any() and not vectors[row, n:].any(), "padding answers zeros"
        assert not sparse[row][np.isin(feeds["input_ids"][row, :sparse.shape[1]], dropped)].any(), "dropped ids"
        assert not vectors[row, 0].any(), "the first token has no ColBERT vector"
        scored = feeds[SCORE_MASK][row, :vectors.shape[1]].astype(bool)
        got.append(M3Output(dense[row], lexical_weights(np.asarray(text), sparse[row, :n], ()), vectors[row][scored]))
    return got


def test_the_graph_nodes_give_flag_embeddings_outputs_on_a_padded_batch(encoder, m3, reference, tmp_path):
    names = model_input_names(encoder, encoder.config)
    export_onnx(encoder, get_task("embedding"), names, VOCAB, tmp_path / "plain.onnx")
    path = add_m3_heads(tmp_path / "plain.onnx", tmp_path / "m3.onnx", "last_hidden_state", m3["heads"],
                        m3["dropped"], *OUTPUTS)
    trimmed = add_padding_trim(path, tmp_path / "m3.trim.onnx", list(OUTPUTS[1:]))
    ids = reference["queries"]["input_ids"] + reference["documents"]["input_ids"]
    feeds = _batch(ids, names, encoder.config.pad_token_id)
    with torch.no_grad():
        states = encoder(**{n: torch.from_numpy(feeds[n]) for n in names}).last_hidden_state.numpy()
    expected = m3_arrays(states, feeds, m3["heads"], m3["dropped"])
    queries = len(ids) - len(reference["documents"]["input_ids"])
    for graph in (path, trimmed):  # the heads read the trimmed inputs behind a padding trim
        arrays = quiet_session(graph).run(list(OUTPUTS), feeds)
        for name, got, want in zip(OUTPUTS, arrays, expected):
            width = got.shape[1] if name in OUTPUTS[1:] else None  # the per-token outputs come out trimmed
            np.testing.assert_allclose(got, want[:, :width], rtol=RELATIVE, atol=1e-6,
                                       err_msg=f"{graph.name}: {name} against m3_arrays")
        got = _per_text(arrays, feeds, ids, m3["dropped"])
        _assert_like_flag(got[:queries], _expected(reference, "queries"), f"{graph.name}, queries")
        _assert_like_flag(got[queries:], _expected(reference, "documents"), f"{graph.name}, documents")
        _assert_scores_like_flag(got[:queries], got[queries:], reference)


def test_a_folder_is_bge_m3_when_it_has_both_heads(folder, tmp_path):
    assert is_bge_m3(folder)
    assert not is_bge_m3(tmp_path)
    (tmp_path / m3_heads.SPARSE_HEAD).write_bytes((folder / m3_heads.SPARSE_HEAD).read_bytes())
    assert not is_bge_m3(tmp_path)


def test_the_pickled_heads_need_allow_pickle(folder):
    with pytest.raises(UnsafeCheckpointError, match="--allow-pickle"):
        read_m3_heads(folder, COMMON["hidden_size"], allow_pickle=False)


def test_heads_of_another_shape_or_content_are_named(folder, tmp_path):
    for name in (m3_heads.SPARSE_HEAD, m3_heads.COLBERT_HEAD):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    with pytest.raises(CheckpointError, match=r"sparse_linear\.pt: weight has shape \(1, 32\), expected \(1, 64\)"):
        read_m3_heads(tmp_path, 64, allow_pickle=True)
    torch.save({"weight": torch.zeros(COLBERT_DIM, 32), "bias": torch.zeros(3)}, tmp_path / m3_heads.COLBERT_HEAD)
    with pytest.raises(CheckpointError, match=r"colbert_linear\.pt: bias has shape \(3,\), expected \(16,\)"):
        read_m3_heads(tmp_path, 32, allow_pickle=True)
    torch.save(torch.zeros(3), tmp_path / m3_heads.COLBERT_HEAD)
    with pytest.raises(CheckpointError, match=r"colbert_linear\.pt holds Tensor; expected a state dict"):
        read_m3_heads(tmp_path, 32, allow_pickle=True)


#: what the script records about the venv it ran in: not compared (a patch release changes no number)
VERSIONS = ("transformers", "torch")


def _differences(kept, fresh, where: str = "") -> list[str]:
    """Where ``fresh`` differs from ``kept``: structure, ids and texts exactly, numbers to float32 rounding."""
    if isinstance(kept, dict) and isinstance(fresh, dict):
        if sorted(kept) != sorted(fresh):
            return [f"{where}: keys {sorted(kept)} != {sorted(fresh)}"]
        return [d for key in kept for d in _differences(kept[key], fresh[key], f"{where}/{key}")]
    if isinstance(kept, list) and isinstance(fresh, list):
        if len(kept) != len(fresh):
            return [f"{where}: {len(kept)} items != {len(fresh)}"]
        return [d for i, (a, b) in enumerate(zip(kept, fresh)) for d in _differences(a, b, f"{where}/{i}")]
    if isinstance(kept, float) and isinstance(fresh, float):
        return [] if np.isclose(fresh, kept, rtol=1e-5, atol=1e-7) else [f"{where}: {kept} != {fresh}"]
    return [] if kept == fresh else [f"{where}: {kept!r} != {fresh!r}"]


@pytest.mark.real_checkpoint
def test_flag_embedding_reproduces_the_kept_reference(folder, reference, tmp_path):
    python = os.environ.get("NEXUS_SLI_FLAG_PYTHON")
    if not python:
        pytest.fail("NEXUS_SLI_FLAG_PYTHON is unset: run this through `make test-real`, which builds .venv-flag")
    fresh_path = tmp_path / "flag_reference.json"
    script = Path(__file__).parent / "references" / "flag_m3.py"
    subprocess.run([python, str(script), str(folder), str(fresh_path)], check=True)
    fresh = json.loads(fresh_path.read_text())
    kept = {key: value for key, value in reference.items() if key not in VERSIONS}
    differences = _differences(kept, {key: value for key, value in fresh.items() if key not in VERSIONS})
    assert not differences, (
        f"FlagEmbedding's outputs differ from {REFERENCE.name} ({len(differences)}: {differences[:5]}); "
        f"if the change is meant, keep the new file: cp {fresh_path} {REFERENCE}")
