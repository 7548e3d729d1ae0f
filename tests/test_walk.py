"""The layer walk: every tensor accounted for, errors that name the tensor."""

from __future__ import annotations


import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModel

from nexus_sli.exporter.export.checkpoint import Checkpoint
from nexus_sli.exporter.errors import CheckpointError, UnsafeCheckpointError
from nexus_sli.exporter.export.source import load_config
from nexus_sli.tasks import get_task
from nexus_sli.exporter.export.walk import walk
from helpers.checkpoints import copy_checkpoint, edit_weights
from helpers.tiny_models import build_tiny


def _walk(directory, allow_pickle=False):
    with Checkpoint(directory, allow_pickle=allow_pickle) as checkpoint:
        return walk(load_config(directory), checkpoint, get_task("embedding"))


def _same_outputs(model, directory):
    reference = AutoModel.from_pretrained(directory, attn_implementation="eager").eval()
    ids = torch.randint(5, 300, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return torch.allclose(model(input_ids=ids).last_hidden_state, reference(input_ids=ids).last_hidden_state,
                              atol=1e-5)


def test_walk_rebuilds_the_same_model(tiny_checkpoint):
    directory = tiny_checkpoint("bert")
    model, handler, report = _walk(directory)
    assert report.layers_loaded == 2
    assert _same_outputs(model, directory)


def test_albert_walks_each_shared_layer_once(tiny_checkpoint):
    model, _, report = _walk(tiny_checkpoint("albert"))
    assert report.layers_loaded == 4  # 2 groups x 2 inner layers, not 4 passes x 2


def test_task_checkpoint_head_is_not_silently_dropped(tiny_checkpoint, tmp_path, tiny_tokenizer):
    directory = build_tiny("bert", tmp_path / "cls", tiny_tokenizer)
    config = (directory / "config.json").read_text().replace('"BertModel"', '"BertForSequenceClassification"')
    (directory / "config.json").write_text(config)
    edit_weights(directory, lambda t: t.update({"classifier.weight": torch.zeros(2, 32), "classifier.bias": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match="classifier.bias, classifier.weight"):
        _walk(directory)


def test_pretraining_head_is_accounted_for(tiny_checkpoint):
    _, handler, report = _walk(tiny_checkpoint("roberta"))
    assert handler.prefix == "roberta."
    assert "lm_head.dense.weight" in report.skipped["pre-training head the task does not use"]


def test_unknown_tensor_is_named(tiny_checkpoint, tmp_path):
    directory = copy_checkpoint(tiny_checkpoint("bert"), tmp_path)
    edit_weights(directory, lambda t: t.update({"encoder.mystery.weight": torch.zeros(3)}))
    with pytest.raises(CheckpointError, match="encoder.mystery.weight"):
        _walk(directory)


def test_tensor_inside_a_layer_that_the_layer_lacks_is_named(tiny_checkpoint, tmp_path):
    directory = copy_checkpoint(tiny_checkpoint("bert"), tmp_path)
    edit_weights(directory, lambda t: t.update({"encoder.layer.1.extra.weight": torch.zeros(3)}))
    with pytest.raises(CheckpointError, match=r"unexpected encoder\.layer\.1\.extra\.weight"):
        _walk(directory)


def test_missing_tensor_is_named(tiny_checkpoint, tmp_path):
    directory = copy_checkpoint(tiny_checkpoint("bert"), tmp_path)
    edit_weights(directory, lambda t: t.pop("encoder.layer.1.output.dense.bias"))
    with pytest.raises(CheckpointError, match=r"missing encoder\.layer\.1\.output\.dense\.bias"):
        _walk(directory)


def test_misshapen_tensor_is_named(tiny_checkpoint, tmp_path):
    directory = copy_checkpoint(tiny_checkpoint("bert"), tmp_path)
    edit_weights(directory, lambda t: t.update({"encoder.layer.0.intermediate.dense.bias": torch.zeros(7)}))
    with pytest.raises(CheckpointError, match=r"encoder\.layer\.0\.intermediate\.dense\.bias: checkpoint \(7,\)"):
        _walk(directory)


def test_truncated_file_is_a_checkpoint_error(tiny_checkpoint, tmp_path):
    directory = copy_checkpoint(tiny_checkpoint("bert"), tmp_path)
    path = directory / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CheckpointError):
        _walk(directory)


def test_legacy_gamma_beta_names_load(tiny_checkpoint, tmp_path):
    directory = copy_checkpoint(tiny_checkpoint("bert"), tmp_path)

    def rename(tensors):
        for key in [k for k in tensors if k.endswith("LayerNorm.weight")]:
            tensors[key.replace(".weight", ".gamma")] = tensors.pop(key)

    edit_weights(directory, rename)
    model, _, _ = _walk(directory)
    assert _same_outputs(model, tiny_checkpoint("bert"))


def test_sharded_checkpoint(tiny_checkpoint, tmp_path):
    source = tiny_checkpoint("bert")
    directory = tmp_path / "sharded"
    AutoModel.from_pretrained(source).save_pretrained(directory, max_shard_size="20KB")
    assert (directory / "model.safetensors.index.json").is_file()
    model, _, _ = _walk(directory)
    assert _same_outputs(model, source)


def test_pickle_needs_explicit_permission(tiny_checkpoint, tmp_path):
    directory = copy_checkpoint(tiny_checkpoint("bert"), tmp_path)
    torch.save(load_file(directory / "model.safetensors"), directory / "pytorch_model.bin")
    (directory / "model.safetensors").unlink()
    with pytest.raises(UnsafeCheckpointError, match="--allow-pickle"):
        _walk(directory)
    model, _, _ = _walk(directory, allow_pickle=True)
    assert _same_outputs(model, tiny_checkpoint("bert"))
