"""The candidate cache (:mod:`export.candidate_cache`): a second export restores the quantized graphs the first made,
and still validates them; a damaged entry is a miss; ``--no-cache`` neither reads nor fills it."""

from __future__ import annotations

import filecmp
import logging
import tarfile

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from nexus_sli.cli.main import main
from nexus_sli.exporter.export import candidate_cache, export_report, onnx_files, pipeline, static_int8, timing
from nexus_sli.exporter.export.candidate_cache import FOLDER, CandidateCache, feeds_digest
from nexus_sli.exporter.export.pipeline import ExportOptions, run_export
from nexus_sli.exporter.targets import onnxruntime_cpu, openvino_cpu

#: the OpenVINO int8 variants an embedding's export makes
OPENVINO_INT8 = ["plain+sq0.75+attn-out-fp32", "plain+sq0.75+attn-ffn-out-fp32"]


@pytest.fixture(autouse=True)
def one_timing(monkeypatch):
    # which graph is fastest is no concern here; one fixed figure keeps the choice the same from export to export
    monkeypatch.setattr(timing, "run_ms", lambda runner, feeds: 1.0)


@pytest.fixture
def quantized(monkeypatch):
    """The graphs NNCF and ONNX Runtime's dynamic quantizer made, by file name, in order."""
    made: list[str] = []

    def counted(function):
        def call(source, target, *args, **kwargs):
            made.append(target.name)
            return function(source, target, *args, **kwargs)
        return call

    # where the targets call them from
    monkeypatch.setattr(openvino_cpu, "quantize_ir", counted(static_int8.quantize_ir))
    monkeypatch.setattr(onnxruntime_cpu, "quantize_qdq", counted(static_int8.quantize_qdq))
    monkeypatch.setattr(onnxruntime_cpu, "quantize_int8", counted(onnxruntime_cpu.quantize_int8))
    return made


@pytest.fixture
def validated(monkeypatch):
    """The candidates validated against PyTorch, as (backend, graph file) in order."""
    seen: list[tuple[str, str]] = []
    original = pipeline.compare

    def compare(session, reference, precision, embedder, task, backend, *args, **kwargs):
        seen.append((backend, precision))
        return original(session, reference, precision, embedder, task, backend, *args, **kwargs)

    monkeypatch.setattr(pipeline, "compare", compare)
    return seen


def _export(directory, out, cache_dir, backend="openvino"):
    return run_export(ExportOptions(model=str(directory), task="embedding", name="q", out=out, cache_dir=cache_dir,
                                    backend=backend, precision="int8")).report


def _rows(report) -> dict:
    return {row.graph: (row.passed, row.cosine_min, row.cosine_mean, row.score_error) for row in report.measured}


