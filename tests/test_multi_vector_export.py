"""Late interaction (ColBERT) exported and served, checked against sentence-transformers' MultiVectorEncoder.

Seeded tiny ColBERTs in the three save formats MultiVectorEncoder loads
(``tests/helpers/colbert_models.py``: its own, PyLate's and Stanford ColBERT's;
queries expanded to 12 tokens the encoder does not attend to) are exported with
``--task auto`` in fp32 on ONNX Runtime and served by one real Triton server.
Each text's query and document vectors, asked for with raw tritonclient and the
request parameter ``input_type``, match ``encode_query`` / ``encode_document``:
the same number of vectors, per-token cosine >= 0.9999, unit norms.  The
encoder's padding trim keeps the expansion positions it does not attend to.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import transformers
import tritonclient.grpc as grpcclient
from sentence_transformers import MultiVectorEncoder
from tokenizers import Tokenizer

from nexus_sli.client.error_codes import INPUT_TYPE_PARAMETER
from nexus_sli.exporter.errors import NexusError
from nexus_sli.exporter.export import padding_trim
from nexus_sli.exporter.export.embedders import ModelFolder, poolers
from nexus_sli.exporter.export.onnx_export import export_onnx, model_input_names
from nexus_sli.exporter.export.padding_trim import add_padding_trim
from nexus_sli.exporter.export.pipeline import ExportOptions, run_export
from nexus_sli.exporter.export.report import ShapeMismatch
from nexus_sli.exporter.export.validate import (build_reference, compare, parity_cases, validation_texts,
                                                with_score_masks)
from nexus_sli.exporter.triton.python_models.encoding import load_tokenizer
from nexus_sli.exporter.triton import config as tc
from nexus_sli.exporter.triton.python_models.sides import SCORE_MASK, SIDE_NAMES, Sides, side_tokenizers, sided_encode
from nexus_sli.tasks import get_task
from helpers.colbert_models import DIM, FORMATS, UNUSED, VOCAB_SIZE, colbert_folder
from helpers.servers import serving
from helpers.tiny_models import COMMON, build_tiny, quiet_session

TASK = get_task("multi-vector")
#: short and long texts, punctuation (a legacy format's document skiplist), one character, and past the
#: document length (truncated)
TEXTS = validation_texts()[:6] + ["What? Yes, it is: (really)!", "a", "water " * 60]
COSINE = 0.9999
#: the tiny models' query expansion: queries are filled to this many tokens, not attended to
EXPANSION = 12


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("colbert")
    return {format: colbert_folder(root / format, format, attend=False, expansion_length=EXPANSION)
            for format in FORMATS}


@pytest.fixture(scope="module")
def served(tmp_path_factory, folders):
    """Every format exported as ``--task auto`` finds it (fp32, ONNX Runtime), served by one server."""
    repo = tmp_path_factory.mktemp("colbert-repo")
    reports = {format: run_export(ExportOptions(model=str(folders[format]), name=f"colbert_{format}",
                                                out=repo)).report
               for format in FORMATS}
    with serving(repo) as server:
        yield {**server, "reports": reports}


@pytest.fixture(scope="module")
def references(folders):
    """MultiVectorEncoder's query and document vectors of every text, per format."""
    found = {}
    for format, folder in folders.items():
        model = MultiVectorEncoder(str(folder), device="cpu")
        found[format] = {"query": model.encode_query(TEXTS, convert_to_numpy=True),
                         "document": model.encode_document(TEXTS, convert_to_numpy=True)}
    return found


def _vectors(url: str, model: str, texts: list[str], side: str) -> tuple[list[np.ndarray], np.ndarray]:
    """Each text's vectors as the served ensemble answers them, and the raw ``MULTI_VECTOR``."""
    tensor = grpcclient.InferInput("TEXT", [len(texts), 1], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode("utf-8") for t in texts], dtype=object).reshape(-1, 1))
    client = grpcclient.InferenceServerClient(url)
    try:
        result = client.infer(model, [tensor], parameters={INPUT_TYPE_PARAMETER: side})
    finally:
        client.close()
    vectors, mask = result.as_numpy("MULTI_VECTOR"), result.as_numpy("SCORE_MASK")
    return TASK.parse([(vectors, mask)]), vectors


