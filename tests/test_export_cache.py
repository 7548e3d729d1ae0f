"""The exporter's use of the LayerCache: warm re-exports reuse layers, never stale ones."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import onnxruntime as ort
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel

from nexus_sli.exporter.export import export_report, timing
from nexus_sli.exporter.export.checkpoint import Checkpoint
from nexus_sli.cli.main import main
from nexus_sli.exporter.export.pipeline import ExportOptions, run_export
from nexus_sli.exporter.export.layer_cache import LayerCache
from nexus_sli.exporter.export.source import load_config, resolve_model
from nexus_sli.tasks import get_task
from nexus_sli.exporter.export.walk import open_layer_cache, walk

CHANGED = "encoder.layer.1.attention.output.dense.weight"


@pytest.fixture
def reads(monkeypatch):
    """The checkpoint keys read through Checkpoint.get, in order."""
    seen: list[str] = []
    original = Checkpoint.get

    def get(self, key):
        seen.append(key)
        return original(self, key)

    monkeypatch.setattr(Checkpoint, "get", get)
    return seen


@pytest.fixture(autouse=True)
def same_graph_every_time(request, monkeypatch):
    # Two exports must keep the same graph (plain) for their outputs to be
    # compared bit for bit; timing noise would otherwise pick plain or fused.
    # Tests marked real_timing time the candidates as an export does.
    if not request.node.get_closest_marker("real_timing"):
        monkeypatch.setattr(timing, "run_ms", lambda runner, feeds: 1.0)


def _export(directory, out, **options):
    # token states out (no pooling in the graph): compared with PyTorch's states directly below
    return run_export(ExportOptions(model=str(directory), name="tiny", out=out, **{"pool_in_graph": False, **options}))


def _onnx_output(out) -> np.ndarray:
    session = ort.InferenceSession(str(out / "tiny_encoder" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    ids = np.random.default_rng(7).integers(5, 300, size=(2, 13), dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
    return session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})[0]


def _layer_reads(keys) -> list[str]:
    return [k for k in keys if ".layer." in k or "albert_layer_groups" in k]


def _copy(directory, tmp_path):
    return shutil.copytree(directory, tmp_path / "ckpt")


def _walk(directory, cache):
    with Checkpoint(directory, allow_pickle=True) as checkpoint:
        return walk(load_config(directory), checkpoint, get_task("embedding"), cache=cache)


@pytest.mark.parametrize("model_type, layers", [("bert", 2), ("albert", 4)])
def test_second_export_reuses_every_layer(model_type, layers, tiny_checkpoint, tmp_path, reads, caplog):
    directory = tiny_checkpoint(model_type)
    cold = _export(directory, tmp_path / "cold", cache_dir=tmp_path / "cache")
    assert (cold.report.walk.layers, cold.report.walk.from_cache) == (layers, 0)
    reads.clear()
    caplog.set_level(logging.INFO, logger="nexus_sli.export")
    warm = _export(directory, tmp_path / "warm", precision="int8", cache_dir=tmp_path / "cache")
    assert warm.report.walk.from_cache == layers
    assert f"reused {layers} of {layers} layers from the layer cache at {tmp_path / 'cache'}" in caplog.text
    assert _layer_reads(reads) == []  # cached layers' tensors are not read
    assert warm.report.walk.tensors == cold.report.walk.tensors
    assert warm.report.validation.passed is True

    again = _export(directory, tmp_path / "again", cache_dir=tmp_path / "cache")  # fp32, warm
    assert again.report.validation.passed is True and again.report.walk.from_cache == layers
    # the same weights make the same graph: one input runs the same kernels in the same order, so the same bits
    assert np.array_equal(_onnx_output(tmp_path / "again"), _onnx_output(tmp_path / "cold"))


def test_no_cache_reads_the_checkpoint(tiny_checkpoint, tmp_path, reads, monkeypatch):
    directory = tiny_checkpoint("bert")
    _walk(directory, LayerCache(tmp_path / "cache"))  # warm the cache
    reads.clear()
    out = tmp_path / "repo"
    monkeypatch.setenv("NEXUS_SLI_CACHE_DIR", str(tmp_path / "unused"))  # the default cache (--cache-dir: refused)
    # fp32: the flag is what is under test, not auto's search of every configuration (test_openvino)
    assert main(["export", "--model", str(directory), "--name", "tiny", "--out", str(out), "--precision", "fp32",
                 "--no-cache"]) == 0
    report = export_report.read(out / "tiny_encoder")
    assert report.walk.from_cache == 0 and report.validation.passed is True
    assert {k for k in _layer_reads(reads)} >= {CHANGED, "encoder.layer.0.attention.self.query.weight"}
    assert not (tmp_path / "unused").exists()


def test_cache_dir_flag_is_used(tiny_checkpoint, tmp_path):
    directory = tiny_checkpoint("bert")
    # fp32: the flag is what is under test, not auto's search of every configuration (test_openvino)
    args = ["export", "--model", str(directory), "--name", "tiny", "--precision", "fp32",
            "--cache-dir", str(tmp_path / "cache")]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    assert len(list((tmp_path / "cache").glob("*.safetensors"))) == 2
    assert main([*args, "--out", str(tmp_path / "b")]) == 0
    report = export_report.read(tmp_path / "b" / "tiny_encoder")
    assert report.walk.from_cache == 2


def _hidden_states(directory) -> np.ndarray:
    model = AutoModel.from_pretrained(directory, attn_implementation="eager").eval()
    ids = torch.from_numpy(np.random.default_rng(7).integers(5, 300, size=(2, 13), dtype=np.int64))
    with torch.no_grad():
        return model(input_ids=ids, token_type_ids=torch.zeros_like(ids)).last_hidden_state.numpy()


def _change_layer_weight(path) -> None:
    tensors = load_file(path)
    tensors[CHANGED] = -tensors[CHANGED]  # a uniform shift would vanish in the following LayerNorm
    save_file(tensors, path, metadata={"format": "pt"})


def test_changed_checkpoint_is_not_served_stale(tiny_checkpoint, tmp_path):
    directory = _copy(tiny_checkpoint("bert"), tmp_path)
    first = _export(directory, tmp_path / "first", cache_dir=tmp_path / "cache")
    _change_layer_weight(directory / "model.safetensors")
    # Nothing tells which layer of a rewritten file changed without reading its
    # bytes, so every layer stored in that file misses (see the sharded test).
    second = _export(directory, tmp_path / "second", cache_dir=tmp_path / "cache")
    assert (first.report.walk.from_cache, second.report.walk.from_cache) == (0, 0)
    output = _onnx_output(tmp_path / "second")
    assert not np.allclose(output, _onnx_output(tmp_path / "first"), atol=1e-3)
    np.testing.assert_allclose(output, _hidden_states(directory), atol=1e-4)
    third = _export(directory, tmp_path / "third", cache_dir=tmp_path / "cache")
    assert third.report.walk.from_cache == 2  # the new weights were cached
    assert np.array_equal(_onnx_output(tmp_path / "third"), output)  # the same graph: bit for bit, as above


def _shard_by_layer(directory) -> None:
    """Rewrite ``directory``'s model.safetensors as one shard per layer plus one for the rest."""
    tensors = load_file(directory / "model.safetensors")
    shards: dict[str, dict] = {}
    for key, tensor in tensors.items():
        name = f"layer{key.split('.')[2]}.safetensors" if key.startswith("encoder.layer.") else "rest.safetensors"
        shards.setdefault(name, {})[key] = tensor
    for name, part in shards.items():
        save_file(part, directory / name, metadata={"format": "pt"})
    weight_map = {key: name for name, part in shards.items() for key in part}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "model.safetensors").unlink()