def _damage(entry) -> None:
    """Flip one byte in the middle of the graph's bytes in a cache entry: the tar still parses."""
    with tarfile.open(entry) as tar:
        graph = next(m for m in tar.getmembers() if m.name.endswith(".onnx"))
    data = bytearray(entry.read_bytes())
    data[graph.offset_data + graph.size // 2] ^= 0xFF
    entry.write_bytes(bytes(data))


def test_a_second_export_restores_the_quantized_graphs_and_validates_them(tiny_checkpoint, tmp_path, quantized,
                                                                         validated, caplog):
    directory, cache = tiny_checkpoint("bert"), tmp_path / "cache"
    cold = _export(directory, tmp_path / "cold", cache)
    assert len(quantized) == len(validated) == 2
    entries = sorted(p.name for p in (cache / FOLDER).iterdir())
    assert len(entries) == 2 and all(name.endswith(".tar") for name in entries)

    quantized.clear(), validated.clear()
    caplog.set_level(logging.INFO, logger=candidate_cache.__name__)
    warm = _export(directory, tmp_path / "warm", cache)
    assert quantized == []  # nothing quantized again: the plain graph, and so every key, is the same
    assert caplog.text.count("restored from the candidate cache") == 2
    assert len(validated) == 2  # every restored graph validated against PyTorch, as a made one is
    assert [c.graph for c in warm.candidates] == OPENVINO_INT8
    # the same graphs: the same figures, and the same files served
    assert _rows(warm) == _rows(cold)
    for name in ("model.xml", "model.bin"):
        assert filecmp.cmp(tmp_path / "cold" / "q_encoder" / "1" / name, tmp_path / "warm" / "q_encoder" / "1" / name,
                           shallow=False)
    assert sorted(p.name for p in (cache / FOLDER).iterdir()) == entries


def test_a_damaged_entry_is_a_miss_made_again(tiny_checkpoint, tmp_path, quantized, caplog):
    directory, cache = tiny_checkpoint("bert"), tmp_path / "cache"
    _export(directory, tmp_path / "cold", cache, backend="onnxruntime")
    entries = sorted((cache / FOLDER).iterdir())
    assert len(quantized) == len(entries) == 4  # dynamic int8 of the plain and fused graph, each in two variants
    damaged = entries[0]
    _damage(damaged)
    broken = damaged.read_bytes()

    quantized.clear()
    caplog.set_level(logging.WARNING, logger=candidate_cache.__name__)
    report = _export(directory, tmp_path / "warm", cache, backend="onnxruntime")
    assert len(quantized) == 1  # only the damaged entry's graph is made again
    assert f"candidate cache entry {damaged.name} is damaged: " in caplog.text and "checksum mismatch" in caplog.text
    assert report.validation.passed
    assert damaged.is_file() and damaged.read_bytes() != broken  # deleted, then cached again from the graph made anew
    assert not list((tmp_path / "warm").rglob(".*.restoring"))


def test_no_cache_neither_reads_nor_fills_it(tiny_checkpoint, tmp_path, quantized, monkeypatch):
    directory, cache = tiny_checkpoint("bert"), tmp_path / "cache"
    _export(directory, tmp_path / "cold", cache, backend="onnxruntime")
    before = {entry: entry.stat().st_mtime_ns for entry in (cache / FOLDER).iterdir()}  # a hit touches its entry
    quantized.clear()
    monkeypatch.setenv("NEXUS_SLI_CACHE_DIR", str(cache))  # the default cache (--cache-dir beside --no-cache: refused)
    assert main(["export", "--model", str(directory), "--task", "embedding", "--name", "q", "--backend", "onnxruntime",
                 "--precision", "int8", "--no-cache", "--out", str(tmp_path / "repo")]) == 0
    assert len(quantized) == 4  # every graph made, though the cache holds each
    assert {entry: entry.stat().st_mtime_ns for entry in (cache / FOLDER).iterdir()} == before
    assert export_report.read(tmp_path / "repo" / "q_encoder").validation.passed


@pytest.mark.parametrize("backend, made", [("openvino", ["plain.ov-int8-sq-attn-out-fp32.xml"]),
                                           ("onnxruntime", ["plain.int8.onnx"])])
def test_an_export_without_a_search_quantizes_only_the_graph_it_keeps(tiny_checkpoint, tmp_path, quantized,
                                                                      backend, made):
    report = run_export(ExportOptions(model=str(tiny_checkpoint("bert")), task="embedding", name="q",
                                      out=tmp_path / "repo", cache=False, backend=backend, precision="int8",
                                      search=False)).report
    assert quantized == made and len(report.candidates) == 1


# ----------------------------------------------------------------------------- the cache alone, no export


def _graph(path, scale: float = 1.0, external: bool = False):
    """A one-MatMul ONNX graph at ``path`` (its weight in ``<name>.data`` where ``external``)."""
    weight = numpy_helper.from_array(np.full((64, 64), scale, np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], [weight])
    model = helper.make_model(graph)
    if external:
        onnx.save_model(model, str(path), save_as_external_data=True, location=path.name + ".data", size_threshold=0)
    else:
        onnx.save_model(model, str(path))
    return path


def _made(tmp_path, name: str, scale: float = 2.0, external: bool = False):
    """A ``make`` that writes a graph at ``tmp_path / name``, and the names of the calls it was given."""
    calls = []

    def make():
        calls.append(name)
        return _graph(tmp_path / name, scale, external)
    return make, calls


def test_a_graph_and_its_data_file_come_back_byte_for_byte(tmp_path):
    cache = CandidateCache(tmp_path / "cache")
    source = _graph(tmp_path / "plain.onnx")
    (tmp_path / "one").mkdir()
    make, calls = _made(tmp_path / "one", "q.onnx", external=True)
    cache.made(tmp_path / "one" / "q.onnx", make, [source], {"step": "test"})
    (tmp_path / "two").mkdir()
    again, calls_again = _made(tmp_path / "two", "q.onnx", external=True)
    restored = cache.made(tmp_path / "two" / "q.onnx", again, [source], {"step": "test"})
    assert calls == ["q.onnx"] and calls_again == []
    assert [f.name for f in onnx_files.files(restored)] == ["q.onnx", "q.onnx.data"]
    for name in ("q.onnx", "q.onnx.data"):
        assert filecmp.cmp(tmp_path / "one" / name, tmp_path / "two" / name, shallow=False)


def test_the_key_follows_the_sources_content_the_recipe_and_the_name(tmp_path):
    cache = CandidateCache(tmp_path / "cache")
    source = _graph(tmp_path / "plain.onnx")
    target = tmp_path / "q.onnx"
    key = cache.key(target, [source], {"keep": ["a"]})
    assert cache.key(target, [source], {"keep": ["a"]}) == key
    assert cache.key(target, [source], {"keep": ["b"]}) != key
    assert cache.key(tmp_path / "r.onnx", [source], {"keep": ["a"]}) != key
    _graph(source, scale=3.0)  # the same file, other weights
    assert cache.key(target, [source], {"keep": ["a"]}) != key
    feeds = [{"input_ids": np.arange(6).reshape(2, 3)}]
    assert feeds_digest(feeds) != feeds_digest([{"input_ids": np.arange(6).reshape(3, 2)}])


def test_a_truncated_entry_is_a_miss_and_leaves_nothing_beside_the_graph(tmp_path, caplog):
    cache = CandidateCache(tmp_path / "cache")
    source = _graph(tmp_path / "plain.onnx")
    make, _ = _made(tmp_path, "q.onnx")
    cache.made(tmp_path / "q.onnx", make, [source], {})
    (entry,) = (tmp_path / "cache").iterdir()
    entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])
    (tmp_path / "out").mkdir()
    with caplog.at_level(logging.WARNING, logger=candidate_cache.__name__):
        assert cache.restore(cache.key(tmp_path / "out" / "q.onnx", [source], {}), tmp_path / "out" / "q.onnx") is False
    assert "is damaged" in caplog.text and not entry.exists()
    assert list((tmp_path / "out").iterdir()) == []


