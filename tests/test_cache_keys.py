"""What the exporter's caches are keyed on, one input at a time: a changed input never comes back stale, an
unchanged one hits; and a cache that cannot be read, marked or cleaned is a miss, not a failed export.

The layer cache keeps a layer's checkpoint tensors only: what the config says (epsilon, activation, heads) is
applied by the freshly built layer the cached tensors go into, so a config change rightly hits and the walked
model must still be the one a walk without the cache builds.  The candidate cache keeps graphs derived from
other graphs: its key is their content, the recipe and the versions of what writes them."""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
from importlib import metadata

import numpy as np
import pytest
import torch

from nexus_sli.exporter.export import cache_files, candidate_cache
from nexus_sli.exporter.export.candidate_cache import CandidateCache
from nexus_sli.exporter.export.checkpoint import Checkpoint
from nexus_sli.exporter.export.layer_cache import LayerCache
from nexus_sli.exporter.export.source import load_config
from nexus_sli.exporter.export.walk import walk
from nexus_sli.tasks import get_task

LAYERS = 2  # the tiny bert's


def _walk(directory, cache):
    with Checkpoint(directory) as checkpoint:
        model, _, report = walk(load_config(directory), checkpoint, get_task("embedding"), cache=cache)
    return model, report.layers_from_cache


def _states(model) -> np.ndarray:
    ids = torch.from_numpy(np.random.default_rng(7).integers(5, 300, size=(2, 13), dtype=np.int64))
    with torch.no_grad():
        return model(input_ids=ids, token_type_ids=torch.zeros_like(ids)).last_hidden_state.numpy()


@pytest.fixture
def bert(tiny_checkpoint, tmp_path):
    """A private copy of the tiny bert (its files are changed in place), and a layer cache the copy filled."""
    directory = shutil.copytree(tiny_checkpoint("bert"), tmp_path / "ckpt")
    cache = LayerCache(tmp_path / "cache")
    assert _walk(directory, cache)[1] == 0
    return directory, cache


def test_an_unchanged_checkpoint_hits(bert):
    directory, cache = bert
    model, hits = _walk(directory, cache)
    assert hits == LAYERS
    np.testing.assert_array_equal(_states(model), _states(_walk(directory, None)[0]))


def _overwrite_a_layer_tensor_in_place(path) -> None:
    """Negate one layer tensor's bytes inside the file (same size, same inode), then put the old mtime back."""
    before = os.stat(path)
    with open(path, "r+b") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        entry = json.loads(handle.read(length))["encoder.layer.1.attention.output.dense.weight"]
        assert entry["dtype"] == "F32"
        start, end = entry["data_offsets"]
        handle.seek(8 + length + start)
        values = -np.frombuffer(handle.read(end - start), dtype="<f4")
        handle.seek(8 + length + start)
        handle.write(values.tobytes())
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_ino, after.st_mtime_ns) == (before.st_size, before.st_ino, before.st_mtime_ns)


def test_weights_overwritten_in_place_with_the_old_size_and_mtime_miss(bert):
    directory, cache = bert
    stale = _states(_walk(directory, cache)[0])
    _overwrite_a_layer_tensor_in_place(directory / "model.safetensors")
    model, hits = _walk(directory, cache)
    assert hits == 0
    fresh = _states(_walk(directory, None)[0])
    np.testing.assert_array_equal(_states(model), fresh)
    assert not np.allclose(fresh, stale, atol=1e-3)  # the change is one the states show


def test_a_folder_replaced_by_another_checkpoint_of_the_same_shape_misses(bert, tiny_tokenizer, tmp_path):
    from helpers.tiny_models import build_tiny

    directory, cache = bert
    other = build_tiny("bert", tmp_path / "other", tiny_tokenizer, seed=1)
    shutil.rmtree(directory)
    shutil.copytree(other, directory)  # copy2: the other files' mtimes, and sizes equal to the old ones
    model, hits = _walk(directory, cache)
    assert hits == 0
    np.testing.assert_array_equal(_states(model), _states(_walk(other, None)[0]))


