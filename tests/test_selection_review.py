"""How an export chooses its graph: the sessions ``auto`` validates and times its candidates with."""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from nexus_sli.exporter.export.optimize import session


def _identity(path):
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "identity",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_onnx_runtime_candidates_run_with_threads_that_sleep_between_runs_as_served(tmp_path):
    """Timing runs the candidates in turns: a session whose idle threads spin keeps a core busy after its run and
    slows the graph timed next; the served encoder's threads sleep (serving/backends/onnxruntime_backend.py)."""
    options = session(_identity(tmp_path / "identity.onnx")).get_session_options()
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