def test_the_least_recently_used_entry_goes_first_past_the_bound(tmp_path):
    source = _graph(tmp_path / "plain.onnx")
    size = (tmp_path / "plain.onnx").stat().st_size
    cache = CandidateCache(tmp_path / "cache", max_cache_size_gb=2.5 * size / 1024**3)  # room for two entries
    paths = {}
    for name in ("a.onnx", "b.onnx"):
        make, _ = _made(tmp_path, name)
        cache.made(tmp_path / name, make, [source], {})
        paths[name] = cache.entry_path(cache.key(tmp_path / name, [source], {}), name)
    assert cache.restore(cache.key(tmp_path / "a.onnx", [source], {}), tmp_path / "a.onnx")  # a: used last
    make, _ = _made(tmp_path, "c.onnx")
    cache.made(tmp_path / "c.onnx", make, [source], {})
    assert paths["a.onnx"].exists() and not paths["b.onnx"].exists()
    assert cache.size_bytes() <= 2.5 * size


def test_a_restore_that_cannot_write_beside_the_graph_keeps_the_entry(tmp_path, caplog):
    """A failure on the target's side (here a folder where a restored file's temporary name goes; a full or
    read-only disk alike) is a miss that leaves the sound entry for the next export."""
    cache = CandidateCache(tmp_path / "cache")
    source = _graph(tmp_path / "plain.onnx")
    make, _ = _made(tmp_path, "q.onnx")
    cache.made(tmp_path / "q.onnx", make, [source], {})
    (entry,) = (tmp_path / "cache").iterdir()
    target = tmp_path / "out" / "q.onnx"
    (tmp_path / "out" / ".q.onnx.restoring").mkdir(parents=True)
    key = cache.key(target, [source], {})
    with caplog.at_level(logging.WARNING, logger=candidate_cache.__name__):
        assert cache.restore(key, target) is False
    assert "cannot write q.onnx's files" in caplog.text and "is damaged" not in caplog.text
    assert entry.exists() and not target.exists()
    (tmp_path / "out" / ".q.onnx.restoring").rmdir()
    assert cache.restore(key, target) is True
    assert filecmp.cmp(tmp_path / "q.onnx", target, shallow=False)
