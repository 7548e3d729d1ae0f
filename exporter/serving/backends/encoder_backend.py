"""What the Python-based encoder backends (``onnxruntime``, ``openvino``) share.

A subclass loads its model (:meth:`EncoderBackend.load`) and runs one batch
of arrays (:meth:`EncoderBackend.infer`); this class turns Triton's requests
into batches and the batches' outputs back into responses:

- every row of every request in the execution is grouped at once
  (:mod:`batching`): sorted by real length and run in groups, each cut to its
  own longest real token, so the fixed-width padding the tokenizer adds
  (one width, so Triton merges every request) is never computed;
- a row's real length ends at its last attended position, or, in a
  late-interaction graph, its last scored one (``score_mask``: a query's
  expansion is scored where the encoder does not attend to it), as the graph's
  own padding trim cuts;
- outputs that follow the sequence come back at the execution's longest real
  length, exactly what the exported graph's padding trim gives the native
  backends of an NGC container, so the post-processing sees one behaviour;
  outputs that do not (an embedding graph's pooled ``[batch, hidden]``) come
  back one row per text, each from the group it ran in;
- only the outputs the execution's requests ask for are computed and returned
  (the union of their ``requested_output_names``, each request answered with its
  own): an embedding graph's token states, which only its ``NAME_tokens``
  ensemble asks for, cost nothing on embedding requests;
- when the joint run fails, each request runs alone, so only a bad request
  (token ids outside the vocabulary, inputs that do not fit together) gets an
  error, and it names the reason.
"""

import json
from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
from batching import GPU_RUN_COST_TOKENS, RUN_COST_TOKENS, length_groups, real_lengths
from error_codes import INFERENCE_FAILED, INVALID_INPUT, mark
from onnxruntime_providers import instance_kind

#: A late-interaction graph's scoring mask input (``python_models/sides.py``'s ``SCORE_MASK``, not copied here).
SCORE_MASK = "score_mask"


def _widened(array, width):
    """``array`` padded with zeros to ``width`` columns (itself where it has them: numpy's pad costs more
    than the encoder's other work on a short query)."""
    return array if array.shape[1] == width else np.pad(array, ((0, 0), (0, width - array.shape[1])))


def _joined(arrays):
    """The requests' rows as one array (the one request's own where there is one)."""
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


class EncoderBackend(ABC):
    #: The model file when the config names none (``default_model_filename``).
    default_filename = "model.onnx"
    #: The ids ``input_ids`` may hold, where a subclass must check them itself (its runtime does not fail them)
    vocab_size = None

    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        filename = config.get("default_model_filename") or self.default_filename
        self.load(Path(args["model_repository"]) / args["model_version"] / filename, params)
        self.inputs = [i["name"] for i in config["input"]]
        # Outputs whose first non-batch dim is variable follow the sequence length.
        self.outputs = {o["name"]: o["dims"][0] == -1 for o in config["output"]}
        self.dims = {o["name"]: [max(int(d), 0) for d in o["dims"]] for o in config["output"]}
        # a GPU runs a batch's rows side by side: only much longer rows are worth a run of their own
        self.run_cost_tokens = GPU_RUN_COST_TOKENS if instance_kind(config) == "KIND_GPU" else RUN_COST_TOKENS

    @abstractmethod
    def load(self, path: Path, params: dict) -> None:
        """Open the model at ``path`` with the config's ``parameters``."""

    @abstractmethod
    def infer(self, feeds: dict, names: list) -> dict:
        """The outputs ``names`` (some of the config's) by name, for one batch of int64 arrays ``[rows, length]``."""

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
        rows, length = next(iter(shapes.values()))
        if rows and not length:  # a row runs at least one token (its real length counts from 1)
            raise ValueError(f"inputs must hold at least one token per row; got {shapes}")
        ids = feeds.get("input_ids")
        if ids is not None and ids.size and ids.min() < 0:  # a runtime's Gather would read it from the end
            raise ValueError(f"input_ids holds a negative token id ({int(ids.min())}): ids count from 0")
        if ids is not None and ids.size and self.vocab_size is not None and ids.max() >= self.vocab_size:
            raise ValueError(f"input_ids holds token id {int(ids.max())}, outside the vocabulary's "
                             f"{self.vocab_size} ids")
        return feeds

    def _wanted(self, request):
        """The outputs ``request`` asks for, in the config's order (all of them where it names none)."""
        asked = set(request.requested_output_names()) if hasattr(request, "requested_output_names") else set()
        return [name for name in self.outputs if name in asked] or list(self.outputs)

    def _run(self, per_request, wanted):
        """All requests' rows, run in length groups, computing the outputs in ``wanted`` (one list per
        request): each request's own outputs, in order."""
        if not any(len(feeds[self.inputs[0]]) for feeds in per_request):  # no row to run: empty answers
            return [{name: np.zeros((0, *self.dims[name]), np.float32) for name in asked} for asked in wanted]
        names = [name for name in self.outputs if any(name in w for w in wanted)]
        width = max(feeds[self.inputs[0]].shape[1] for feeds in per_request)
        batch = {name: _joined([_widened(feeds[name], width) for feeds in per_request]) for name in self.inputs}
        mask = batch.get("attention_mask")
        if mask is not None and SCORE_MASK in batch:
            mask = np.maximum(mask, batch[SCORE_MASK])
        lengths = real_lengths(mask) if mask is not None else np.full(len(batch[self.inputs[0]]), width)
        longest = int(lengths.max())
        results = {}
        for rows in length_groups(lengths, self.run_cost_tokens):
            length = int(lengths[rows].max())
            group = {name: np.ascontiguousarray(array[rows, :length]) for name, array in batch.items()}
            got = self.infer(group, names)
            for name in names:
                value, follows_sequence = got[name], self.outputs[name]
                if name not in results:
                    shape = (len(lengths), longest, *value.shape[2:]) if follows_sequence else (len(lengths), *value.shape[1:])
                    results[name] = np.zeros(shape, dtype=np.float32)
                if follows_sequence:
                    results[name][rows, :value.shape[1]] = value
                else:
                    results[name][rows] = value
        answers, start = [], 0
        for feeds, asked in zip(per_request, wanted):
            size = feeds[self.inputs[0]].shape[0]
            answers.append({name: results[name][start:start + size] for name in asked})
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
                errors[number] = mark(INVALID_INPUT, str(exc))
        wanted = {number: self._wanted(requests[number]) for number in feeds}
        answers = {}
        if feeds:
            try:
                answers = dict(zip(feeds, self._run(list(feeds.values()), list(wanted.values()))))
            except Exception:  # noqa: BLE001 - one bad request (ids out of the vocabulary, ...): find it
                for number, request_feeds in feeds.items():
                    try:
                        answers[number] = self._run([request_feeds], [wanted[number]])[0]
                    except Exception as exc:  # noqa: BLE001 - reported to this request's sender
                        errors[number] = mark(INFERENCE_FAILED,
                                              f"the encoder failed on this request: {type(exc).__name__}: {exc}")
        return [self._response(answers.get(n), errors.get(n)) for n in range(len(requests))]
