"""What an export refuses before it exports anything, and what a refusal leaves behind.

- A folder with some of BGE-M3's heads but not all: under ``--task auto`` an error naming the missing file
  and ``--task embedding`` (the dense part, on purpose), never a silent dense-only export; under
  ``--task bge-m3`` an error naming the missing file.
- A failed export removes the ``--out`` folders it created; a repository that existed is left as it was, and
  an export that would replace a model served for another task says so.
- Every pickle file is read by one function (``exporter/export/pickles.py``) under one policy: only with
  ``--allow-pickle``, and then as tensors only.  A Dense module's ``pytorch_model.bin`` holding a pickled
  call is a one-line exit-2 error naming the file, and the call never runs.

Every export here fails before the layer walk: none builds a graph.
"""

from __future__ import annotations

import ast
import io
import json
import logging
import re
from pathlib import Path

import pytest
import torch

from helpers.tiny_models import COMMON
from nexus_sli.cli.main import main
from nexus_sli.exporter.errors import CheckpointError, UnsafeCheckpointError
from nexus_sli.exporter.export.checkpoint import Checkpoint
from nexus_sli.exporter.export.m3_heads import COLBERT_HEAD, HEADS, SPARSE_HEAD
from nexus_sli.exporter.export.pickles import read_state_dict
from nexus_sli.exporter.export.source import resolve_model

ROOT = Path(__file__).resolve().parent.parent
#: the product's folders (what is installed), whose pickle reading the policy covers
PRODUCT = ("exporter", "client", "gateway", "tasks", "cli", "bench")


class Opens:
    """Pickled as a call of ``io.open(path, "w")``: the file appears if an unpickler ever makes the call."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return io.open, (self.path, "w")


def _linked(checkpoint: Path, folder: Path) -> Path:
    """``folder`` holding the tiny checkpoint's files (config, weights, tokenizer) as links."""
    folder.mkdir(parents=True)
    for item in checkpoint.iterdir():
        (folder / item.name).symlink_to(item)
    return folder


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _error(capsys) -> str:
    """The CLI's error: one line of stderr, the last, and no traceback."""
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("nexus-sli: error: ")]
    assert len(said) == 1 and err.rstrip().endswith(said[0]) and "Traceback" not in err, err
    return said[0]


# --- BGE-M3's heads -------------------------------------------------------------------------------

@pytest.mark.parametrize("task, kept, message", [
    ("auto", COLBERT_HEAD, r"has BGE-M3's colbert_linear\.pt but not sparse_linear\.pt: add sparse_linear\.pt .*"
                           r"or pass --task embedding to export the dense embeddings alone"),
    ("auto", SPARSE_HEAD, r"has BGE-M3's sparse_linear\.pt but not colbert_linear\.pt: .*--task embedding"),
    ("bge-m3", COLBERT_HEAD, r"lacks sparse_linear\.pt: the bge-m3 task reads BGE-M3's heads"),
])
def test_a_folder_with_some_of_bge_m3s_heads_is_refused_naming_the_missing_one(tiny_checkpoint, tmp_path, capsys,
                                                                              task, kept, message):
    folder = _linked(tiny_checkpoint("xlm-roberta"), tmp_path / "m3")
    size = 1 if kept == SPARSE_HEAD else 16
    torch.save(torch.nn.Linear(COMMON["hidden_size"], size).state_dict(), folder / kept)
    out = tmp_path / "new" / "repo"
    assert main(["export", "--model", str(folder), "--task", task, "--out", str(out), "--allow-pickle"]) == 2
    error = _error(capsys)
    assert re.search(message, error), error
    # the export created both folders of --out; failing, it removed them again
    assert not (tmp_path / "new").exists()


def test_a_repository_folder_that_existed_is_left_as_it_was(tiny_checkpoint, tmp_path):
    folder = _linked(tiny_checkpoint("xlm-roberta"), tmp_path / "m3")
    torch.save(torch.nn.Linear(COMMON["hidden_size"], 16).state_dict(), folder / COLBERT_HEAD)
    out = tmp_path / "repo"
    out.mkdir()
    assert main(["export", "--model", str(folder), "--out", str(out), "--allow-pickle"]) == 2
    assert out.is_dir() and not any(out.iterdir())


