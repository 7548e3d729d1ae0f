"""Triton python model: raw strings -> the encoder's token tensors.

Modes (the ``mode`` parameter):
- ``single``: ``TEXT`` (one string per batch item); dynamically batched.
- ``pair``: ``QUERY`` (one string) and ``DOCUMENTS`` (N strings) -> N (query, document) rows.
- ``qa``: ``QUESTION`` and ``CONTEXT`` -> one row per overlapping window of the context.

All rows of one execute() call are padded to one length, a power of two, so
the encoder's dynamic batcher can merge requests: Triton batches only equal shapes.
"""

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
from encoding import TextTooLongError, check_lengths, load_tokenizer, padded_length, to_arrays, windows


def _strings(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        raise ValueError(f"input {name} is missing")
    texts = []
    for index, item in enumerate(tensor.as_numpy().reshape(-1)):
        try:
            texts.append(item.decode("utf-8") if isinstance(item, bytes) else str(item))
        except UnicodeDecodeError as exc:
            raise ValueError(f"{name} item {index} is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    return texts


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        here = Path(args["model_repository"]) / args["model_version"]
        self.mode = params.get("mode", "single")
        self.max_length = int(params["max_length"])
        self.truncate = params.get("truncate", "true") == "true"
        self.pad_id = int(params["pad_id"])
        self.min_bucket = int(params.get("min_padded_length", "1"))
        strategy = "only_second" if self.mode == "qa" else "longest_first"
        self.tokenizer = load_tokenizer(str(here / "tokenizer.json"), self.max_length,
                                        self.truncate or self.mode == "qa", int(params.get("stride", "0")), strategy)
        self.output_names = [output["name"] for output in config["output"]]

    def _encodings(self, request):
        if self.mode == "qa":
            question, context = _strings(request, "QUESTION"), _strings(request, "CONTEXT")
            if len(question) != 1 or len(context) != 1:
                raise ValueError("send exactly one QUESTION and one CONTEXT per request")
            if not context[0].strip():
                raise ValueError("CONTEXT is empty: there is nothing to find an answer in")
            return windows(self.tokenizer, question[0], context[0])
        if self.mode == "pair":
            query, documents = _strings(request, "QUERY"), _strings(request, "DOCUMENTS")
            if len(query) != 1:
                raise ValueError("send exactly one QUERY per request")
            if not documents:
                raise ValueError("DOCUMENTS is empty: nothing to rerank")
            encodings = self.tokenizer.encode_batch([(query[0], d) for d in documents])
        else:
            encodings = self.tokenizer.encode_batch(_strings(request, "TEXT"))
        if not self.truncate:
            check_lengths(encodings, self.max_length)
        return encodings

    def execute(self, requests):
        encoded, errors = {}, {}
        for number, request in enumerate(requests):
            try:
                encoded[number] = self._encodings(request)
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