@pytest.mark.parametrize("change", [{"layer_norm_eps": 0.5}, {"hidden_act": "relu"}])
def test_a_config_change_applies_to_cached_layers(bert, change):
    directory, cache = bert
    before = _states(_walk(directory, None)[0])
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **change}))
    model, hits = _walk(directory, cache)
    assert hits == LAYERS  # the tensors are the same: the cache rightly holds them
    after = _states(_walk(directory, None)[0])
    np.testing.assert_array_equal(_states(model), after)
    assert not np.allclose(after, before, atol=1e-3)  # the change is one the states show


# ----------------------------------------------------------------------------- a cache that cannot be used


def test_an_entry_this_process_cannot_read_is_a_miss_and_the_walk_goes_on(bert, monkeypatch, caplog):
    directory, cache = bert
    read_bytes = type(directory).read_bytes

    def refused(path):
        if path.parent == cache.cache_dir:  # another user's entry (written 0600)
            raise PermissionError(13, "Permission denied", str(path))
        return read_bytes(path)

    monkeypatch.setattr(type(directory), "read_bytes", refused)
    with caplog.at_level(logging.WARNING):
        model, hits = _walk(directory, cache)
    assert hits == 0 and "cannot be read" in caplog.text
    np.testing.assert_array_equal(_states(model), _states(_walk(directory, None)[0]))


def test_a_hit_this_process_cannot_mark_as_used_is_still_a_hit(bert, monkeypatch):
    directory, cache = bert

    def refused(path, *args, **kwargs):  # utime with explicit times needs the file's owner
        raise PermissionError(1, "Operation not permitted", str(path))

    monkeypatch.setattr(cache_files.os, "utime", refused)
    assert _walk(directory, cache)[1] == LAYERS


