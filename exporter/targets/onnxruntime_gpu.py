"""ONNX Runtime on NVIDIA GPUs (``--target gpu``): an fp16 graph, with TensorRT or CUDA.

- ``onnxruntime-tensorrt`` (the GPU default): Triton's ONNX Runtime backend
  runs the fp16 graph through its TensorRT accelerator, FP16, engines cached
  beside the model, optimization profiles from the model's limits.
- ``onnxruntime-cuda``: the same graph on the CUDA execution provider, for
  GPUs or shapes TensorRT rejects.

The graph has no padding trim: its data-dependent Slice may be refused by
TensorRT as a shape tensor.  Instead the tokenizer pads each batch to the
smallest of :data:`PAD_BUCKETS` it fits in, so no short text pays for 512
positions and requests of one bucket still merge.

Validation runs the fp16 graph on ONNX Runtime's CPU provider, which inserts
casts around ops it has no fp16 kernel for: it checks the fp16 weights and the
graph, not fp16 arithmetic, which happens only on a GPU (docs/gpu.md).
"""

from __future__ import annotations

from pathlib import Path

from nexus_sli.exporter.export.fp16 import convert_fp16
from nexus_sli.exporter.export.optimize import session
from nexus_sli.exporter.triton.config import Accelerator, EncoderServing

from .base import Candidate, ExportedGraph, Target

#: Token widths a GPU batch is padded to (the smallest that fits; capped at the model's limit).
PAD_BUCKETS = (16, 32, 64, 128, 256, 512)
#: Where Triton keeps the TensorRT engines it builds, relative to the server's working directory.
ENGINE_CACHE = "/tmp/nexus-sli-trt-cache"


class OnnxRuntimeGPU(Target):
    """The fp16 graph on Triton's ONNX Runtime backend with one GPU accelerator."""

    precisions = ("fp16",)
    device = "gpu"
    trims_padding = False
    validated_on = ("ONNX Runtime's CPU provider: proves the fp16 weights and the graph, not fp16 arithmetic, "
                    "which happens only on a GPU (docs/gpu.md)")
    accelerator: Accelerator

    def candidates(self, graph: ExportedGraph, precision: str) -> list[Candidate]:
        return [Candidate("plain-fp16", convert_fp16(graph.plain, graph.work / "plain.fp16.onnx"))]

    #: ONNX Runtime's providers for this accelerator, used where this onnxruntime has them
    #: (onnxruntime-gpu on a GPU host); elsewhere the CPU provider (see the module docstring)
    providers: tuple[str, ...] = ()

    def open(self, path: Path, parameters: dict[str, str]):
        return session(path, providers=self.providers)

    def serving(self, precision: str) -> EncoderServing:
        return EncoderServing(platform="onnxruntime_onnx", device="KIND_GPU", accelerators=(self.accelerator,),
                              pad_widths=PAD_BUCKETS)


class OnnxRuntimeTensorRT(OnnxRuntimeGPU):
    name = "onnxruntime-tensorrt"
    providers = ("TensorrtExecutionProvider", "CUDAExecutionProvider")
    accelerator = Accelerator("tensorrt", {
        "precision_mode": "FP16", "max_workspace_size_bytes": str(1 << 30),
        "trt_engine_cache_enable": "1", "trt_engine_cache_path": ENGINE_CACHE,
        # TensorRT's own LayerNorm in fp32 too, as the graph keeps it (fp16.FP32_OPS)
        "trt_layer_norm_fp32_fallback": "1",
    })


class OnnxRuntimeCUDA(OnnxRuntimeGPU):
    name = "onnxruntime-cuda"
    providers = ("CUDAExecutionProvider",)
    accelerator = Accelerator("cuda", {})
