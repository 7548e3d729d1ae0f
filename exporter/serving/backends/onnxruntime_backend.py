"""A Python-based Triton backend named ``onnxruntime``.

The PyPI Triton build has no native ONNX Runtime backend; installed as
``<backend-dir>/onnxruntime/model.py`` (with the modules it shares beside it:
``backend_folders._shim`` copies them) this serves
``platform: "onnxruntime_onnx"`` models with the onnxruntime package, so the
very same repository runs unchanged on an NGC container with the native C++
backend.  Like that backend it honours the config's instance kind and GPU
execution accelerators (TensorRT, then CUDA, then the CPU) where this
onnxruntime has those providers (``onnxruntime-gpu``), and logs what it chose
and every fallback (:mod:`onnxruntime_providers`).
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # the shared modules beside this file

import onnxruntime as ort  # noqa: E402
from encoder_backend import EncoderBackend  # noqa: E402
from onnxruntime_providers import choose_providers, instance_kind, load_gpu_libraries  # noqa: E402


def _log(message: str) -> None:
    """Into the server's log (the python backend's logger where it has one, else the stub's stderr)."""
    import triton_python_backend_utils as pb_utils

    logger = getattr(pb_utils, "Logger", None)
    if logger is not None:
        logger.log_warn(message)
    else:
        print(message, file=sys.stderr, flush=True)


class TritonPythonModel(EncoderBackend):
    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        self.device_id = int(args.get("model_instance_device_id") or 0)
        self.model_name = args.get("model_name", "")
        super().initialize(args)

    def load(self, path, params):
        options = ort.SessionOptions()
        # Operator knobs, read from the server's environment: intra-op threads (0: one
        # per core) and whether idle threads spin (1) or sleep (0) between runs.  Sleeping
        # is the default: the tokenizer and pooling steps share the cores with this one,
        # and spinning threads delay them (bench/data/tried.md, "thread settings of the served
        # encoder").
        options.intra_op_num_threads = int(os.environ.get("NEXUS_ORT_THREADS", "0"))
        spinning = os.environ.get("NEXUS_ORT_SPINNING", "0")
        if spinning not in ("0", "1"):  # ONNX Runtime would read anything else as 0
            raise ValueError(f"NEXUS_ORT_SPINNING must be 0 or 1, not {spinning!r}")
        options.add_session_config_entry("session.intra_op.allow_spinning", spinning)
        loaded = load_gpu_libraries(ort) if instance_kind(self.model_config) == "KIND_GPU" else []
        providers, notes = choose_providers(self.model_config, ort.get_available_providers(), self.device_id)
        for note in [*loaded, *notes]:
            _log(f"nexus-sli onnxruntime backend, {self.model_name}: {note}")
        self.session = ort.InferenceSession(str(path), options, providers=providers)
        _log(f"nexus-sli onnxruntime backend, {self.model_name}: session providers {self.session.get_providers()}")

    def infer(self, feeds, names):
        # only the outputs asked for: ONNX Runtime neither copies the others out nor runs the nodes
        # that only they need
        return dict(zip(names, self.session.run(names, feeds)))
