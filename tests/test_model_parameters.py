"""The served models' parameters have one home, ``tasks/model_parameters.py``: every key an export writes
is declared there, for the kind of model that holds it, and the module can be copied into a repository.

The configs are read through Triton's protobuf schema (``exporter/triton/config.py``) from real exports:
the shared exports of the packaged model (pooled and unpooled embeddings, OpenVINO's encoder, the GPU
target's buckets) and seeded tiny models of the other tasks, each exported once into one repository, which
``nexus-sli serve``'s joined steps then shadow.
"""

from __future__ import annotations

import ast
import shutil
import sys
from pathlib import Path

import pytest
from sentence_transformers import SentenceTransformer, SparseEncoder
from sentence_transformers.base.modules import Transformer
from sentence_transformers.sentence_transformer import modules
from sentence_transformers.sparse_encoder.modules import SpladePooling

from helpers import task_models
from helpers.colbert_models import colbert_folder
from helpers.exports import MINILM
from helpers.m3_models import build_m3
from nexus_sli.exporter.export.pipeline import ExportOptions, run_export
from nexus_sli.exporter.serving import joined_steps
from nexus_sli.exporter.triton import config as tc
from nexus_sli.tasks import model_parameters
from nexus_sli.tasks.model_parameters import (
    ENCODER,
    ENSEMBLE,
    JOINED,
    KEYS,
    POSTPROCESS,
    TOKENIZER,
    TokenizerParameters,
    message_strings,
    strings,
)

MODULE = Path(model_parameters.__file__)
#: The shared exports of the packaged model this module reads (helpers/exports.py).
SHARED = (MINILM, "minilm_strict", "minilm_openvino", "minilm_gpu")
#: A sentence-transformers card naming the sizes a Matryoshka loss trained for (export/source.py reads it).
CARD = '\n```json\n{"loss": "MatryoshkaLoss", "matryoshka_dims": [32, 16]}\n```\n'


def _retriever(folder: Path, checkpoint: Path) -> Path:
    """An embedding model with prompts, a default prompt and a Matryoshka card."""
    transformer = modules.Transformer(str(checkpoint), max_seq_length=64)
    SentenceTransformer(modules=[transformer, modules.Pooling(32, "mean"), modules.Normalize()],
                        prompts={"query": "query: ", "passage": "passage: "}, default_prompt_name="query",
                        device="cpu").save(str(folder))
    with open(folder / "README.md", "a") as card:
        card.write(CARD)
    return folder


def _splade(root: Path, tokenizer) -> Path:
    mlm = task_models.save(task_models.masked_lm("bert", 21), tokenizer, root / "mlm")
    SparseEncoder(modules=[Transformer(str(mlm), transformer_task="fill-mask"), SpladePooling("max")],
                  device="cpu").save(str(root / "splade"))
    return root / "splade"


@pytest.fixture(scope="module")
def repository(tmp_path_factory, tiny_tokenizer, tiny_checkpoint, exports) -> Path:
    """One repository: the shared exports, and a tiny model of each task whose configs hold keys they lack
    (the reader's windows cover the reranker's keys too: both are one-query modes)."""
    root = tmp_path_factory.mktemp("parameters")
    repo = root / "repo"
    for name in SHARED:
        exports.copy(name, repo)
    models = {
        "retriever": (_retriever(root / "retriever", tiny_checkpoint("bert")), {}),
        "classifier": (task_models.classifier(tiny_tokenizer, root / "classifier"), {}),
        "reader": (task_models.reader(tiny_tokenizer, root / "reader"), {}),
        "splade": (_splade(root, tiny_tokenizer), {}),
        "colbert": (colbert_folder(root / "colbert", prompts={"search": "search query: "}), {}),
        "m3": (build_m3(root / "m3", tiny_tokenizer), {"allow_pickle": True}),
    }
    for name, (folder, options) in models.items():
        run_export(ExportOptions(model=str(folder), name=name, out=repo, cache=False, **options))
    return repo


def _kind(config: tc.pb.ModelConfig) -> tuple:
    """The keys a model of ``config``'s kind may hold."""
    if config.platform == "ensemble":
        return ENSEMBLE
    if config.backend == "python":
        return TOKENIZER if config.name.endswith("_tokenizer") else POSTPROCESS
    return ENCODER


