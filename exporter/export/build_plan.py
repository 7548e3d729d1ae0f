"""``nexus-sli build-plan``: a GPU export's encoder compiled into a TensorRT plan, on the GPU host.

    the fp16 ONNX graph of ``--target gpu`` -> TensorRT engine (FP16, normalisation in fp32,
      one optimization profile over batch and sequence from the config's max_batch_size and
      the model's limit) -> the export's stored PyTorch reference through the engine on this
      GPU -> only if it passes: the plan, validation.json and the config switched to
      ``platform: "tensorrt_plan"``

The switch never leaves a half-switched model: every file is written beside
its destination and renamed into place, the plan first, the config last, so the
config always names a model file that exists and was validated.  The ONNX graph
stays, so building again for another GPU (``cc_model_filenames``) or going
back to ONNX Runtime needs no export.
"""

from __future__ import annotations

import platform
from pathlib import Path

from google.protobuf import text_format

from nexus_sli.exporter.errors import NexusError, PlanBuildError, ValidationError
from nexus_sli.exporter.targets.tensorrt_plan import (
    WORKSPACE_BYTES,
    CudaRuntime,
    EngineRunner,
    TensorRTPlan,
    build_engine,
    import_tensorrt,
    io_type_mismatches,
    plan_filename,
)
from nexus_sli.exporter.triton import config as tc
from nexus_sli.exporter.triton import staging

from . import export_report
from .export_report import ExportReport, PlanRecord
from .revalidate import against_reference

#: The exported graph a plan is built from (the GPU export's model file; it stays after the switch).
ONNX_FILE = "model.onnx"
#: The platforms a GPU export's encoder has before and after a plan was built.
GPU_PLATFORMS = ("onnxruntime_onnx", "tensorrt_plan")


def gpu_export(folder: Path) -> tuple[tc.pb.ModelConfig, ExportReport]:
    """The encoder's config and export report, refusing anything but a GPU export's encoder."""
    if not (folder / "config.pbtxt").is_file():
        raise NexusError(f"{folder} holds no encoder config: is the model name right?")
    if not export_report.path(folder).is_file():
        raise NexusError(f"{export_report.path(folder)} is missing: export the model again with --target gpu")
    config = tc.read(folder / "config.pbtxt")
    exported = export_report.read(folder)
    kinds = {tc.pb.ModelInstanceGroup.Kind.Name(g.kind) for g in config.instance_group}
    if config.platform not in GPU_PLATFORMS or kinds != {"KIND_GPU"} or exported.device != "gpu":
        raise NexusError(f"{folder.name} is not a GPU export (platform {config.platform or config.backend!r}, "
                         f"{', '.join(sorted(kinds))}): export it with --target gpu first")
    if not (folder / "1" / ONNX_FILE).is_file():
        raise NexusError(f"{folder / '1' / ONNX_FILE} is missing: export the model again with --target gpu")
    return config, exported


def io_types(config: tc.pb.ModelConfig) -> dict[str, str]:
    """Each config input's and output's Triton type name, which the engine's must equal."""
    return {t.name: tc.pb.DataType.Name(t.data_type) for t in (*config.input, *config.output)}


def plan_config(config: tc.pb.ModelConfig, plans: dict[str, str], default: str) -> tc.pb.ModelConfig:
    """``config`` switched to the plans (compute capability -> file in the version folder):
    ``tensorrt_plan`` on ``KIND_GPU``, ``default`` as the model file, and ``cc_model_filenames``
    when plans exist for several GPUs; the ONNX Runtime accelerators, which a plan has no use for, dropped."""
    switched = tc.pb.ModelConfig()
    switched.CopyFrom(config)
    switched.platform = TensorRTPlan().serving("fp16").platform
    switched.ClearField("backend")
    switched.optimization.ClearField("execution_accelerators")
    if not switched.optimization.ListFields():
        switched.ClearField("optimization")
    switched.default_model_filename = default
    switched.ClearField("cc_model_filenames")
    if len(plans) > 1:
        switched.cc_model_filenames.update(plans)
    for group in switched.instance_group:
        group.kind = tc.pb.ModelInstanceGroup.KIND_GPU
    return switched


def install(folder: Path, config: tc.pb.ModelConfig, plan: bytes, record: PlanRecord) -> tc.pb.ModelConfig:
    """The validated ``plan`` into ``folder``: the plan, then the config, then validation.json, each renamed
    into place.  A crash at any point leaves a config that names a model file that exists, and
    validation.json never records a plan the config does not serve (a crash between the last two leaves
    the served plan unrecorded: build-plan again records it).  Returns the config now in place."""
    staging.replace_file(folder / "1" / record.file, plan)
    exported = export_report.read(folder)
    exported.tensorrt_plans[record.compute_capability] = record
    plans = {cc: entry.file for cc, entry in sorted(exported.tensorrt_plans.items())
             if (folder / "1" / entry.file).is_file()}
    switched = plan_config(config, plans, record.file)
    staging.replace_file(folder / "config.pbtxt", text_format.MessageToString(switched).encode())
    export_report.replace(exported, folder)
    return switched


def build_plan(repository: Path, name: str, workspace: int = WORKSPACE_BYTES) -> PlanRecord:
    """Build, validate and install ``name``'s plan for this GPU; the record, or ValidationError (nothing
    switched).  Without TensorRT: :class:`GPURuntimeUnavailableError`, saying where to run it."""
    folder = Path(repository) / f"{name}_encoder"
    config, exported = gpu_export(folder)
    trt = import_tensorrt()
    gpu = CudaRuntime().device()
    dims = tc.profile_dims(exported.max_length, config.max_batch_size)
    plan, pinned = build_engine(trt, folder / "1" / ONNX_FILE, list(exported.inputs), dims, workspace)
    runner = EngineRunner(trt, plan)
    mismatches = io_type_mismatches(io_types(config), runner.io_types())
    if mismatches:
        raise PlanBuildError(f"the engine's tensors do not match {name}'s config ({'; '.join(mismatches)}); "
                             "TensorRT 10 or later keeps the int64 inputs the tokenizer sends")
    report = against_reference(folder, runner, TensorRTPlan.name, TensorRTPlan.trims_padding)
    record = PlanRecord(validation=report, file=plan_filename(gpu.capability), tensorrt=trt.__version__,
                        gpu=gpu.name, compute_capability=gpu.capability, host=platform.node(),
                        profile={kind: list(shape) for kind, shape in dims.items()}, fp32_layers=pinned,
                        workspace_bytes=workspace, validated_on=TensorRTPlan.validated_on)
    if not report.passed:
        raise ValidationError(f"the TensorRT plan of {name} does not match PyTorch on {gpu.name}: "
                              f"{report.summary()}; nothing was switched", report=record.to_dict(),
                              failures=report.failures)
    install(folder, config, plan, record)
    return record