def test_a_folder_without_tokenizer_files_is_refused_before_any_work(tiny_checkpoint, tmp_path, capsys):
    """transformers would make a tokenizer of the special tokens alone (every word an [UNK]), and validation
    against a reference tokenized the same way would pass."""
    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    for item in tiny_checkpoint("bert").iterdir():
        if item.name in ("config.json", "model.safetensors"):
            (folder / item.name).symlink_to(item)
    out = tmp_path / "repo"
    assert main(["export", "--model", str(folder), "--out", str(out)]) == 2
    assert re.search(r"has no tokenizer: neither tokenizer\.json nor .*vocab\.txt", _error(capsys))
    assert not out.exists()


def test_a_tokenizer_is_converted_from_a_wordpiece_vocabulary(tiny_checkpoint, tmp_path):
    from tokenizers import Tokenizer

    from nexus_sli.exporter.export.source import tokenizer_file

    source = Tokenizer.from_file(str(tiny_checkpoint("bert") / "tokenizer.json"))
    folder = tmp_path / "slow"
    folder.mkdir()
    vocab = sorted(source.get_vocab().items(), key=lambda item: item[1])
    (folder / "vocab.txt").write_text("".join(f"{token}\n" for token, _ in vocab))
    (folder / "config.json").write_text(json.dumps({"model_type": "bert"}))
    converted = Tokenizer.from_file(str(tokenizer_file(folder, tmp_path)))
    assert converted.get_vocab_size() == source.get_vocab_size()
    text = "the tiny model reads this"
    assert converted.encode(text).ids == source.encode(text).ids


def test_the_hub_download_fetches_bge_m3s_heads_even_without_allow_pickle(monkeypatch, tmp_path):
    """So that ``--task auto`` sees the folder as the hub has it: the heads are fetched, never loaded unasked."""
    import huggingface_hub

    asked = {}

    def download(model_id, allow_patterns, etag_timeout):
        asked["patterns"] = allow_patterns
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    resolve_model("BAAI/bge-m3", allow_pickle=False)
    assert set(HEADS) <= set(asked["patterns"]) and "*.bin" not in asked["patterns"]


# --- pickle files ---------------------------------------------------------------------------------

def _dense_folder(checkpoint: Path, folder: Path, weight) -> Path:
    """A sentence-transformers folder: the tiny BERT, mean pooling, and a Dense module (32 -> 4) whose
    ``pytorch_model.bin`` pickles ``weight`` as its ``linear.weight``."""
    _linked(checkpoint, folder)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]
    (folder / "modules.json").write_text(json.dumps(modules))
    for name, config in (("1_Pooling", {"word_embedding_dimension": COMMON["hidden_size"], "pooling_mode": "mean"}),
                         ("2_Dense", {"in_features": COMMON["hidden_size"], "out_features": 4, "bias": True,
                                      "activation_function": "torch.nn.modules.activation.Tanh"})):
        (folder / name).mkdir()
        (folder / name / "config.json").write_text(json.dumps(config))
    torch.save({"linear.weight": weight, "linear.bias": torch.zeros(4)}, folder / "2_Dense" / "pytorch_model.bin")
    return folder


def _served(repository: Path, name: str, task: str) -> Path:
    """A repository serving ``name`` for ``task``, as far as an export reads it: the ensemble's config."""
    (repository / name).mkdir(parents=True)
    (repository / name / "config.pbtxt").write_text(
        f'name: "{name}"\nplatform: "ensemble"\nparameters {{ key: "task" value {{ string_value: "{task}" }} }}\n')
    (repository / f"{name}_encoder" / "1").mkdir(parents=True)
    (repository / f"{name}_encoder" / "1" / "model.onnx").write_bytes(b"served")
    return repository


