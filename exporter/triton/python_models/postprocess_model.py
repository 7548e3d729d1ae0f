"""Triton python model: encoder outputs -> the task's answer.

The ``head`` parameter (the task spec's) picks the function of ``heads.HEADS``
that turns the request's input arrays into its output arrays.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils
from encoding import pool
from error_codes import INFERENCE_FAILED, INVALID_INPUT, mark
from heads import HEADS, class_scores
from model_parameters import HEAD, POOLING, SCORE_FUNCTION, TASK, strings


#: Token-aligned inputs: the tokenizer pads them to a fixed width, while the encoder's
#: per-token outputs come back cut to the batch's longest real token.
_TOKEN_ALIGNED = ("attention_mask", "offsets", "context_mask", "word_spans", "special_tokens_mask")
_PER_TOKEN = ("last_hidden_state", "start_logits", "logits")


def _fit_to_sequence(x):
    """``x`` with its token-aligned inputs cut to the per-token output's length (only
    padding is cut: the encoder's output covers every real token)."""
    per_token = next((x[n] for n in _PER_TOKEN if n in x and x[n].ndim >= 2 + (n == "logits")), None)
    if per_token is None:
        return x
    length = per_token.shape[1]
    return {n: (v[:, :length] if n in _TOKEN_ALIGNED else v) for n, v in x.items()}


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.params = strings(config)
        self.task = TASK.read(self.params)
        self.input_names = [i["name"] for i in config["input"]]
        head = HEAD.read(self.params, None)
        if head not in HEADS:
            raise ValueError(f"unknown post-processing head {head!r} for task {self.task!r}; "
                             f"this repository's heads.py has {', '.join(HEADS)}")
        self.head = HEADS[head]
        pooling = POOLING.read(self.params, None)
        if pooling is not None:  # a bad pooling mode fails the load, not every request
            pool(np.zeros((1, 1, 1), np.float32), np.ones((1, 1), np.int64), pooling)
        function = SCORE_FUNCTION.read(self.params, None)
        if function is not None:  # so does a bad score function
            class_scores(np.zeros((1, 1)), function)

    def run(self, inputs):
        return self.head(inputs, self.params)

    def _respond(self, request):
        """The response to one request: its outputs, or an error for it alone (inputs that do
        not fit together, such as offsets for fewer tokens than the logits, are an error)."""
        try:
            missing = [n for n in self.input_names if pb_utils.get_input_tensor_by_name(request, n) is None]
            if missing:
                return self._error(INVALID_INPUT, f"input {', '.join(missing)} is missing")
            inputs = {name: pb_utils.get_input_tensor_by_name(request, name).as_numpy() for name in self.input_names}
            with np.errstate(all="ignore"):  # non-finite logits give non-finite scores, not a failure
                outputs = self.run(_fit_to_sequence(inputs))
        except Exception as exc:  # noqa: BLE001 - reported to the request's sender
            return self._error(INFERENCE_FAILED, f"{self.task} post-processing failed for this request: "
                                                 f"{type(exc).__name__}: {exc}")
        return pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor(name, value) for name, value in outputs.items()])

    @staticmethod
    def _error(code, message):
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(mark(code, message)))

    def execute(self, requests):
        return [self._respond(request) for request in requests]
