"""Triton python model: an ensemble's steps run in turn in this one process (``nexus-sli serve``).

:mod:`nexus_sli.exporter.serving.joined_steps` writes this file as the model of
an exported ensemble, with the ensemble's name, inputs, outputs and
parameters, and its steps' schedule.  It loads each step's own code, as Triton
would (the exported tokenizer and post-processing ``model.py`` files, the
encoder shim of the backend folder), and for each execution hands every step
all the requests still going, with the tensors the ensemble would map to it:

- a step's error answers that request alone, as Triton's ensemble answers it,
  and the request goes no further;
- each request is answered the outputs it asks for (all where it names none).

A request its client cancels (gRPC) while it waits in the queue is dropped
there by Triton, as an ensemble's would be; once in an execution it runs to
the end, where Triton's ensemble would drop it before its next step: asking
whether a request was cancelled is a round trip to the server, which would
cost every short query more than what it could save
(bench/data/tried.md, "The ensemble's steps joined in one process").

Not copied beside the steps: it runs only where nexus-sli is installed.
"""

import importlib.util
import json
import sys
from pathlib import Path

import triton_python_backend_utils as pb_utils
from nexus_sli.exporter.serving.joined_steps import step_sources
from nexus_sli.tasks.model_parameters import JOINED_BACKENDS, JOINED_SCHEDULE, strings


class _StepRequest:
    """What a step reads of a request: its inputs, the request's parameters, the outputs asked of it."""

    __slots__ = ("_inputs", "_outputs", "_parameters")

    def __init__(self, inputs, parameters, outputs):
        self._inputs, self._parameters, self._outputs = inputs, parameters, outputs

    def inputs(self):
        return self._inputs

    def parameters(self):
        return self._parameters

    def requested_output_names(self):
        return self._outputs


def _named(name, tensor):
    """``tensor`` under ``name`` (itself where it has that name)."""
    return tensor if tensor.name() == name else pb_utils.Tensor(name, tensor.as_numpy())


def _load(name, code):
    """The module ``code`` (a step's ``model.py``) with the helpers beside it (encoding, batching, error_codes
    ...), as Triton loads it in a process of its own: each step imports its own folder's copies, which are
    then taken out of ``sys.modules`` so that the next step's are not mistaken for them."""
    folder = str(code.parent)
    known = set(sys.modules)
    sys.path.insert(0, folder)
    try:
        spec = importlib.util.spec_from_file_location(name, code)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    finally:
        while folder in sys.path:  # the encoder shims put their folder on the path themselves
            sys.path.remove(folder)
        for helper in set(sys.modules) - known - {name}:
            if str(Path(getattr(sys.modules[helper], "__file__", None) or "/").parent) == folder:
                del sys.modules[helper]
    return module


class _Step:
    def __init__(self, number, source):
        self.model = _load(f"joined_step_{number}", source["code"]).TritonPythonModel()
        self.model.initialize(source["args"])
        self.input_map, self.output_map = source["input_map"], source["output_map"]
        self.asked = list(self.output_map)

    def requests(self, values, parameters):
        inputs = [_named(name, values[tensor]) for name, tensor in self.input_map.items() if tensor in values]
        return _StepRequest(inputs, parameters, self.asked)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = strings(config)
        repository = Path(args["model_repository"]).parent
        sources = step_sources(repository, JOINED_SCHEDULE.read(params), Path(JOINED_BACKENDS.read(params)),
                               args.get("model_instance_kind", "CPU"), args.get("model_instance_device_id", "0"))
        self.steps = [_Step(number, source) for number, source in enumerate(sources)]
        self.outputs = [output["name"] for output in config["output"]]

    def execute(self, requests):
        values = [{tensor.name(): tensor for tensor in request.inputs()} for request in requests]
        errors = {}
        for step in self.steps:
            going = [n for n in range(len(requests)) if n not in errors]
            if not going:
                break
            answers = step.model.execute([step.requests(values[n], requests[n].parameters()) for n in going])
            for n, answer in zip(going, answers):
                if answer.has_error():
                    errors[n] = answer.error()
                    continue
                for tensor in answer.output_tensors():
                    if tensor.name() in step.output_map:
                        values[n][step.output_map[tensor.name()]] = tensor
        return [pb_utils.InferenceResponse(error=errors[n]) if n in errors else self._answer(request, values[n])
                for n, request in enumerate(requests)]

    def _answer(self, request, values):
        asked = set(request.requested_output_names()) or set(self.outputs)
        return pb_utils.InferenceResponse(
            output_tensors=[_named(name, values[name]) for name in self.outputs if name in asked and name in values])

    def finalize(self):
        for step in self.steps:
            if hasattr(step.model, "finalize"):
                step.model.finalize()
