"""A Python-based Triton backend named ``onnxruntime``.

The PyPI Triton build has no native ONNX Runtime backend; installed as
``<backend-dir>/onnxruntime/model.py`` this serves ``platform:
"onnxruntime_onnx"`` models with the onnxruntime package, so the very same
repository runs unchanged on an NGC container with the native C++ backend.
All requests of one execute() call run as one session run.
"""

import json
import os
from pathlib import Path

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        filename = config.get("default_model_filename") or "model.onnx"
        path = Path(args["model_repository"]) / args["model_version"] / filename
        options = ort.SessionOptions()
        options.intra_op_num_threads = int(os.environ.get("NEXUS_ORT_THREADS", "0"))
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.inputs = [i["name"] for i in config["input"]]
        # Outputs whose first non-batch dim is variable follow the sequence length.
        self.outputs = {o["name"]: o["dims"][0] == -1 for o in config["output"]}

    def execute(self, requests):
        per_request = [
            {name: pb_utils.get_input_tensor_by_name(r, name).as_numpy() for name in self.inputs} for r in requests
        ]
        sizes = [feeds[self.inputs[0]].shape[0] for feeds in per_request]
        lengths = [feeds[self.inputs[0]].shape[1] for feeds in per_request]
        longest = max(lengths)
        batch = {
            name: np.concatenate([
                np.pad(feeds[name], ((0, 0), (0, longest - feeds[name].shape[1]))) for feeds in per_request
            ])
            for name in self.inputs
        }
        results = dict(zip(self.outputs, self.session.run(list(self.outputs), batch)))
        responses, start = [], 0
        for size, length in zip(sizes, lengths):
            tensors = []
            for name, follows_sequence in self.outputs.items():
                part = results[name][start:start + size]
                tensors.append(pb_utils.Tensor(name, np.ascontiguousarray(part[:, :length] if follows_sequence else part)))
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            start += size
        return responses
