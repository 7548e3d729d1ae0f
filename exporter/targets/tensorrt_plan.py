"""TensorRT plans (``platform: "tensorrt_plan"``): built on the GPU host from the exported fp16 ONNX graph.

A plan is an engine compiled for one GPU (compute capability) and one TensorRT
version, so it cannot be made at export time on a machine without them:
``nexus-sli export --target gpu`` writes the fp16 ONNX graph, and ``nexus-sli
build-plan`` (:mod:`nexus_sli.exporter.export.build_plan`) compiles it where
it will be served.  This module holds what needs TensorRT itself: the build
(optimization profile over batch and sequence, FP16 with the normalisation
layers and rotary tables constrained to fp32), the engine runner that validation and ``nexus-sli
validate`` use, and the GPU's name and compute capability.

Nothing here that imports ``tensorrt`` or the CUDA runtime is exercised by the
tests, which run without a GPU or TensorRT (TensorRT does not install from
PyPI); docs/gpu.md says so.  The pure parts (layer selection, I/O type
checks, the error without TensorRT) are tested.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nexus_sli.exporter.errors import GPURuntimeUnavailableError, NexusError, PlanBuildError
from nexus_sli.exporter.export.fp16 import FP32_OPS, rotary_nodes
from nexus_sli.exporter.export.pooling import PREFIX as POOLING_PREFIX
from nexus_sli.exporter.triton.config import EncoderServing

from .base import Candidate, ExportedGraph, Target

#: Where to run build-plan when TensorRT is missing: the same TensorRT as the Triton that serves the plan.
WHERE_TO_RUN = (
    "run nexus-sli build-plan on the GPU host that will serve the plan, with the TensorRT version of "
    "its Triton: inside the NGC Triton container (nvcr.io/nvidia/tritonserver:<YY.MM>-py3) with the "
    "tensorrt wheel of the version it ships, or in nvcr.io/nvidia/tensorrt:<the same YY.MM>-py3 "
    "(docs/gpu.md, \"TensorRT plans\")")

#: How each op the fp16 graph keeps in fp32 (:data:`fp16.FP32_OPS`) appears in a TensorRT network:
#: (layer type, the layer's operation or None).  Those layers are constrained to fp32 too.
FP32_LAYERS: dict[str, tuple[str, str | None]] = {
    "LayerNormalization": ("NORMALIZATION", None),
    "Softmax": ("SOFTMAX", None),
    "ReduceMean": ("REDUCE", "AVG"),
    "Pow": ("ELEMENTWISE", "POW"),
    "Sqrt": ("UNARY", "SQRT"),
}
#: ONNX Runtime's fused ops: only its transformer optimizer emits them, and the GPU graph is the
#: plain export (TensorRT's ONNX parser does not read ``com.microsoft`` ops).
FUSED_ONLY = frozenset(FP32_OPS) - set(FP32_LAYERS)
#: The subclass TensorRT's Python API needs to read a layer's operation.
_LAYER_CLASSES = {"ELEMENTWISE": "IElementWiseLayer", "UNARY": "IUnaryLayer", "REDUCE": "IReduceLayer"}
#: The builder's scratch memory (the ONNX Runtime accelerator's ``max_workspace_size_bytes`` too).
WORKSPACE_BYTES = 1 << 30
#: TensorRT's data type names (``trt.DataType``) -> Triton's config types.
TRITON_TYPES = {"FLOAT": "TYPE_FP32", "HALF": "TYPE_FP16", "INT32": "TYPE_INT32", "INT64": "TYPE_INT64",
                "INT8": "TYPE_INT8", "BOOL": "TYPE_BOOL", "BF16": "TYPE_BF16", "UINT8": "TYPE_UINT8"}


def wants_fp32(layer_type: str, operation: str | None, name: str = "", nodes: frozenset[str] = frozenset()) -> bool:
    """Whether a TensorRT layer (type, operation and layer name) computes one of :data:`FP32_OPS`, or
    belongs to an embedding graph's pooling (:mod:`export.pooling`) or to ``nodes`` (the rotary tables':
    :func:`fp16.rotary_nodes`), which the fp16 graph keeps in fp32 too.  TensorRT's ONNX parser names a
    layer after the node it came from, with or without a prefix of its own (``node_of_...``), so the
    pooling's node prefix is looked for anywhere in the name and a node's name at its end; not exercised
    by the tests (module docstring)."""
    if POOLING_PREFIX in name or any(name.endswith(node) for node in nodes):
        return True
    return any(layer_type == kind and (op is None or op == operation) for kind, op in FP32_LAYERS.values())


def plan_filename(capability: str) -> str:
    """``model.sm86.plan`` for compute capability ``8.6``: one file per GPU architecture."""
    return f"model.sm{capability.replace('.', '')}.plan"


def import_tensorrt():
    """The ``tensorrt`` module, or a :class:`GPURuntimeUnavailableError` saying where to run instead."""
    try:
        import tensorrt
    except ImportError as exc:
        raise GPURuntimeUnavailableError(f"TensorRT's Python package cannot be imported here ({exc}); "
                                         f"{WHERE_TO_RUN}") from exc
    return tensorrt


def io_type_mismatches(expected: dict[str, str], engine: dict[str, str]) -> list[str]:
    """Tensors whose Triton type in the config (``expected``) differs from the engine's, or that one lacks.

    The tokenizer sends int64 ids: an engine whose inputs became int32 (TensorRT before 10 casts
    int64 down) would be refused by Triton, so the build refuses it first."""
    problems = [f"{name}: the config says {kind}, the engine {engine.get(name, 'has no such tensor')}"
                for name, kind in expected.items() if engine.get(name) != kind]
    return problems + [f"{name}: the engine has it, the config does not" for name in engine if name not in expected]


@dataclass(frozen=True)
class GPU:
    """The device a plan is built for: TensorRT engines run only on its compute capability."""

    name: str
    major: int
    minor: int

    @property
    def capability(self) -> str:
        """``"8.6"``: the form Triton's ``cc_model_filenames`` keys take."""
        return f"{self.major}.{self.minor}"


