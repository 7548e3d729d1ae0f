"""``nexus-sli validate``: an exported model's stored reference through the runtime its config names.

Run on the machine that serves the repository (a GPU host, inside the NGC
container), it proves that what this runtime, on this hardware, computes
matches PyTorch fp32 within the export's thresholds.  It needs numpy and the
runtime, not PyTorch.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

from nexus_sli.exporter.errors import NexusError, ValidationError
from nexus_sli.exporter.targets import serving_target
from nexus_sli.exporter.triton import config as tc
from nexus_sli.tasks import get_task

from . import stored_reference
from .validate import Embedder, compare

#: Where each run is recorded, beside the export's own ``validation.json``.
RECORD = "revalidation.json"


def revalidate(repository: Path, name: str) -> dict:
    """Validate ``name``'s encoder again here; record and return the report, or raise ValidationError."""
    folder = Path(repository) / f"{name}_encoder"
    if not (folder / "config.pbtxt").is_file():
        raise NexusError(f"{folder} holds no encoder config: is {name!r} a model of {repository}?")
    exported = json.loads((folder / "validation.json").read_text())
    config = tc.read(folder / "config.pbtxt")
    target = serving_target(config.platform, config.backend, tc.pb.ModelInstanceGroup.Kind.Name(
        config.instance_group[0].kind))
    runner = target.open(folder / "1" / (config.default_model_filename or "model.onnx"),
                         {k: v.string_value for k, v in config.parameters.items()})
    task = get_task(exported["task"])
    reference = stored_reference.load(folder, list(exported["inputs"]), task.output_names())
    embedder = Embedder(exported["pooling"], exported["normalize"]) if exported["pooling"] else None
    report = compare(runner, reference, exported["precision"], embedder, task, target.name,
                     exported["thresholds"], target.trims_padding)
    record = {**report.to_dict(), "host": platform.node(), "providers": _providers(runner)}
    (folder / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    if not report.passed:
        raise ValidationError(f"{name} does not match PyTorch on this machine: {report.summary()}",
                              report=record, failures=report.failures)
    return record


def _providers(runner) -> list[str]:
    """The ONNX Runtime providers that ran it (empty for other runtimes)."""
    return list(runner.get_providers()) if hasattr(runner, "get_providers") else []