@pytest.mark.parametrize("side", SIDE_NAMES)
@pytest.mark.parametrize("format", FORMATS)
def test_served_vectors_match_multi_vector_encoder(served, references, format, side):
    got, raw = _vectors(served["grpc"], f"colbert_{format}", TEXTS, side)
    assert raw.dtype == np.float32 and raw.shape[2] == DIM
    for row, (g, e) in enumerate(zip(got, references[format][side])):
        assert g.shape == e.shape, (format, side, row)  # as many vectors: expansion, skiplist, truncation
        np.testing.assert_allclose(np.linalg.norm(g, axis=1), 1.0, atol=1e-5)
        cosines = np.sum(g * e, axis=1) / (np.linalg.norm(g, axis=1) * np.linalg.norm(e, axis=1))
        assert cosines.min() >= COSINE, (format, side, row, cosines.min())
    # a text alone gets what it got in the batch: padding and batch-mates change nothing
    alone, _ = _vectors(served["grpc"], f"colbert_{format}", [TEXTS[2]], side)
    np.testing.assert_allclose(alone[0], got[2], atol=1e-5)


def test_a_short_query_keeps_its_unattended_expansion(served, references):
    """A query of a few tokens answers one vector per expansion position too: the encoder's padding trim
    cuts at the scoring mask's last position, not the attention mask's."""
    got, raw = _vectors(served["grpc"], "colbert_native", ["a"], "query")
    assert raw.shape[1] == EXPANSION and len(got[0]) == EXPANSION == len(references["native"]["query"][7])
    encoder = served["repo"] / "colbert_native_encoder" / "1" / "model.onnx"
    sides = Sides.from_json(tc.read(served["repo"] / "colbert_native_tokenizer" / "config.pbtxt")
                            .parameters["sides"].string_value)
    names = [i.name for i in quiet_session(encoder).get_inputs()]
    tokenizer = side_tokenizers(str(served["repo"] / "colbert_native_tokenizer" / "1" / "tokenizer.json"), sides)
    feeds = sided_encode(tokenizer["query"], ["a"], "query", sides, names, 0)
    padded = {name: np.pad(array, ((0, 0), (0, 30))) for name, array in feeds.items()}  # the tokenizer step's width
    attended = int(feeds["attention_mask"].sum())
    assert attended < EXPANSION and feeds[SCORE_MASK].sum() == EXPANSION
    (vectors,) = quiet_session(encoder).run(None, padded)
    assert vectors.shape[1] == EXPANSION and (np.abs(np.linalg.norm(vectors[0], axis=1) - 1) < 1e-5).all()


def test_exports_describe_the_multi_vector_ensemble(served, folders):
    for format, report in served["reports"].items():
        name = f"colbert_{format}"
        assert report.task == "multi-vector" and report.validation.passed  # --task auto found it
        assert report.validation.max_abs_diff <= 1e-4 and report.outputs == ["MULTI_VECTOR"]
        assert report.inputs[-1] == SCORE_MASK and report.pooling == "multi-vector" and report.normalize
        ensemble = tc.read(served["repo"] / name / "config.pbtxt")
        assert [(o.name, list(o.dims)) for o in ensemble.output] == [("MULTI_VECTOR", [-1, DIM]), ("SCORE_MASK", [-1])]
        params = {k: v.string_value for k, v in ensemble.parameters.items()}
        assert {k: params[k] for k in ("task", "similarity", "vector_size", "input_types")} == {
            "task": "multi-vector", "similarity": "maxsim", "vector_size": str(DIM), "input_types": "query,document"}
        # the tokenizer's scoring mask is the encoder's input and the ensemble's SCORE_MASK
        tokenizer_step, encoder_step = ensemble.ensemble_scheduling.step
        assert tokenizer_step.output_map[SCORE_MASK] == encoder_step.input_map[SCORE_MASK] == "SCORE_MASK"
        tokenizer = tc.read(served["repo"] / f"{name}_tokenizer" / "config.pbtxt")
        assert tokenizer.parameters["mode"].string_value == "sided"
        sides = Sides.from_json(tokenizer.parameters["sides"].string_value)
        assert sides.query.expansion.length == EXPANSION and not sides.query.expansion.attend
        # every side's rows fit in the width the step pads within
        assert int(tokenizer.parameters["max_length"].string_value) >= max(sides.document.max_length, EXPANSION)
        assert (served["repo"] / f"{name}_tokenizer" / "1" / "sides.py").is_file()
        encoder = tc.read(served["repo"] / f"{name}_encoder" / "config.pbtxt")
        assert [i.name for i in encoder.input][-1] == SCORE_MASK
        graph = onnx.load(str(served["repo"] / f"{name}_encoder" / "1" / "model.onnx"), load_external_data=False).graph
        assert [i.name for i in graph.input][-1] == SCORE_MASK


