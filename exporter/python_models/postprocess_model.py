"""Triton python model: token states -> sentence embedding (pooling, L2 normalisation)."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils
from encoding import l2_normalize, pool


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.pooling = params["pooling"]
        self.normalize = params.get("normalize", "false") == "true"
        pool(np.zeros((1, 1, 1), np.float32), np.ones((1, 1), np.int64), self.pooling)  # unknown mode fails load

    def execute(self, requests):
        responses = []
        for request in requests:
            hidden = pb_utils.get_input_tensor_by_name(request, "last_hidden_state").as_numpy()
            mask = pb_utils.get_input_tensor_by_name(request, "attention_mask").as_numpy()
            vectors = pool(hidden, mask, self.pooling)
            if self.normalize:
                vectors = l2_normalize(vectors)
            out = pb_utils.Tensor("EMBEDDING", vectors.astype(np.float32))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
        return responses
