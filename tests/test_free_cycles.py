"""When an export collects the reference cycles the graph tools leave: at once for a large graph, whose cycles hold
gigabytes, and not for a small one, whose collection would cost more of its export than its memory is worth."""

from __future__ import annotations

import gc
from contextlib import contextmanager

import onnx
import pytest
from onnx import TensorProto, helper

from nexus_sli.exporter.export import optimize
from nexus_sli.exporter.export.optimize import COLLECT_FROM_BYTES, free_cycles, fuse


@contextmanager
def full_collections():
    """The full (generation 2) collections run inside the block, Python's own automatic ones held off."""
    seen: list[int] = []

    def record(phase, info):
        if phase == "start" and info["generation"] == 2:
            seen.append(1)

    enabled = gc.isenabled()
    gc.disable()
    gc.callbacks.append(record)
    try:
        yield seen
    finally:
        gc.callbacks.remove(record)
        if enabled:
            gc.enable()


def _graph(path):
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "identity",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


@pytest.mark.parametrize("large, collections", [(False, 0), (True, 1)])
def test_fuse_collects_at_once_where_the_plain_graph_has_a_data_file(tmp_path, large, collections):
    plain = _graph(tmp_path / "plain.onnx")
    with full_collections() as seen:
        fuse(plain, tmp_path / "fused.onnx", num_heads=1, hidden_size=4, large=large)
    assert len(seen) == collections


def test_a_one_file_graph_is_collected_for_from_its_size(tmp_path, monkeypatch):
    plain = _graph(tmp_path / "plain.onnx")
    size = plain.stat().st_size
    assert size < COLLECT_FROM_BYTES
    for threshold, collections in ((size + 1, 0), (size, 1)):
        monkeypatch.setattr(optimize, "COLLECT_FROM_BYTES", threshold)
        with full_collections() as seen:
            free_cycles(plain, large=False)
        assert len(seen) == collections, threshold
