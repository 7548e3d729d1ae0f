"""The ``onnxruntime`` backend shim's providers: the config's instance kind and accelerators, as Triton's
native ONNX Runtime backend reads them, each provider only where this onnxruntime has it, every fallback said.

The configs are the ones the GPU targets write, turned into the JSON Triton hands a
python-backend model; the last test opens a real session with the chosen providers.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from google.protobuf import json_format
from onnx import TensorProto, helper

from nexus_sli.exporter.serving.backends import onnxruntime_providers as providers
from nexus_sli.exporter.targets import TARGETS
from nexus_sli.exporter.triton import config as tc

CPU, CUDA, TRT = providers.CPU, providers.CUDA, providers.TENSORRT
INPUTS = ["input_ids", "attention_mask"]


def _config_json(target: str) -> dict:
    """The encoder config a target writes, as the python backend receives it (``args["model_config"]``)."""
    serving = TARGETS[target].serving(TARGETS[target].precisions[0])
    config = tc.encoder_config("e", tc.layout("embedding", INPUTS, 8, 0), INPUTS, serving, max_length=256)
    return json_format.MessageToDict(config, preserving_proto_field_name=True)


def test_the_mapping_covers_exactly_the_keys_triton_accepts():
    # one home for the keys (triton.config.ACCELERATOR_KEYS, from the onnxruntime_backend README): none unmapped
    mapped = providers.TENSORRT_SAME | set(providers.TENSORRT_RENAMED) | {"precision_mode"}
    assert mapped == tc.ACCELERATOR_KEYS["tensorrt"]
    assert providers.CUDA_SAME == tc.ACCELERATOR_KEYS["cuda"]


def test_tensorrt_then_cuda_then_cpu_where_onnxruntime_gpu_has_them():
    chosen, notes = providers.choose_providers(_config_json("onnxruntime-tensorrt"), [TRT, CUDA, CPU], device_id=1)
    assert [p if isinstance(p, str) else p[0] for p in chosen] == [TRT, CUDA, CPU]
    trt_options = chosen[0][1]
    assert trt_options["trt_fp16_enable"] == "1" and trt_options["device_id"] == "1"
    assert trt_options["trt_max_workspace_size"] == str(1 << 30)
    assert trt_options["trt_engine_cache_enable"] == "1" and trt_options["trt_engine_cache_path"]
    rows = tc.GPU_MAX_BATCH_SIZE  # the profile follows the rows an execution merges
    assert trt_options["trt_profile_max_shapes"] == f"input_ids:{rows}x256,attention_mask:{rows}x256"
    assert "precision_mode" not in trt_options and "max_workspace_size_bytes" not in trt_options
    assert chosen[1] == (CUDA, {"device_id": "1"})
    assert notes == [f"instance kind KIND_GPU: {TRT}, {CUDA}, {CPU}"]


def test_a_gpu_model_on_cpu_only_onnxruntime_falls_back_and_says_so():
    chosen, notes = providers.choose_providers(_config_json("onnxruntime-tensorrt"), [CPU])
    assert chosen == [CPU]
    assert any(f"lacks {TRT}, {CUDA}" in note and "onnxruntime-gpu" in note for note in notes)
    assert any("falling back to CPUExecutionProvider" in note for note in notes)


def test_without_tensorrt_the_cuda_provider_runs_it():
    chosen, notes = providers.choose_providers(_config_json("onnxruntime-tensorrt"), [CUDA, CPU])
    assert [p if isinstance(p, str) else p[0] for p in chosen] == [CUDA, CPU]
    assert any(f"lacks {TRT}" in note for note in notes)


def test_the_cuda_accelerator_and_the_cpu_kind():
    chosen, _ = providers.choose_providers(_config_json("onnxruntime-cuda"), [TRT, CUDA, CPU])
    assert chosen == [(CUDA, {"device_id": "0"}), CPU]  # TensorRT only when the config names it
    assert providers.choose_providers(_config_json("onnxruntime"), [TRT, CUDA, CPU]) == (
        [CPU], [f"instance kind KIND_CPU: {CPU}"])


def test_unknown_accelerators_and_keys_are_named_not_passed():
    config = _config_json("onnxruntime-tensorrt")
    accelerator = config["optimization"]["execution_accelerators"]["gpu_execution_accelerator"]
    accelerator[0]["parameters"]["precison_mode"] = "FP16"
    accelerator.append({"name": "openvino"})
    chosen, notes = providers.choose_providers(config, [TRT, CUDA, CPU])
    assert "precison_mode" not in chosen[0][1]
    assert any("precison_mode=FP16" in note for note in notes)
    assert any("'openvino' is not one ONNX Runtime has" in note for note in notes)


@pytest.fixture()
def tiny_graph(tmp_path):
    node = helper.make_node("Cast", ["input_ids"], ["out"], to=TensorProto.FLOAT)
    graph = helper.make_graph([node], "g",
                              [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [None, None])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [None, None])])
    path = tmp_path / "g.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


@pytest.mark.skipif(CUDA in ort.get_available_providers(), reason="onnxruntime-gpu is installed here")
def test_cpu_onnxruntime_opens_a_gpu_model_on_the_cpu_provider(tiny_graph):
    # this project's machines: the CPU build of onnxruntime, as nexus-sli serve --gpu-models-on-cpu runs it
    chosen, _ = providers.choose_providers(_config_json("onnxruntime-tensorrt"), ort.get_available_providers())
    session = ort.InferenceSession(str(tiny_graph), providers=chosen)
    ids = np.arange(6, dtype=np.int64).reshape(2, 3)
    assert np.array_equal(session.run(None, {"input_ids": ids})[0], ids.astype(np.float32))
    assert session.get_providers() == [CPU]


class _OnnxRuntimeGPU:
    """What ``load_gpu_libraries`` reads of onnxruntime-gpu: its providers and ``preload_dlls``, which
    reports a library it cannot load on stdout (as onnxruntime-gpu does where CUDA is missing)."""

    def __init__(self, providers: list[str]):
        self.providers, self.preloaded = providers, 0

    def get_available_providers(self) -> list[str]:
        return self.providers

    def preload_dlls(self) -> None:
        self.preloaded += 1
        print("Failed to load libcublasLt.so.13: cannot open shared object file")


def test_cuda_libraries_are_preloaded_for_gpu_providers_and_failures_are_said():
    gpu = _OnnxRuntimeGPU([TRT, CUDA, CPU])
    assert providers.load_gpu_libraries(gpu) == [
        "loading CUDA libraries: Failed to load libcublasLt.so.13: cannot open shared object file"]
    assert gpu.preloaded == 1


def test_nothing_is_preloaded_without_a_gpu_provider():
    cpu_only = _OnnxRuntimeGPU([CPU])
    assert providers.load_gpu_libraries(cpu_only) == [] and cpu_only.preloaded == 0
    assert providers.load_gpu_libraries(ort) == []  # this machine's onnxruntime: the CPU build