def test_legacy_formats_serve_their_markers_and_projection(served):
    """Stanford ColBERT's projection is the checkpoint's root ``linear.weight``, read by the head, not the
    encoder; its markers are special tokens in the served tokenizer.json, as sentence-transformers adds them."""
    walk = served["reports"]["stanford"].walk
    assert "linear.weight" in [key for keys in walk.skipped.values() for key in keys]
    served_tokenizer = served["repo"] / "colbert_stanford_tokenizer" / "1" / "tokenizer.json"
    added = {token["content"]: token for token in json.loads(served_tokenizer.read_text())["added_tokens"]}
    assert all(added[marker]["special"] and not added[marker]["normalized"] for marker in UNUSED)
    tokenizer = Tokenizer.from_file(str(served_tokenizer))
    assert tokenizer.encode(f"{UNUSED[0]} what", add_special_tokens=False).tokens[0] == UNUSED[0]


# --- validation, without a server ------------------------------------------------------------------


def test_validation_fails_a_trim_that_cuts_unattended_positions(folders, tmp_path, monkeypatch):
    """The parity cases score positions past each row's last attended one: a graph trimmed by the attention
    mask alone (the trim before late interaction) answers fewer positions and fails on shapes."""
    folder = folders["native"]
    model = transformers.AutoModel.from_pretrained(str(folder), attn_implementation="eager").eval()
    positions = COMMON["max_position_embeddings"]
    embedder, head = poolers(ModelFolder(folder, TASK, COMMON["hidden_size"], VOCAB_SIZE,
                                         load_tokenizer(folder / "tokenizer.json", positions), positions))
    names = model_input_names(model, model.config)
    export_onnx(model, TASK, names, VOCAB_SIZE, tmp_path / "plain.onnx")
    cases = with_score_masks(parity_cases(names, VOCAB_SIZE, 0, positions))
    reference = build_reference(model, TASK, [*names, *head.inputs], cases, [])
    pooled = head.append(tmp_path / "plain.onnx", tmp_path / "head.onnx")
    right = add_padding_trim(pooled, tmp_path / "right.onnx", head.per_token)
    monkeypatch.setattr(padding_trim, "SCORE_MASK", None)  # the cut by the attention mask alone
    wrong = add_padding_trim(pooled, tmp_path / "wrong.onnx", head.per_token)

    def check(path):
        return compare(quiet_session(path), reference, "fp32", embedder, TASK, pooled=TASK.client_output)
    assert check(right).passed, check(right).failures
    report = check(wrong)
    assert not report.passed and any(isinstance(f, ShapeMismatch) for f in report.failures)


def test_a_folder_that_is_no_late_interaction_model_is_refused(tmp_path, tiny_tokenizer):
    """``--task multi-vector`` on a plain BERT names what it looked for, before the walk."""
    with pytest.raises(NexusError, match="not a late-interaction model"):
        run_export(ExportOptions(model=str(build_tiny("bert", tmp_path / "bert", tiny_tokenizer)),
                                 task="multi-vector", out=tmp_path / "repo"))
