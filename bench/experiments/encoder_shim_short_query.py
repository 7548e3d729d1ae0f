"""The python-based encoder backend's ``execute`` on one short query: a commit's version against this checkout's.

An experiment, not part of the product or of ``make bench``; its findings are in bench/data/tried.md,
"The encoder step's own work on a short query".  Both versions of the backend (``encoder_backend.py``
and the runtime's ``<runtime>_backend.py``; the commit's read with ``git show``) are loaded side by
side in this process, each with its own session on the same exported encoder, with stand-ins for
Triton's request objects, and run one request of one short query (9 tokens, padded to the tokenizer
step's width of 256) in turn, the order reversed every other call; per round the p50 of 300 calls::

    .venv/bin/python bench/experiments/encoder_shim_short_query.py /tmp/h7/served/all_minilm_l6_v2_ov_int8_encoder \\
        --runtime openvino --before 68ed46f

``--runtime-only`` takes this checkout's runtime file with the commit's ``encoder_backend.py``, so that
the runtime file's change is timed alone.  The encoder folder is an exported ``NAME_encoder`` (its
``config.pbtxt`` and ``1/``), e.g. of the repository ``ingraph_tokenizer.py served`` builds.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2 as pb

from nexus_sli.exporter.serving.binary import pytriton_root

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ROOT / "exporter" / "serving" / "backends"
SHARED = ("batching.py", "openvino_properties.py", "onnxruntime_providers.py")


class _Tensor:
    def __init__(self, array):
        self.array = array

    def as_numpy(self):
        return self.array


class _Request:
    """One request of one query of ``tokens`` tokens, padded to ``width`` as the tokenizer step sends it."""

    def __init__(self, tokens: int, width: int = 256):
        ids, mask = np.zeros((1, width), np.int64), np.zeros((1, width), np.int64)
        ids[0, :tokens], mask[0, :tokens] = 1000, 1
        self.tensors = {"input_ids": _Tensor(ids), "attention_mask": _Tensor(mask),
                        "token_type_ids": _Tensor(np.zeros((1, width), np.int64))}

    def requested_output_names(self):
        return ["EMBEDDING"]


def _load(tag: str, encoder_source: Path, runtime_source: Path):
    """The runtime's backend module, importing ``encoder_source`` as its ``encoder_backend``."""
    spec = importlib.util.spec_from_file_location("encoder_backend", encoder_source)
    shared = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shared)
    sys.modules["encoder_backend"] = shared
    spec = importlib.util.spec_from_file_location(f"backend_{tag}", runtime_source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    utils = shared.pb_utils
    utils.Tensor = lambda name, array: (name, array)
    utils.InferenceResponse = lambda output_tensors=None, error=None: (output_tensors, error)
    utils.get_input_tensor_by_name = lambda request, name: request.tensors.get(name)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("encoder", type=Path)
    parser.add_argument("--runtime", choices=("openvino", "onnxruntime"), required=True)
    parser.add_argument("--before", required=True, help="the commit whose backend is timed against this checkout's")
    parser.add_argument("--runtime-only", action="store_true")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    runtime_file = f"{args.runtime}_backend.py"
    work = Path(tempfile.mkdtemp())
    for name in SHARED:
        shutil.copy(BACKENDS / name, work / name)
    shutil.copy(ROOT / "client" / "error_codes.py", work / "error_codes.py")
    for name in ("encoder_backend.py", runtime_file):
        old = subprocess.run(["git", "show", f"{args.before}:exporter/serving/backends/{name}"], cwd=ROOT,
                             check=True, capture_output=True, text=True).stdout
        (work / f"before_{name}").write_text(old)
    sys.path[:0] = [str(pytriton_root() / "backends" / "python"), str(work)]
    before = _load("before", work / "before_encoder_backend.py", work / f"before_{runtime_file}")
    now = _load("now", (work / "before_encoder_backend.py") if args.runtime_only else BACKENDS / "encoder_backend.py",
                BACKENDS / runtime_file)
    config = text_format.Parse((args.encoder / "config.pbtxt").read_text(), pb.ModelConfig())
    loaded = {"model_config": json.dumps(json_format.MessageToDict(config, preserving_proto_field_name=True)),
              "model_repository": str(args.encoder), "model_version": "1"}
    models = {}
    for tag, module in (("before", before), ("now", now)):
        models[tag] = module.TritonPythonModel()
        models[tag].initialize(loaded)
    requests = [_Request(9)]
    same = np.array_equal(*(m.execute(requests)[0][0][0][1] for m in models.values()))
    for _ in range(300):
        for model in models.values():
            model.execute(requests)
    p50s = {tag: [] for tag in models}
    for _ in range(args.rounds):
        times = {tag: [] for tag in models}
        for index in range(300):
            order = list(models.items())
            for tag, model in order[::-1] if index % 2 else order:
                started = time.perf_counter()
                model.execute(requests)
                times[tag].append(time.perf_counter() - started)
        for tag in models:
            p50s[tag].append(float(np.percentile(times[tag], 50)) * 1e6)
    shutil.rmtree(work)
    print(f"the same embedding: {same}")
    for tag, values in p50s.items():
        print(f"{tag}: p50 by round {', '.join(f'{v:.0f}' for v in values)} us; median {statistics.median(values):.0f}")
    saved = [a - b for a, b in zip(p50s["before"], p50s["now"])]
    print(f"before minus now, by round: {', '.join(f'{s:+.0f}' for s in saved)} us; median "
          f"{statistics.median(saved):+.0f}; now lower in {sum(s > 0 for s in saved)}/{len(saved)}")


if __name__ == "__main__":
    main()
