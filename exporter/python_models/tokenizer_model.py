"""Triton python model: raw strings -> the encoder's token tensors.

All requests of one execute() call are padded to one length, a power of two, so the
encoder's dynamic batcher can merge them: Triton batches only equal shapes.
"""

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
from encoding import TextTooLongError, check_lengths, load_tokenizer, padded_length, to_arrays


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        here = Path(args["model_repository"]) / args["model_version"]
        self.max_length = int(params["max_length"])
        self.truncate = params.get("truncate", "true") == "true"
        self.pad_id = int(params["pad_id"])
        self.min_bucket = int(params.get("min_padded_length", "1"))
        self.tokenizer = load_tokenizer(str(here / "tokenizer.json"), self.max_length, self.truncate)
        self.output_names = [output["name"] for output in config["output"]]

    def _texts(self, request):
        raw = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy().reshape(-1)
        texts = []
        for index, item in enumerate(raw):
            try:
                texts.append(item.decode("utf-8") if isinstance(item, bytes) else str(item))
            except UnicodeDecodeError as exc:
                raise ValueError(f"text {index} is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
        return texts

    def execute(self, requests):
        encoded, errors = {}, {}
        for number, request in enumerate(requests):
            try:
                encodings = self.tokenizer.encode_batch(self._texts(request))
                if not self.truncate:
                    check_lengths(encodings, self.max_length)
                encoded[number] = encodings
            except (ValueError, TextTooLongError) as exc:
                errors[number] = str(exc)
        longest = max((len(e.ids) for encs in encoded.values() for e in encs), default=1)
        length = padded_length(max(longest, 1), self.min_bucket, self.max_length)
        responses = []
        for number in range(len(requests)):
            if number in errors:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(errors[number])))
                continue
            arrays = to_arrays(encoded[number], self.output_names, self.pad_id, length)
            tensors = [pb_utils.Tensor(name, arrays[name].astype(np.int64)) for name in self.output_names]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses
