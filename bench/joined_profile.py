"""The joined model's ``execute`` in this process, without Triton: each step's time on one execution, so that
what the served path adds to the graph's own parts (bench/gpu_check.py's ``graph in process, by part``) can be
told from the hops around it.  The python backend's ``triton_python_backend_utils`` is stood in for by the
few calls the steps make.

    python -m nexus_sli.bench.joined_profile REPOSITORY MODEL [--rows 256] [--requests 1] [--kind CPU] [--profile]

``--kind GPU`` opens the encoder on the GPU, as a ``KIND_GPU`` instance does; ``--profile`` adds cProfile's
top functions.  On the stack ceiling's free model (``bench/.stack/repo-0``, ``stack_free``) the encoder's run
costs almost nothing, so the rest is what shows.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import json
import pstats
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np


class Tensor:
    """A tensor as the python backend's steps read one: its name and its array."""

    __slots__ = ("_array", "_name")

    def __init__(self, name, array):
        self._name, self._array = name, array

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array


class _Response:
    def __init__(self, output_tensors=None, error=None):
        self._tensors, self._error = list(output_tensors or []), error

    def output_tensors(self):
        return self._tensors

    def has_error(self):
        return self._error is not None

    def error(self):
        return self._error


class TextRequest:
    """The parts of ``pb_utils.InferenceRequest`` a text step reads: ``TEXT`` (strings, or bytes as sent),
    the request's parameters and the outputs it names."""

    def __init__(self, texts, outputs=(), **parameters):
        self.texts, self._outputs, self._parameters = list(texts), list(outputs), json.dumps(parameters)
        self._inputs = [Tensor("TEXT", np.array([[t if isinstance(t, bytes) else t.encode()] for t in self.texts],
                                                dtype=object))]

    def inputs(self):
        return self._inputs

    def parameters(self):
        return self._parameters

    def requested_output_names(self):
        return self._outputs


def _stand_in() -> None:
    module = types.ModuleType("triton_python_backend_utils")
    module.Tensor, module.InferenceResponse, module.TritonError = Tensor, _Response, RuntimeError
    module.get_input_tensor_by_name = lambda request, name: next(
        (t for t in request.inputs() if t.name() == name), None)
    sys.modules["triton_python_backend_utils"] = module


class JoinedModel:
    """The joined model of ``model`` in ``repository`` (as ``nexus-sli serve`` writes it), initialized here
    on an instance of ``kind``, each step's ``execute`` timed where the joined model calls it."""

    def __init__(self, repository: Path, model: str, kind: str = "CPU"):
        _stand_in()
        from nexus_sli.exporter.serving.backend_folders import prepare_backends
        from nexus_sli.exporter.serving.joined_steps import join, triton_json
        from nexus_sli.exporter.triton import config as tc

        shadow = join(repository, prepare_backends(Path(tempfile.mkdtemp(prefix="nexus-sli-joined-profile-"))))
        if shadow is None:
            raise SystemExit(f"{repository} has no ensemble nexus-sli serve joins")
        folder = shadow / model
        spec = importlib.util.spec_from_file_location("nexus_sli_joined_profile", folder / "1" / "model.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        self.model = module.TritonPythonModel()
        self.model.initialize({"model_config": json.dumps(triton_json(tc.read(folder / "config.pbtxt"))),
                               "model_repository": str(folder), "model_instance_kind": kind})
        from nexus_sli.tasks.model_parameters import JOINED_SCHEDULE, strings

        names = [step["model_name"] for step in JOINED_SCHEDULE.read(strings(triton_json(tc.read(
            folder / "config.pbtxt"))))]
        self.times: dict[str, list[float]] = {}
        for name, step in zip(names, self.model.steps):
            self.times[name] = []
            step.model.execute = self._timed(step.model.execute, self.times[name])

    @staticmethod
    def _timed(execute, times: list[float]):
        def timed(requests):
            began = time.perf_counter()
            try:
                return execute(requests)
            finally:
                times.append((time.perf_counter() - began) * 1e3)

        return timed

    def medians(self, calls: list[list[str]], executions: int = 50, warm: int = 5) -> dict:
        """Milliseconds of one execution of ``calls`` (one request each), and of each step in it: medians of
        ``executions`` after ``warm``."""
        requests = [TextRequest(texts) for texts in calls]
        for times in self.times.values():
            times.clear()
        whole = []
        for repetition in range(warm + executions):
            began = time.perf_counter()
            self.model.execute(requests)
            whole.append((time.perf_counter() - began) * 1e3)
        return {"execute": round(float(np.median(whole[warm:])), 3),
                **{name: round(float(np.median(times[warm:])), 3) for name, times in self.times.items()}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("repository", type=Path)
    parser.add_argument("model")
    parser.add_argument("--rows", type=int, default=256, help="short texts in the execution")
    parser.add_argument("--requests", type=int, default=1, help="the requests they are split into")
    parser.add_argument("--kind", default="CPU", choices=("CPU", "GPU"))
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    from nexus_sli.bench.gpu_paths import Texts, step_tokenizer

    joined = JoinedModel(args.repository, args.model, args.kind)
    texts = Texts(step_tokenizer(args.repository, args.model, truncate=False)[1])
    calls = texts.batches("short", args.rows // args.requests, args.requests)
    print(json.dumps({"rows": sum(map(len, calls)), "requests": len(calls), "ms": joined.medians(calls)}))
    if args.profile:
        profile = cProfile.Profile()
        profile.runcall(joined.medians, calls, 50, 0)
        pstats.Stats(profile).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
