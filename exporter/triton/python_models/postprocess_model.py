"""Triton python model: encoder outputs -> the task's answer.

The ``task`` parameter picks one of the functions below; each takes the
request's input arrays and returns its output arrays.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils
from encoding import l2_normalize, pool
from heads import answer_spans, class_scores, entities, sigmoid


#: Token-aligned inputs: the tokenizer pads them to a fixed width, while the encoder's
#: per-token outputs come back cut to the batch's longest real token.
_TOKEN_ALIGNED = ("attention_mask", "offsets", "context_mask")
_PER_TOKEN = ("last_hidden_state", "start_logits", "logits")


def _fit_to_sequence(x):
    """``x`` with its token-aligned inputs cut to the per-token output's length (only
    padding is cut: the encoder's output covers every real token)."""
    per_token = next((x[n] for n in _PER_TOKEN if n in x and x[n].ndim >= 2 + (n == "logits")), None)
    if per_token is None:
        return x
    length = per_token.shape[1]
    return {n: (v[:, :length] if n in _TOKEN_ALIGNED else v) for n, v in x.items()}


def _json_strings(items):
    return np.array([json.dumps(item).encode("utf-8") for item in items], dtype=object)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.params = params
        self.task = params["task"]
        self.input_names = [i["name"] for i in config["input"]]
        self.id2label = json.loads(params.get("id2label", "{}"))
        if self.task == "embedding":
            pool(np.zeros((1, 1, 1), np.float32), np.ones((1, 1), np.int64), params["pooling"])  # bad mode fails load
        self.run = getattr(self, "_" + self.task.replace("-", "_"))

    def _embedding(self, x):
        vectors = pool(x["last_hidden_state"], x["attention_mask"], self.params["pooling"])
        if self.params.get("normalize") == "true":
            vectors = l2_normalize(vectors)
        return {"EMBEDDING": vectors.astype(np.float32)}

    def _classification(self, x):
        scores = class_scores(x["logits"].astype(np.float64), self.params.get("multi_label") == "true")
        return {"SCORES": scores.astype(np.float32)}

    def _rerank(self, x):
        return {"SCORES": sigmoid(x["logits"].astype(np.float64)[:, 0]).astype(np.float32)}

    def _token_classification(self, x):
        texts = [t.decode("utf-8", "replace") for t in x["TEXT"].reshape(-1)]
        found = [entities(text, x["logits"][i], x["offsets"][i], x["attention_mask"][i], self.id2label)
                 for i, text in enumerate(texts)]
        return {"ENTITIES": _json_strings(found).reshape(-1, 1)}

    def _question_answering(self, x):
        context = x["CONTEXT"].reshape(-1)[0].decode("utf-8", "replace")
        spans = answer_spans(context, x["start_logits"], x["end_logits"], x["offsets"], x["context_mask"],
                             int(self.params.get("top_k", "20")))
        return {"ANSWERS": _json_strings([spans])}

    def _respond(self, request):
        """The response to one request: its outputs, or an error for it alone (inputs that do
        not fit together, such as offsets for fewer tokens than the logits, are an error)."""
        try:
            missing = [n for n in self.input_names if pb_utils.get_input_tensor_by_name(request, n) is None]
            if missing:
                raise ValueError(f"input {', '.join(missing)} is missing")
            inputs = {name: pb_utils.get_input_tensor_by_name(request, name).as_numpy() for name in self.input_names}
            with np.errstate(all="ignore"):  # non-finite logits give non-finite scores, not a failure
                outputs = self.run(_fit_to_sequence(inputs))
        except Exception as exc:  # noqa: BLE001 - reported to the request's sender
            message = f"{self.task} post-processing failed for this request: {type(exc).__name__}: {exc}"
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(message))
        return pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor(name, value) for name, value in outputs.items()])

    def execute(self, requests):
        return [self._respond(request) for request in requests]