class CudaRuntime:
    """The few CUDA runtime calls an engine run needs, through ctypes (no PyTorch or pycuda on the
    serving host).  Any runtime version will do beside TensorRT's own: both work in the driver's
    primary context of the device, where device pointers are shared."""

    LIBRARIES = ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0")
    HOST_TO_DEVICE, DEVICE_TO_HOST = 1, 2
    #: cudaDevAttrComputeCapabilityMajor / Minor
    CC_MAJOR, CC_MINOR = 75, 76

    def __init__(self):
        for name in filter(None, (ctypes.util.find_library("cudart"), *self.LIBRARIES)):
            try:
                self.lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        else:
            raise GPURuntimeUnavailableError(f"the CUDA runtime (libcudart) cannot be loaded here; {WHERE_TO_RUN}")
        self.lib.cudaGetErrorString.restype = ctypes.c_char_p
        count = ctypes.c_int(0)
        status = self.lib.cudaGetDeviceCount(ctypes.byref(count))
        if status != 0 or count.value < 1:
            raise GPURuntimeUnavailableError(f"no CUDA GPU is usable here ({self._error(status)}); {WHERE_TO_RUN}")

    def _error(self, status: int) -> str:
        return f"CUDA error {status}: {self.lib.cudaGetErrorString(status).decode()}"

    def _check(self, status: int, call: str) -> None:
        if status != 0:
            raise NexusError(f"{call} failed with {self._error(status)}")

    def device(self, index: int = 0) -> GPU:
        values = [ctypes.c_int(), ctypes.c_int()]
        for value, attribute in zip(values, (self.CC_MAJOR, self.CC_MINOR)):
            self._check(self.lib.cudaDeviceGetAttribute(ctypes.byref(value), attribute, index),
                        "cudaDeviceGetAttribute")
        # cudaDeviceProp starts with char name[256]; the buffer is larger than the struct in any CUDA
        properties = ctypes.create_string_buffer(8192)
        get = getattr(self.lib, "cudaGetDeviceProperties_v2", None) or self.lib.cudaGetDeviceProperties
        self._check(get(properties, index), "cudaGetDeviceProperties")
        return GPU(properties.raw[:256].split(b"\0", 1)[0].decode(), values[0].value, values[1].value)

    def malloc(self, size: int) -> int:
        pointer = ctypes.c_void_p()
        self._check(self.lib.cudaMalloc(ctypes.byref(pointer), ctypes.c_size_t(max(size, 1))), "cudaMalloc")
        return pointer.value

    def free(self, pointer: int) -> None:
        self.lib.cudaFree(ctypes.c_void_p(pointer))

    def copy(self, destination: int, source: int, size: int, kind: int) -> None:
        self._check(self.lib.cudaMemcpy(ctypes.c_void_p(destination), ctypes.c_void_p(source),
                                        ctypes.c_size_t(size), ctypes.c_int(kind)), "cudaMemcpy")

    def synchronize(self) -> None:
        self._check(self.lib.cudaDeviceSynchronize(), "cudaDeviceSynchronize")


