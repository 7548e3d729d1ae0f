"""A Python-based Triton backend named ``onnxruntime``.

The PyPI Triton build has no native ONNX Runtime backend; installed as
``<backend-dir>/onnxruntime/model.py`` this serves ``platform:
"onnxruntime_onnx"`` models with the onnxruntime package, so the very same
repository runs unchanged on an NGC container with the native C++ backend.
All requests of one execute() call run as one session run; when that run fails,
each request runs alone, so only a bad request (token ids outside the
vocabulary, inputs of different shapes) gets an error.
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

    def _feeds(self, request):
        """The request's inputs, checked to fit together: [rows, length] each, the same for all."""
        feeds = {}
        for name in self.inputs:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is None:
                raise ValueError(f"input {name} is missing")
            feeds[name] = tensor.as_numpy()
        shapes = {name: array.shape for name, array in feeds.items()}
        if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 2:
            raise ValueError(f"inputs must all have one shape [rows, length]; got {shapes}")
        return feeds

    def _run(self, per_request):
        """One session run for all requests: their outputs, in order."""
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
        answers, start = [], 0
        for size, length in zip(sizes, lengths):
            answers.append({
                name: np.ascontiguousarray(results[name][start:start + size][:, :length] if follows_sequence
                                           else results[name][start:start + size])
                for name, follows_sequence in self.outputs.items()
            })
            start += size
        return answers

    def _response(self, outputs=None, error=None):
        if error is not None:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(error))
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(n, v) for n, v in outputs.items()])

    def execute(self, requests):
        feeds, errors = {}, {}
        for number, request in enumerate(requests):
            try:
                feeds[number] = self._feeds(request)
            except ValueError as exc:
                errors[number] = str(exc)
        answers = {}
        if feeds:
            try:
                answers = dict(zip(feeds, self._run(list(feeds.values()))))
            except Exception:  # noqa: BLE001 - one bad request (ids out of the vocabulary, ...): find it
                for number, request_feeds in feeds.items():
                    try:
                        answers[number] = self._run([request_feeds])[0]
                    except Exception as exc:  # noqa: BLE001 - reported to this request's sender
                        errors[number] = f"the encoder failed on this request: {type(exc).__name__}: {exc}"
        return [self._response(answers.get(n), errors.get(n)) for n in range(len(requests))]