def test_every_key_of_every_exported_config_is_declared_for_its_model(repository):
    configs = [tc.read(path) for path in sorted(repository.glob("*/config.pbtxt"))]
    found = {config.name: set(config.parameters) for config in configs}
    undeclared = {name: sorted(keys - KEYS) for name, keys in found.items() if keys - KEYS}
    assert not undeclared, f"parameter keys tasks/model_parameters.py does not declare: {undeclared}"
    misplaced = {config.name: sorted(set(config.parameters) - {p.key for p in _kind(config)}) for config in configs}
    assert not {name: keys for name, keys in misplaced.items() if keys}, misplaced
    # the exports hold every kind of model, and between them the keys each writer writes
    written = set().union(*found.values())
    assert {p.key for p in TOKENIZER} <= written  # every tokenizer mode, prompts and a default among them
    assert {model_parameters.TOKEN_MODEL.key, model_parameters.EMBEDDING_MODEL.key,
            model_parameters.MATRYOSHKA_DIMS.key, model_parameters.SERVES.key,
            model_parameters.HINT_BF16.key, model_parameters.HEAD.key} <= written


def test_the_joined_models_parameters_are_declared(repository, tmp_path):
    shadow = joined_steps.join(repository, tmp_path / "backends")
    assert shadow is not None
    try:
        # the joined models' configs are the shadow's own files; the others link to the repository's
        joined = [tc.read(path) for path in sorted(shadow.glob("*/config.pbtxt")) if not path.is_symlink()]
        assert joined, "no ensemble was joined"
        allowed = {p.key for p in (*ENSEMBLE, *JOINED)}
        for config in joined:
            assert set(config.parameters) <= allowed, (config.name, sorted(set(config.parameters) - allowed))
            assert {p.key for p in JOINED} <= set(config.parameters)
    finally:
        shutil.rmtree(shadow, ignore_errors=True)


def test_the_tokenizer_steps_parameters_read_back_as_written(repository):
    for path in sorted(repository.glob("*_tokenizer/config.pbtxt")):
        written = message_strings(tc.read(path).parameters)
        assert TokenizerParameters.read(written).write() == written, path.parent.name
    colbert = TokenizerParameters.read(message_strings(tc.read(repository / "colbert_tokenizer" / "config.pbtxt")
                                                       .parameters))
    assert colbert.mode == "sided" and colbert.sides is not None and "search" in colbert.prompts.named
    retriever = TokenizerParameters.read(
        message_strings(tc.read(repository / "retriever_tokenizer" / "config.pbtxt").parameters))
    named = retriever.prompts.named
    assert (named["query"], named["passage"], retriever.prompts.default) == ("query: ", "passage: ", "query")


def test_every_python_step_gets_the_packages_copy(repository):
    source = MODULE.read_text()
    copies = sorted(repository.glob("*/1/model.py"))
    assert copies and all((copy.parent / MODULE.name).read_text() == source for copy in copies)


def test_it_imports_only_the_standard_library():
    # copied beside the python steps, where nexus-sli is not installed
    tree = ast.parse(MODULE.read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported - {"__future__"} <= sys.stdlib_module_names, imported


def test_a_missing_or_unreadable_parameter_is_an_error_naming_it():
    with pytest.raises(ValueError, match="no parameter 'max_length'"):
        TokenizerParameters.read({"mode": "single", "pad_id": "0"})
    with pytest.raises(ValueError, match="parameter 'pad_widths' is '8,x'"):
        TokenizerParameters.read({"max_length": "8", "pad_id": "0", "pad_widths": "8,x"})
    assert model_parameters.MAX_ROWS.read({}, None) is None


def test_both_json_spellings_of_a_config_read_alike():
    spelled = {"parameters": {"task": {"string_value": "embedding"}, "normalize": {"stringValue": "true"}}}
    assert strings(spelled) == strings({"config": spelled}) == {"task": "embedding", "normalize": "true"}
    assert model_parameters.NORMALIZE.read(strings(spelled)) is True