def test_changed_shard_misses_only_its_layers(tiny_checkpoint, tmp_path, reads):
    directory = _copy(tiny_checkpoint("bert"), tmp_path)
    _shard_by_layer(directory)
    cache = LayerCache(tmp_path / "cache")
    assert _walk(directory, cache)[2].layers_from_cache == 0
    _change_layer_weight(directory / "layer1.safetensors")
    reads.clear()
    model, _, report = _walk(directory, cache)
    assert report.layers_from_cache == 1
    assert not any(k.startswith("encoder.layer.0.") for k in reads)
    assert CHANGED in reads
    ids = torch.from_numpy(np.random.default_rng(7).integers(5, 300, size=(2, 13), dtype=np.int64))
    with torch.no_grad():
        states = model(input_ids=ids, token_type_ids=torch.zeros_like(ids)).last_hidden_state.numpy()
    np.testing.assert_allclose(states, _hidden_states(directory), atol=1e-5)


def test_pickle_checkpoints_are_not_cached(tiny_checkpoint, tmp_path):
    directory = _copy(tiny_checkpoint("bert"), tmp_path)
    torch.save(load_file(directory / "model.safetensors"), directory / "pytorch_model.bin")
    (directory / "model.safetensors").unlink()
    cache = LayerCache(tmp_path / "cache")
    for _ in range(2):
        assert _walk(directory, cache)[2].layers_from_cache == 0
    assert cache.size_bytes() == 0


def test_unusable_cache_dir_warns_and_the_walk_goes_on(tmp_path, caplog):
    (tmp_path / "a-file").write_text("")
    assert open_layer_cache(tmp_path / "a-file") is None
    assert "layer cache disabled" in caplog.text and "--no-cache" in caplog.text


@pytest.mark.slow
def test_default_model_warm_reexport_reuses_all_six_layers(tmp_path, reads):
    source = resolve_model(None)
    _walk(source.path, LayerCache(tmp_path / "cache"))  # what a first export leaves behind
    reads.clear()
    # the first graph alone: what is under test is the walk's cache, which every export reads the same way
    result = run_export(ExportOptions(model=None, out=tmp_path / "repo", cache_dir=tmp_path / "cache", search=False))
    assert (result.report.walk.layers, result.report.walk.from_cache) == (6, 6)
    assert result.report.validation.passed is True and result.report.validation.max_abs_diff <= 1e-4
    assert _layer_reads(reads) == []


@pytest.mark.real_timing
def test_the_fastest_passing_candidate_is_kept(tiny_checkpoint, tmp_path):
    """Timed for real: int8 offers several graphs (plain, fused, each with and without
    fp32 feed-forward outputs); the export keeps the best of those that pass by the objective's score."""
    report = _export(tiny_checkpoint("bert"), tmp_path / "repo", precision="int8", cache=False).report
    candidates = report.candidates
    assert len(candidates) >= 2 and len({c.latency_ms for c in candidates}) > 1
    passing = [c for c in candidates if c.passed]
    assert passing and report.graph == min(passing, key=lambda c: c.score).graph
    assert report.timing.optimize == "balanced"
