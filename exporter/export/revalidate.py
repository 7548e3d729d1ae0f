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

from google.protobuf import json_format

from nexus_sli.exporter.errors import NexusError, ValidationError
from nexus_sli.exporter.targets import TARGETS, serving_target
from nexus_sli.exporter.targets.onnxruntime_gpu import OnnxRuntimeGPU
from nexus_sli.exporter.triton import config as tc
from nexus_sli.exporter.triton.folders import check_name, newest_version
from nexus_sli.tasks import get_task
from nexus_sli.tasks.model_parameters import message_strings

from . import export_report, stored_reference
from .m3_heads import M3Embedder
from .quantize import scales_per_batch
from .validate import M3_POOLING, compare, embedder_from_report

#: Where each run is recorded, beside the export's own ``validation.json``.
RECORD = "revalidation.json"


def revalidate(repository: Path, name: str) -> dict:
    """Validate ``name``'s encoder again here; record and return the report, or raise ValidationError."""
    folder = Path(repository) / f"{check_name(name)}_encoder"
    if not (folder / "config.pbtxt").is_file():
        raise NexusError(f"{folder} holds no encoder config: is {name!r} a model of {repository}?")
    config = tc.read(folder / "config.pbtxt")
    if not config.instance_group or not export_report.path(folder).is_file():
        raise NexusError(f"{folder} is no encoder an export wrote (no instance group or no "
                         f"{export_report.path(folder).name}): is {name!r} a model of {repository}?")
    target = _serving(config)
    # ONNX Runtime on a GPU: its providers from this config.pbtxt (edited profiles, precision, cache path
    # included), not the ones the target would write
    served = ({"config": json_format.MessageToDict(config, preserving_proto_field_name=True)}
              if isinstance(target, OnnxRuntimeGPU) else {})
    version = newest_version(folder)  # 1 as exported; later where serve's search swapped a faster graph in
    if not version:
        raise NexusError(f"{folder} holds no version folder: is {name!r} a model of {repository}?")
    model_file = folder / str(version) / (config.default_model_filename or "model.onnx")
    runner = target.open(model_file, message_strings(config.parameters), **served)
    report = against_reference(folder, runner, target.name, target.trims_padding, scales_per_batch(model_file))
    record = {**report.to_dict(), "host": platform.node(), "providers": _providers(runner)}
    (folder / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    if not report.passed:
        raise ValidationError(f"{name} does not match PyTorch on this machine: {report.summary()}",
                              report=record, failures=report.failures)
    return record


def _serving(config: tc.pb.ModelConfig):
    """The registered target that writes this config: platform or backend, instance kind, and the GPU
    accelerators (the TensorRT and CUDA targets differ only there, and open the graph with their own)."""
    kind = tc.pb.ModelInstanceGroup.Kind.Name(config.instance_group[0].kind)
    accelerators = [a.name for a in config.optimization.execution_accelerators.gpu_execution_accelerator]
    for target in TARGETS.values():
        serving = target.serving(target.precisions[0])
        if (serving.platform, serving.backend, serving.device, [a.name for a in serving.accelerators]) == (
                config.platform, config.backend, kind, accelerators):
            return target
    return serving_target(config.platform, config.backend, kind)  # the closest, or an error naming the registered


def against_reference(folder: Path, runner, backend: str, trims_padding: bool, per_batch: bool = False):
    """``runner`` (a session-like graph or engine) on the reference stored in the encoder ``folder``,
    held to the export's own thresholds: the check ``validate`` and ``build-plan`` share (``per_batch``:
    the graph quantizes per batch, :func:`validate.compare`)."""
    exported = export_report.read(folder)
    task = get_task(exported.task)
    reference = stored_reference.load(folder, list(exported.inputs), task.output_names())
    embedder = _embedder(folder, exported)
    # exports before pooling moved into the graph read as not pooled: their graph answers token states;
    # pooled exports before the token states were kept have one output
    pooled = task.client_output if exported.pooled_in_graph else None
    kept = task.token_states.name if task.token_states is not None else None
    tokens = kept if pooled and kept in (exported.outputs or []) else None
    return compare(runner, reference, exported.validation.precision, embedder, task, backend,
                   exported.validation.thresholds, trims_padding, pooled, tokens, per_batch)


def _embedder(folder: Path, exported: export_report.ExportReport):
    """How the stored token states become the served outputs: as validation.json records it, or for BGE-M3
    from the heads kept beside the reference (validation.json keeps no weights)."""
    if exported.pooling != M3_POOLING:
        return embedder_from_report(exported)
    arrays = stored_reference.embedder_arrays(folder)
    if not arrays:
        raise NexusError(f"{folder / stored_reference.FILE} keeps no BGE-M3 heads (exported before they were kept "
                         "beside the reference): export the model again to validate it here")
    return M3Embedder.from_stored(arrays, exported.max_length)


def _providers(runner) -> list[str]:
    """The ONNX Runtime providers that ran it (empty for other runtimes)."""
    return list(runner.get_providers()) if hasattr(runner, "get_providers") else []
