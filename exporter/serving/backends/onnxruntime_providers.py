"""ONNX Runtime execution providers from a Triton model config, as the native backend chooses them.

One home for the choice: the ``onnxruntime`` backend shim opens served models
with it, and it is tested here over configs as JSON.  A ``KIND_GPU`` instance
gets the config's GPU execution accelerators in order (``tensorrt`` with its
parameters mapped to ONNX Runtime's TensorRT provider options, ``cuda``), then
the CUDA provider, then the CPU provider, each only where this onnxruntime has
it (``onnxruntime-gpu``); every provider left out is said, so a GPU model that
ends up on the CPU is never silent.  Copied beside the shim: imports nothing
but the standard library.
"""

import contextlib
import io

TENSORRT = "TensorrtExecutionProvider"
CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"

#: Triton accelerator name -> ONNX Runtime provider.
ACCELERATOR_PROVIDERS = {"tensorrt": TENSORRT, "cuda": CUDA}
#: Triton's TensorRT accelerator keys whose ONNX Runtime option has another name (the onnxruntime_backend
#: README's table; ``precision_mode`` is mapped by value in :func:`tensorrt_options`).
TENSORRT_RENAMED = {"max_workspace_size_bytes": "trt_max_workspace_size",
                    "int8_calibration_table_name": "trt_int8_calibration_table_name",
                    "int8_use_native_calibration_table": "trt_int8_use_native_calibration_table"}
#: Triton's TensorRT accelerator keys passed to ONNX Runtime under the same name.
TENSORRT_SAME = frozenset({
    "trt_max_partition_iterations", "trt_min_subgraph_size", "trt_dla_enable", "trt_dla_core",
    "trt_engine_cache_enable", "trt_engine_cache_path", "trt_engine_cache_prefix", "trt_dump_subgraphs",
    "trt_force_sequential_engine_build", "trt_context_memory_sharing_enable", "trt_layer_norm_fp32_fallback",
    "trt_timing_cache_enable", "trt_timing_cache_path", "trt_force_timing_cache", "trt_detailed_build_log",
    "trt_build_heuristics_enable", "trt_sparsity_enable", "trt_builder_optimization_level",
    "trt_auxiliary_streams", "trt_tactic_sources", "trt_extra_plugin_lib_paths", "trt_profile_min_shapes",
    "trt_profile_max_shapes", "trt_profile_opt_shapes", "trt_cuda_graph_enable", "trt_dump_ep_context_model",
    "trt_ep_context_file_path", "trt_ep_context_embed_mode"})
#: ``precision_mode`` values -> the ONNX Runtime switch they turn on (FP32: neither).
PRECISION_MODES = {"FP32": None, "FP16": "trt_fp16_enable", "INT8": "trt_int8_enable"}
#: Triton's CUDA accelerator keys, passed under the same name.
CUDA_SAME = frozenset({"cudnn_conv_use_max_workspace", "use_ep_level_unified_stream"})


def load_gpu_libraries(ort) -> list[str]:
    """Make CUDA and cuDNN loadable before a GPU session opens, and say what could not be loaded.

    The GPU providers open CUDA's libraries by name, so those of pip's ``nvidia-*`` packages
    (onnxruntime-gpu's ``cuda`` and ``cudnn`` extras) are found only once ``preload_dlls`` has
    loaded them; without them the session silently runs on the CPU.  ``ort`` is the onnxruntime
    module; nothing happens where it has no GPU provider or no ``preload_dlls``."""
    preload = getattr(ort, "preload_dlls", None)
    if preload is None or not {CUDA, TENSORRT} & set(ort.get_available_providers()):
        return []
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # it reports each library it could not load on stdout
        preload()
    return [f"loading CUDA libraries: {line.strip()}" for line in printed.getvalue().splitlines() if line.strip()]


def instance_kind(config: dict) -> str:
    """``KIND_GPU`` when any instance group asks for a GPU, else ``KIND_CPU`` (Triton's default for
    ONNX models where GPUs exist is GPU, but these repositories always name the kind)."""
    kinds = {group.get("kind", "KIND_AUTO") for group in config.get("instance_group", [])}
    return "KIND_GPU" if "KIND_GPU" in kinds else "KIND_CPU"


def accelerators(config: dict) -> list[tuple[str, dict]]:
    """The config's GPU execution accelerators, (name, parameters), in order."""
    found = config.get("optimization", {}).get("execution_accelerators", {}).get("gpu_execution_accelerator", [])
    return [(entry.get("name", ""), dict(entry.get("parameters", {}))) for entry in found]


def tensorrt_options(parameters: dict, device_id: int) -> tuple[dict, list[str]]:
    """ONNX Runtime's TensorRT provider options for Triton's accelerator ``parameters``, and what was left out."""
    options, dropped = {"device_id": str(device_id)}, []
    for key, value in parameters.items():
        if key == "precision_mode" and value.upper() in PRECISION_MODES:
            switch = PRECISION_MODES[value.upper()]
            if switch:
                options[switch] = "1"
        elif key in TENSORRT_RENAMED:
            options[TENSORRT_RENAMED[key]] = value
        elif key in TENSORRT_SAME:
            options[key] = value
        else:
            dropped.append(f"{key}={value}")
    return options, dropped


def cuda_options(parameters: dict, device_id: int) -> tuple[dict, list[str]]:
    options = {"device_id": str(device_id), **{k: v for k, v in parameters.items() if k in CUDA_SAME}}
    return options, [f"{k}={v}" for k, v in parameters.items() if k not in CUDA_SAME]


def choose_providers(config: dict, available: list[str], device_id: int = 0) -> tuple[list, list[str]]:
    """(providers for ``onnxruntime.InferenceSession``, what to log) for a model config as JSON.

    ``KIND_GPU``: the accelerators in the config's order, then CUDA, then the CPU, each only where
    ``available`` (``onnxruntime.get_available_providers()``) has it; ``KIND_CPU``: the CPU only."""
    kind = instance_kind(config)
    if kind != "KIND_GPU":
        return [CPU], [f"instance kind {kind}: {CPU}"]
    wanted, notes = [], []
    for name, parameters in accelerators(config):
        if name not in ACCELERATOR_PROVIDERS:
            notes.append(f"accelerator {name!r} is not one ONNX Runtime has; ignored")
            continue
        mapping = tensorrt_options if name == "tensorrt" else cuda_options
        options, dropped = mapping(parameters, device_id)
        if dropped:
            notes.append(f"{name} accelerator parameters ONNX Runtime does not read, ignored: {', '.join(dropped)}")
        wanted.append((ACCELERATOR_PROVIDERS[name], options))
    if CUDA not in (provider for provider, _ in wanted):
        wanted.append((CUDA, {"device_id": str(device_id)}))
    chosen = [(provider, options) for provider, options in wanted if provider in available]
    missing = [provider for provider, _ in wanted if provider not in available]
    if missing:
        notes.append(f"KIND_GPU, but this onnxruntime lacks {', '.join(missing)} (available: {', '.join(available)}; "
                     "the GPU providers come with onnxruntime-gpu, docs/gpu.md)")
    if not chosen:
        notes.append(f"falling back to {CPU}: this GPU model runs on the CPU")
    providers = [*chosen, CPU]
    notes.append(f"instance kind {kind}: {', '.join(p if isinstance(p, str) else p[0] for p in providers)}")
    return providers, notes