def test_a_damaged_entry_this_process_cannot_delete_is_a_miss(bert, monkeypatch, caplog):
    directory, cache = bert
    for entry in cache.cache_dir.glob("*.safetensors"):
        data = bytearray(entry.read_bytes())
        data[-1] ^= 0xFF
        entry.write_bytes(bytes(data))

    def refused(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(type(directory), "unlink", refused)
    with caplog.at_level(logging.WARNING):
        model, hits = _walk(directory, cache)
    assert hits == 0 and "cannot delete" in caplog.text
    np.testing.assert_array_equal(_states(model), _states(_walk(directory, None)[0]))


# ----------------------------------------------------------------------------- the candidate cache's key


def _graph(path, scale: float = 2.0):
    """A one-MatMul ONNX graph at ``path``: its weights' bytes change with ``scale``, its size does not."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.full((8, 8), scale, np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])], [weight])
    onnx.save_model(helper.make_model(graph), str(path))
    return path


@pytest.fixture
def installed(monkeypatch):
    """``installed(distributions)``: a process started in an environment whose modules come from
    ``distributions`` (name -> version), e.g. onnxruntime-gpu's.  A process reads what is installed once; the
    environment this one started in is read again after the test."""
    def start(distributions: dict[str, str]) -> None:
        def version(name):
            if name not in distributions:
                raise metadata.PackageNotFoundError(name)
            return distributions[name]

        provides = {name.split("-")[0]: [name] for name in distributions}
        monkeypatch.setattr(candidate_cache.metadata, "version", version)
        monkeypatch.setattr(candidate_cache.metadata, "packages_distributions", lambda: provides)
        candidate_cache._versions.cache_clear()

    yield start
    candidate_cache._versions.cache_clear()


@pytest.mark.parametrize("library", ["onnxruntime-gpu", "openvino", "nncf", "onnx"])
def test_an_upgrade_of_a_library_that_writes_graphs_is_another_key(library, installed, tmp_path):
    _graph(tmp_path / "plain.onnx")
    versions = {"onnxruntime-gpu": "1.31.1", "openvino": "2026.4.1", "nncf": "3.4.0", "onnx": "1.23.2"}
    keys = []
    for upgraded in (False, True):
        installed({**versions, **({library: "99.0"} if upgraded else {})})
        cache = CandidateCache(tmp_path / "cache")
        keys.append(cache.key(tmp_path / "q.onnx", [tmp_path / "plain.onnx"], {"step": "test"}))
    assert keys[0] != keys[1]


def test_a_source_changed_in_place_with_its_mtime_restored_is_another_key(tmp_path):
    source = _graph(tmp_path / "plain.onnx")
    cache = CandidateCache(tmp_path / "cache")  # one export's: it digests each source once
    key = cache.key(tmp_path / "q.onnx", [source], {})
    before = os.stat(source)
    data = source.read_bytes()
    with open(source, "r+b") as handle:  # the same file, other weights, the same size
        handle.write(data.replace(np.float32(2.0).tobytes(), np.float32(3.0).tobytes()))
    os.utime(source, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (os.stat(source).st_size, os.stat(source).st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert cache.key(tmp_path / "q.onnx", [source], {}) != key
    assert cache.key(tmp_path / "q.onnx", [source], {}) == CandidateCache(tmp_path / "cache").key(
        tmp_path / "q.onnx", [source], {})


class _FrozenClock:
    """``os.stat`` of one file with the timestamps it had when frozen: a file system whose clock did not tick
    between two writes (coarse timestamps)."""

    def __init__(self, monkeypatch, path):
        self.path, self.stat = str(path), os.stat(path)
        real = os.stat

        def stat(target, *args, **kwargs):
            found = real(target, *args, **kwargs)
            return self if os.fspath(target) == self.path else found

        self.found = lambda: real(self.path)
        monkeypatch.setattr(os, "stat", stat)

    def __getattr__(self, name):
        return getattr(self.stat, name) if name in ("st_mtime_ns", "st_ctime_ns") else getattr(self.found(), name)


def test_a_source_changed_within_one_clock_tick_is_another_key(tmp_path, monkeypatch):
    source = _graph(tmp_path / "plain.onnx")
    cache = CandidateCache(tmp_path / "cache")
    clock = _FrozenClock(monkeypatch, source)
    key = cache.key(tmp_path / "q.onnx", [source], {})
    before = source.read_bytes()
    _graph(source, scale=3.0)  # the same size; its timestamps, as stat reports them, unchanged
    assert source.read_bytes() != before and len(source.read_bytes()) == len(before)
    assert (os.stat(source).st_mtime_ns, os.stat(source).st_ctime_ns) == (clock.stat.st_mtime_ns,
                                                                          clock.stat.st_ctime_ns)
    assert cache.key(tmp_path / "q.onnx", [source], {}) != key


def test_a_settled_source_is_digested_once_per_export(tmp_path, monkeypatch):
    source = _graph(tmp_path / "plain.onnx")
    cache = CandidateCache(tmp_path / "cache")
    later = os.stat(source).st_ctime_ns + 10**10
    monkeypatch.setattr(candidate_cache.time, "time_ns", lambda: later)
    digested = []
    monkeypatch.setattr(candidate_cache, "_file_digest", lambda path: digested.append(path) or "a digest")
    for recipe in ({"keep": []}, {"keep": ["a"]}):
        cache.key(tmp_path / "q.onnx", [source], recipe)
    assert digested == [source]


def test_a_change_to_the_code_that_converts_a_families_tensors_misses(bert, monkeypatch):
    """The layers' weights are what the walk's and the family's code made of the checkpoint's tensors: a cache
    filled by other code (an upgrade that fixed a conversion) is a miss, not its weights served and validated
    against themselves."""
    from nexus_sli.exporter.export import walk as walking
    from nexus_sli.exporter.export.families.native import NomicBertFamily
    from nexus_sli.exporter.export.families.remote_code import GteFamily

    directory, cache = bert
    # the digest reads the family's own module: families of other modules have other digests
    assert walking._conversion_digest(NomicBertFamily()) != walking._conversion_digest(GteFamily())
    assert _walk(directory, cache)[1] == LAYERS
    monkeypatch.setattr(walking, "_conversion_digest", lambda family: "another conversion")
    assert _walk(directory, cache)[1] == 0
