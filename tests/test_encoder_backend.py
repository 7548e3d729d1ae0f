"""The encoder shims' shared part (exporter/serving/backends/encoder_backend.py), with a stand-in model: each
request gets its own rows back, and a request of no rows an empty answer whether it runs alone or merged."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from nexus_sli.exporter.serving.binary import pytriton_root

BACKENDS = Path(__file__).resolve().parent.parent / "exporter" / "serving" / "backends"
SHARED = Path(__file__).resolve().parent.parent / "client"  # error_codes.py, copied beside the shims
#: what the shim imports from its folder: imported here, then dropped for the next test's own copies
SHIM_MODULES = ("encoder_backend", "batching", "error_codes", "onnxruntime_providers")


class _Request:
    def __init__(self, ids: np.ndarray):
        self.tensors = {"input_ids": ids, "attention_mask": (ids > 0).astype(np.int64)}

    def requested_output_names(self):
        return []


@pytest.fixture
def encoder(monkeypatch):
    """A shim whose model sums each row's ids (``EMB`` [1]) and echoes them per token (``TOK`` [-1, 2])."""
    for module in SHIM_MODULES:
        monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.syspath_prepend(str(pytriton_root() / "backends" / "python"))
    monkeypatch.syspath_prepend(str(SHARED))
    monkeypatch.syspath_prepend(str(BACKENDS))
    import encoder_backend

    monkeypatch.setattr(encoder_backend.pb_utils, "get_input_tensor_by_name",
                        lambda request, name: SimpleNamespace(as_numpy=lambda: request.tensors[name]), raising=False)
    monkeypatch.setattr(encoder_backend.pb_utils, "Tensor", lambda n, a: (n, a), raising=False)
    monkeypatch.setattr(encoder_backend.pb_utils, "TritonError", str, raising=False)
    monkeypatch.setattr(encoder_backend.pb_utils, "InferenceResponse", lambda output_tensors=None, error=None:
                        SimpleNamespace(tensors=dict(output_tensors or []), error=error), raising=False)

    class Summing(encoder_backend.EncoderBackend):
        def load(self, path, params):
            pass

        def infer(self, feeds, names):
            ids = feeds["input_ids"]
            return {"EMB": ids.sum(1, keepdims=True).astype(np.float32),
                    "TOK": np.repeat(ids[..., None], 2, axis=2).astype(np.float32)}

    shim = Summing()
    shim.initialize({"model_config": json.dumps({
        "input": [{"name": "input_ids"}, {"name": "attention_mask"}],
        "output": [{"name": "EMB", "dims": [1]}, {"name": "TOK", "dims": [-1, 2]}]}),
        "model_repository": "/nonexistent", "model_version": "1"})
    yield shim
    for module in SHIM_MODULES:
        sys.modules.pop(module, None)


def test_a_request_of_no_rows_is_answered_empty_alone_and_merged(encoder):
    empty = _Request(np.zeros((0, 4), np.int64))
    rows = _Request(np.array([[3, 4, 0, 0], [5, 0, 0, 0]], np.int64))
    (alone,) = encoder.execute([empty])
    assert alone.error is None
    assert alone.tensors["EMB"].shape == (0, 1) and alone.tensors["TOK"].shape == (0, 0, 2)
    merged_empty, merged_rows = encoder.execute([empty, rows])
    assert merged_empty.error is None and merged_empty.tensors["EMB"].shape[0] == 0
    assert merged_rows.tensors["EMB"][:, 0].tolist() == [7.0, 5.0]


def test_rows_without_tokens_are_refused_as_invalid_input_and_the_others_answered(encoder):
    tokenless = _Request(np.zeros((2, 0), np.int64))
    rows = _Request(np.array([[3, 4, 0], [5, 0, 0]], np.int64))
    refused, answered = encoder.execute([tokenless, rows])
    assert refused.error.startswith("[nexus:invalid_input]") and "at least one token" in refused.error
    assert answered.error is None and answered.tensors["EMB"][:, 0].tolist() == [7.0, 5.0]


@pytest.mark.parametrize("seed", range(4))
def test_merged_requests_of_mixed_rows_and_widths_each_get_their_own_rows_in_order(encoder, seed):
    """Rows regrouped by length across requests come back to their request, in its order, as each would
    alone; a per-token output is zero past a row's real tokens."""
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(5):
        ids = np.zeros((int(rng.integers(0, 5)), int(rng.integers(1, 40))), np.int64)
        for row in ids:
            real = int(rng.integers(1, len(row) + 1))
            row[:real] = rng.integers(1, 100, real)
        requests.append(_Request(ids))
    for request, answer in zip(requests, encoder.execute(requests)):
        ids = request.tensors["input_ids"]
        assert answer.error is None and answer.tensors["EMB"][:, 0].tolist() == ids.sum(1).tolist()
        tokens = answer.tensors["TOK"][..., 0]
        shared = min(tokens.shape[1], ids.shape[1])
        assert tokens.shape[0] == len(ids) and (tokens[:, :shared] == ids[:, :shared]).all()
        assert not ids[:, shared:].any() and not tokens[:, shared:].any()
