"""The registered runtime targets, and the configurations ``auto`` measures.

Adding a runtime is one module with a :class:`Target` subclass, registered
below; ``auto`` measures it only where :data:`AUTO_CONFIGURATIONS` names it.
"""

from __future__ import annotations

from dataclasses import dataclass

from nexus_sli.exporter.errors import NexusError

from .base import Target
from .cpu import cpu_flags
from .onnxruntime_cpu import OnnxRuntimeCPU
from .onnxruntime_gpu import OnnxRuntimeCUDA, OnnxRuntimeTensorRT
from .openvino_cpu import OpenVINOCPU
from .tensorrt_plan import TensorRTPlan

#: backend or precision: let the registry choose (:func:`configurations_for`).
AUTO = "auto"

TARGETS: dict[str, Target] = {}


def register(target: Target) -> Target:
    """Add ``target`` under its name; a second target of the same name is an error, never skipped."""
    if target.name in TARGETS:
        raise ValueError(f"runtime target {target.name!r} is registered twice")
    TARGETS[target.name] = target
    return target


register(OnnxRuntimeCPU())
register(OpenVINOCPU())
register(OnnxRuntimeTensorRT())
register(OnnxRuntimeCUDA())
# built on the GPU host by nexus-sli build-plan, never by an export; registered for nexus-sli validate
register(TensorRTPlan())

#: Where an export's encoder will run (``--target``); ``auto`` chooses among that device's targets.
DEVICES = ("cpu", "gpu")

#: What ``auto`` measures on each device: every configuration this machine can
#: run is validated against PyTorch (held to :data:`validate.AUTO_BAR` whatever
#: its precision), each that passes is timed on the bench's workload
#: (:mod:`export.timing`), and the fastest is exported.  A CPU flag only prunes
#: what cannot run as asked (bf16 without bf16 matmuls, :meth:`Target.suits`);
#: which configuration is fastest is measured, never assumed: it differs between
#: CPUs of one family (docs/export.md, "Choosing a backend").  ONNX Runtime fp32,
#: which every supported family exports at exact parity, runs everywhere, so
#: ``auto`` always has an answer.
AUTO_CONFIGURATIONS: dict[str, tuple[tuple[str, str], ...]] = {
    "cpu": (("onnxruntime", "fp32"), ("onnxruntime", "int8"), ("openvino", "fp32"), ("openvino", "bf16"),
            ("openvino", "int8")),
    # On GPUs: the fp16 graph with TensorRT (``--accelerator cuda`` names the CUDA target instead).
    # The exporter cannot time a GPU graph on the machine that exports it, so this is one entry.
    "gpu": (("onnxruntime-tensorrt", "fp16"),),
}


@dataclass(frozen=True)
class Configuration:
    """One (target, precision) an export validates and times, and why it is on the list."""

    target: Target
    precision: str
    reason: str
    #: chosen by ``auto`` rather than asked for by name: held to ``validate.AUTO_BAR``
    auto: bool = False

    def describe(self) -> str:
        return f"{self.target.name} {self.precision}"


def precisions() -> tuple[str, ...]:
    return tuple(dict.fromkeys(p for t in TARGETS.values() for p in t.precisions))


def get_target(name: str) -> Target:
    if name not in TARGETS:
        raise NexusError(f"unknown backend {name!r}; choose one of {', '.join([AUTO, *TARGETS])}")
    return TARGETS[name]


def serving_target(platform: str, backend: str, device: str = "KIND_CPU") -> Target:
    """The first registered target whose encoder configs say this platform or backend and
    instance kind (the GPU targets differ only in their accelerator and open graphs alike)."""
    for target in TARGETS.values():
        serving = target.serving(target.precisions[0])
        if (serving.platform, serving.backend, serving.device) == (platform, backend, device):
            return target
    raise NexusError(f"no runtime target serves platform {platform!r} / backend {backend!r}; "
                     f"registered: {', '.join(TARGETS)}")


def configurations_for(backend: str, precision: str, flags: set[str] | None = None,
                       device: str = "cpu") -> list[Configuration]:
    """The configurations to measure for a requested backend and precision (either may be
    ``auto``) on ``device``: ``auto`` never leaves the device asked for."""
    flags = cpu_flags() if flags is None else flags
    if precision != AUTO and precision not in precisions():
        raise NexusError(f"unknown precision {precision!r}; choose one of {', '.join([AUTO, *precisions()])}")
    if device not in DEVICES:
        raise NexusError(f"unknown target {device!r}; choose one of {', '.join(DEVICES)}")
    if backend != AUTO and get_target(backend).device != device:
        on = [name for name, target in TARGETS.items() if target.device == device]
        raise NexusError(f"backend {backend!r} runs on {get_target(backend).device}, not on the {device} this export "
                         f"is for (--target); on {device}: {', '.join([AUTO, *on])}")
    if backend != AUTO and get_target(backend).not_exported:  # before the walk, which would be for nothing
        raise NexusError(get_target(backend).not_exported)
    if backend != AUTO and precision != AUTO:
        target = get_target(backend)
        target.check(precision)
        return [Configuration(target, target.runnable(precision, flags), "as requested")]
    listed = AUTO_CONFIGURATIONS[device] if backend == AUTO else AUTO_CONFIGURATIONS[get_target(backend).device]
    measured = [Configuration(TARGETS[name], p, f"auto on {device}: runs on this machine; measured", precision == AUTO)
                for name, p in listed
                if backend in (AUTO, name) and precision in (AUTO, p) and TARGETS[name].suits(p, flags)]
    return measured or [_first_offering(backend, precision, flags, device)]


def _first_offering(backend: str, precision: str, flags: set[str], device: str) -> Configuration:
    """A named backend with its preferred precision, or the device's first target serving a named precision."""
    if backend != AUTO:
        target = get_target(backend)
        return Configuration(target, target.precisions[0], f"{backend}'s preferred precision")
    serving = [t for t in TARGETS.values() if precision in t.precisions and t.device == device]
    if not serving:
        offered = sorted({p for t in TARGETS.values() if t.device == device for p in t.precisions})
        raise NexusError(f"no {device} target serves precision {precision!r}; on {device}: {', '.join(offered)}")
    target = serving[0]
    return Configuration(target, target.runnable(precision, flags), f"the first backend serving {precision}")