@pytest.mark.parametrize("allow_pickle, message", [
    (True, r"2_Dense/pytorch_model\.bin holds more than tensors and was not loaded \(torch's weights-only "
           r"unpickler: Unsupported global: GLOBAL io\.open.*\); nothing in it ran$"),
    (False, r"2_Dense/pytorch_model\.bin is a pickle file; .*pass --allow-pickle .*if you trust the source"),
])
def test_a_dense_bin_holding_a_pickled_call_is_a_one_line_error_and_runs_nothing(
        tiny_checkpoint, tmp_path, capsys, caplog, allow_pickle, message):
    ran = tmp_path / "ran"
    folder = _dense_folder(tiny_checkpoint("bert"), tmp_path / "st", Opens(ran))
    repository = _served(tmp_path / "repo", "model", "classification")
    before = _files(repository)
    with caplog.at_level(logging.INFO, logger="nexus_sli"):
        code = main(["export", "--model", str(folder), "--name", "model", "--out", str(repository),
                     *(["--allow-pickle"] if allow_pickle else [])])
    error = _error(capsys)
    assert code == 2 and re.search(message, error), error
    assert not ran.exists()
    assert _files(repository) == before
    assert (f"{repository} serves model for the task classification; this export will replace it with one for "
            "the task embedding once it passes") in caplog.text


def test_every_pickle_is_read_by_one_function_under_one_policy(tmp_path):
    ran = tmp_path / "ran"
    state = {"weight": torch.ones(2, 3)}
    # only where allowed
    torch.save(state, tmp_path / "plain.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"plain\.pt is a pickle file.*--allow-pickle"):
        read_state_dict(tmp_path / "plain.pt", allow_pickle=False)
    assert torch.equal(read_state_dict(tmp_path / "plain.pt", allow_pickle=True)["weight"], state["weight"])
    # torch's format before 1.6 (no zip archive: read without mapping it)
    torch.save(state, tmp_path / "legacy.bin", _use_new_zipfile_serialization=False)
    assert torch.equal(read_state_dict(tmp_path / "legacy.bin", allow_pickle=True)["weight"], state["weight"])
    # tensors only: a call is refused unmade, and so is anything but a state dict
    torch.save({"weight": Opens(ran)}, tmp_path / "call.pt")
    with pytest.raises(CheckpointError, match=r"call\.pt holds more than tensors .*GLOBAL io\.open") as refused:
        read_state_dict(tmp_path / "call.pt", allow_pickle=True)
    assert "\n" not in str(refused.value) and not ran.exists()
    torch.save([torch.ones(1)], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match=r"list\.pt holds list; expected a state dict"):
        read_state_dict(tmp_path / "list.pt", allow_pickle=True)
    torch.save({"weight": torch.ones(1), "step": 3}, tmp_path / "mixed.pt")
    with pytest.raises(CheckpointError, match=r"mixed\.pt holds 'step': int; a state dict holds tensors only"):
        read_state_dict(tmp_path / "mixed.pt", allow_pickle=True)
    (tmp_path / "cut.pt").write_bytes((tmp_path / "plain.pt").read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"cut\.pt is not a readable torch\.save file"):
        read_state_dict(tmp_path / "cut.pt", allow_pickle=True)
    # an encoder checkpoint's pytorch_model.bin goes the same way
    encoder = tmp_path / "encoder"
    encoder.mkdir()
    torch.save({"embeddings.word_embeddings.weight": Opens(ran)}, encoder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin holds more than tensors"):
        Checkpoint(encoder, allow_pickle=True)
    assert not ran.exists()


def test_no_other_module_of_the_product_unpickles():
    """``torch.load`` and ``pickle.load(s)`` are called in :mod:`pickles` only."""
    callers = []
    for folder in PRODUCT:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if any(part.startswith(".") for part in path.relative_to(ROOT).parts) or path.name == "pickles.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                        and (node.value.id, node.attr) in {("torch", "load"), ("pickle", "load"),
                                                           ("pickle", "loads")}):
                    callers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not callers, callers
