"""A Python-based Triton backend named ``openvino``.

The PyPI Triton build has no native OpenVINO backend; installed as
``<backend-dir>/openvino/model.py`` (with ``encoder_backend.py``,
``batching.py`` and ``openvino_properties.py`` beside it) this serves ``backend: "openvino"`` models, an
ONNX file or an OpenVINO IR (``model.xml`` + ``model.bin``), with the
openvino package.  It reads the parameters of Triton's native OpenVINO
backend, so the same repository runs on an NGC container:

- ``HINT_BF16`` ``YES``: bf16 inference precision (on CPUs with bf16);
  anything else keeps f32, which the exporter validated;
- ``INFERENCE_NUM_THREADS``, ``NUM_STREAMS``, ``PERFORMANCE_HINT``: passed on.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # the shared modules beside this file

import openvino as ov  # noqa: E402
from encoder_backend import EncoderBackend  # noqa: E402
from openvino_properties import compile_properties  # noqa: E402


class TritonPythonModel(EncoderBackend):
    def load(self, path, params):
        core = ov.Core()
        self.compiled = core.compile_model(core.read_model(str(path)), "CPU", compile_properties(params))
        self.request = self.compiled.create_infer_request()
        self.ports = {output.get_any_name(): output for output in self.compiled.outputs}

    def infer(self, feeds, names):
        results = self.request.infer(feeds)
        # the request reuses its output buffers on the next run: copy out, only what was asked for
        return {name: results[self.ports[name]].copy() for name in names}
