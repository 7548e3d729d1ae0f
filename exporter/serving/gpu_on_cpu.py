"""Serving a GPU repository on a machine without a GPU: only when asked, and said aloud.

Triton refuses a model whose instance group is ``KIND_GPU`` where no GPU is
visible.  To try a GPU export on a CPU machine, ``nexus-sli serve
--gpu-models-on-cpu`` serves a shadow of the repository: a temporary folder of
links to the repository's files in which only the GPU models' configs are
rewritten (``KIND_CPU``, the GPU execution accelerators dropped), each rewrite
logged.  The repository on disk keeps ``KIND_GPU``; the fp16 graph then runs on
ONNX Runtime's CPU provider.
"""

from __future__ import annotations

import logging
from pathlib import Path

from nexus_sli.exporter.errors import NexusError
from nexus_sli.exporter.triton import config as tc

from . import temporary_folders

log = logging.getLogger(__name__)

GPU = tc.pb.ModelInstanceGroup.KIND_GPU


def gpu_visible() -> bool:
    """Whether an NVIDIA GPU device node exists here (what Triton's CUDA runtime would open)."""
    return any(Path("/dev").glob("nvidia[0-9]*"))


def gpu_models(repository: Path) -> list[str]:
    """The models of ``repository`` whose config asks for a GPU instance."""
    return sorted(path.parent.name for path in Path(repository).glob("*/config.pbtxt")
                  if any(group.kind == GPU for group in tc.read(path).instance_group))


def servable(repository: Path, gpu_on_cpu: bool) -> Path | None:
    """A shadow repository with the GPU models moved to the CPU, None where none is needed;
    a clear error for GPU models on a machine without a GPU unless ``gpu_on_cpu``."""
    models = gpu_models(repository)
    if not models or gpu_visible():
        return None
    if not gpu_on_cpu:
        raise NexusError(f"{', '.join(models)} ask for a GPU (KIND_GPU) and this machine has none; serve them "
                         "on a GPU host, or pass --gpu-models-on-cpu to try them here on the CPU")
    plans = [m for m in models if tc.read(Path(repository) / m / "config.pbtxt").platform == "tensorrt_plan"]
    if plans:  # Triton would fail to load them, and exit, without a TensorRT backend
        raise NexusError(f"{', '.join(plans)}: a TensorRT plan runs on a GPU only, and --gpu-models-on-cpu moves "
                         "ONNX graphs to the CPU; serve it on a GPU host, or export the model again (its fp16 "
                         "ONNX graph) to try it here")
    return _shadow(Path(repository), models)


def _shadow(repository: Path, models: list[str]) -> Path:
    shadow = temporary_folders.make(temporary_folders.GPU_ON_CPU_PREFIX)
    for model in (p for p in repository.iterdir() if p.is_dir()):
        (shadow / model.name).mkdir()
        for entry in model.iterdir():
            if entry.name != "config.pbtxt" or model.name not in models:
                (shadow / model.name / entry.name).symlink_to(entry.resolve())
    for name in models:
        config = tc.read(repository / name / "config.pbtxt")
        for group in config.instance_group:
            group.kind = tc.pb.ModelInstanceGroup.KIND_CPU
        config.optimization.execution_accelerators.ClearField("gpu_execution_accelerator")
        tc.write(config, shadow / name)
        log.warning("serving %s on the CPU as asked (--gpu-models-on-cpu): KIND_GPU -> KIND_CPU, GPU "
                    "accelerators dropped, in %s; %s is unchanged", name, shadow, repository / name / "config.pbtxt")
    return shadow