def _layer_operation(trt, layer) -> str | None:
    kind = layer.type.name
    if kind not in _LAYER_CLASSES:
        return None
    layer.__class__ = getattr(trt, _LAYER_CLASSES[kind])  # TensorRT's Python API downcasts this way
    return layer.op.name


def constrain_fp32(trt, network, nodes: frozenset[str] = frozenset()) -> int:
    """Pin every layer that computes one of :data:`FP32_OPS`, or comes from one of ``nodes``, to fp32
    (precision and outputs); the builder obeys it under ``OBEY_PRECISION_CONSTRAINTS``.  Returns how many
    were pinned."""
    pinned = 0
    floating = (trt.float32, trt.float16)
    for index in range(network.num_layers):
        layer = network.get_layer(index)
        # integer arithmetic on shapes (a Pow of sizes) has no precision to keep
        computes_floats = layer.num_outputs and layer.get_output(0).dtype in floating
        if computes_floats and wants_fp32(layer.type.name, _layer_operation(trt, layer), layer.name, nodes):
            layer.precision = trt.float32
            for output in range(layer.num_outputs):
                layer.set_output_type(output, trt.float32)
            pinned += 1
    return pinned


def build_engine(trt, onnx_path: Path, input_names: list[str], dims: dict[str, tuple[int, int]],
                 workspace: int = WORKSPACE_BYTES) -> tuple[bytes, int]:
    """A serialized FP16 engine of ``onnx_path`` with one optimization profile over (batch, sequence)
    from ``dims`` (:func:`triton.config.profile_dims`), and how many layers were pinned to fp32."""
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    # TensorRT 10 networks are explicit-batch only (the flag is gone); before 10 it must be asked for
    explicit = getattr(trt.NetworkDefinitionCreationFlag, "EXPLICIT_BATCH", None)
    network = builder.create_network(0 if explicit is None or int(trt.__version__.split(".")[0]) >= 10
                                     else 1 << int(explicit))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise PlanBuildError(f"TensorRT could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace)
    config.set_flag(trt.BuilderFlag.FP16)
    config.set_flag(trt.BuilderFlag.OBEY_PRECISION_CONSTRAINTS)
    profile = builder.create_optimization_profile()
    for name in input_names:
        profile.set_shape(name, dims["min"], dims["opt"], dims["max"])
    config.add_optimization_profile(profile)
    pinned = constrain_fp32(trt, network, frozenset(rotary_nodes(onnx_path)))
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise PlanBuildError(f"TensorRT could not build an engine from {onnx_path} (its log above says why)")
    return bytes(serialized), pinned


@dataclass(frozen=True)
class _Tensor:
    name: str


class EngineRunner:
    """A TensorRT engine with the session interface validation uses (``get_inputs``, ``get_outputs``,
    ``run(None, feeds)``), on GPU 0; outputs come back as numpy arrays in the engine's order."""

    def __init__(self, trt, plan: bytes):
        self.trt, self.cuda = trt, CudaRuntime()
        self.engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(plan)
        if self.engine is None:
            raise PlanBuildError("TensorRT could not load the plan: it was built for another GPU or TensorRT "
                                 "version (build it again here with nexus-sli build-plan)")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        is_input = {n: self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT for n in names}
        self.input_names = [n for n in names if is_input[n]]
        self.output_names = [n for n in names if not is_input[n]]

    def io_types(self) -> dict[str, str]:
        """Each I/O tensor's Triton type name (``TYPE_INT64``, ...)."""
        return {name: TRITON_TYPES.get(self.engine.get_tensor_dtype(name).name, "unknown")
                for name in (*self.input_names, *self.output_names)}

    def get_inputs(self) -> list[_Tensor]:
        return [_Tensor(n) for n in self.input_names]

    def get_outputs(self) -> list[_Tensor]:
        return [_Tensor(n) for n in self.output_names]

    def _profile(self, name: str) -> str:
        """``min .. max`` shapes of profile 0 for input ``name``."""
        try:
            low, _, high = self.engine.get_tensor_profile_shape(name, 0)
            return f"{tuple(low)} .. {tuple(high)}"
        except Exception:  # noqa: BLE001 - only for the message
            return "(unreadable)"

    def _dtype(self, name: str):
        return np.dtype(self.trt.nptype(self.engine.get_tensor_dtype(name)))

    def run(self, _names, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        device: list[int] = []
        try:
            for name in self.input_names:
                host = np.ascontiguousarray(feeds[name], dtype=self._dtype(name))
                # TensorRT 10 returns False (it does not raise) for a shape outside the engine's profile
                if not self.context.set_input_shape(name, host.shape):
                    raise PlanBuildError(f"input {name} of shape {tuple(host.shape)} is outside the plan's "
                                         f"optimization profile {self._profile(name)}")
                device.append(self.cuda.malloc(host.nbytes))
                self.cuda.copy(device[-1], host.ctypes.data, host.nbytes, CudaRuntime.HOST_TO_DEVICE)
                self.context.set_tensor_address(name, device[-1])
            outputs = []
            for name in self.output_names:
                outputs.append(np.empty(tuple(self.context.get_tensor_shape(name)), dtype=self._dtype(name)))
                device.append(self.cuda.malloc(outputs[-1].nbytes))
                self.context.set_tensor_address(name, device[-1])
            if not self.context.execute_async_v3(0):
                raise NexusError("TensorRT failed to run the engine")
            self.cuda.synchronize()
            for host, pointer in zip(outputs, device[len(self.input_names):]):
                self.cuda.copy(host.ctypes.data, pointer, host.nbytes, CudaRuntime.DEVICE_TO_HOST)
            return [o.astype(np.float32) if o.dtype == np.float16 else o for o in outputs]
        finally:
            for pointer in device:
                self.cuda.free(pointer)


class TensorRTPlan(Target):
    """A TensorRT engine served by Triton's TensorRT backend, ``KIND_GPU``.  Registered so that
    ``nexus-sli validate`` finds the runner for a plan; an export cannot offer one (see the module)."""

    name = "tensorrt-plan"
    precisions = ("fp16",)
    device = "gpu"
    trims_padding = False
    validated_on = "TensorRT on the GPU named in the record (nexus-sli build-plan)"
    not_exported = ("a TensorRT plan is built on the GPU host that serves it: export with --target gpu and --backend "
                    "auto (or onnxruntime-tensorrt), then run nexus-sli build-plan there (docs/gpu.md)")

    def candidates(self, graph: ExportedGraph, precision: str) -> list[Candidate]:
        raise NexusError(self.not_exported)

    def open(self, path: Path, parameters: dict[str, str]) -> EngineRunner:
        """The plan for this GPU's compute capability where the folder has one (what Triton picks through
        ``cc_model_filenames``), else ``path`` (the config's default)."""
        trt = import_tensorrt()
        own = Path(path).with_name(plan_filename(CudaRuntime().device().capability))
        return EngineRunner(trt, (own if own.is_file() else Path(path)).read_bytes())

    def serving(self, precision: str) -> EncoderServing:
        return EncoderServing(platform="tensorrt_plan", device="KIND_GPU")
