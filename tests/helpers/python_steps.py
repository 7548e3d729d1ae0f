"""An exported python step (its ``model.py`` and the helpers beside it) loaded as Triton's python backend loads
it, in the test's process: the wheel's ``triton_python_backend_utils`` on the path, its C++ side (tensors,
responses) replaced by plain records.  Requests: bench/joined_profile.py's ``TextRequest``."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

from nexus_sli.exporter.serving.binary import pytriton_root

#: What a repository's python step imports from its own folder, and Triton's module beside it.
REPOSITORY_MODULES = ("encoding", "sides", "error_codes", "model_parameters", "triton_python_backend_utils")


def load_step(monkeypatch, version: Path, name: str, config: dict, repository: Path):
    """The step in ``version`` (a model's version folder), initialized with ``config`` (its Triton config as
    JSON).  Each response is a record: ``.tensors`` (name -> array) and ``.error``.  Call :func:`unload`
    after the test, so that the next one imports its own folder's helpers."""
    for module in REPOSITORY_MODULES:  # this repository's copies, not another test's
        monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.syspath_prepend(str(pytriton_root() / "backends" / "python"))
    monkeypatch.syspath_prepend(str(version))
    spec = importlib.util.spec_from_file_location(name, version / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for attribute, record in (("Tensor", lambda n, a: SimpleNamespace(name=n, array=a)),
                              ("InferenceResponse", lambda output_tensors=None, error=None:
                               SimpleNamespace(tensors={t.name: t.array for t in output_tensors or []}, error=error)),
                              ("TritonError", str)):
        monkeypatch.setattr(module.pb_utils, attribute, record, raising=False)
    step = module.TritonPythonModel()
    step.initialize({"model_config": json.dumps(config), "model_repository": str(repository),
                     "model_version": version.name})
    return step


def unload() -> None:
    for module in REPOSITORY_MODULES:
        sys.modules.pop(module, None)
