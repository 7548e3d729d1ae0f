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

The same graph is what ``nexus-sli build-plan`` compiles into a TensorRT plan on
the GPU host (:mod:`targets.tensorrt_plan`).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from nexus_sli.exporter.export.candidate_cache import graph_digest
from nexus_sli.exporter.export.fp16 import convert_fp16
from nexus_sli.exporter.serving.backends.onnxruntime_providers import choose_providers, load_gpu_libraries
from nexus_sli.exporter.triton.config import Accelerator, EncoderServing

from .base import Candidate, ExportedGraph, Target

log = logging.getLogger(__name__)

#: Token widths a GPU batch is padded to (the smallest that fits; capped at the model's limit).
PAD_BUCKETS = (16, 32, 64, 128, 256, 512)
#: Where ONNX Runtime keeps the TensorRT engines it builds on the serving host (so a restart reuses them), a
#: folder per graph below it (:meth:`OnnxRuntimeGPU.serving_graph`)
ENGINE_CACHE = "/tmp/nexus-sli-trt-cache"
#: The accelerator parameter that names it
ENGINE_CACHE_PATH = "trt_engine_cache_path"
#: The hex digits of a graph's digest its engine folder is named by
ENGINE_FOLDER_DIGITS = 16


class OnnxRuntimeGPU(Target):
    """The fp16 graph on Triton's ONNX Runtime backend with one GPU accelerator."""

    precisions = ("fp16",)
    device = "gpu"
    trims_padding = False
    validated_on = ("ONNX Runtime's CPU provider: proves the fp16 weights and the graph, not fp16 arithmetic, "
                    "which happens only on a GPU (docs/gpu.md)")
    accelerator: Accelerator

    def candidates(self, graph: ExportedGraph, precision: str) -> list[Candidate]:
        # an embedding graph's pooling goes after the conversion: fp32 on the fp32 token states it returns
        fp16 = convert_fp16(graph.plain, graph.work / "plain.fp16.onnx")
        return [Candidate("plain-fp16", graph.pooled_graph(fp16))]

    def open(self, path: Path, parameters: dict[str, str], config: dict | None = None):
        """The graph on the providers its served config gets, with the accelerator's options (TensorRT
        in FP16, then CUDA, then the CPU, each where this onnxruntime has it: onnxruntime-gpu on a GPU
        host), as the backend shim chooses them; elsewhere the CPU provider (see the module docstring).

        ``config``: the encoder's config.pbtxt as JSON (proto field names), as ``nexus-sli validate``
        reads it from the repository, so edited accelerator options (profile shapes, precision, the
        engine cache path) are the ones validated; without it, the config this target writes."""
        import onnxruntime as ort

        if config is None:  # the graph's own engine folder, as its config will name it
            (accelerator,) = self.serving_graph(self.serving(self.precisions[0]), path).accelerators
            config = {"instance_group": [{"kind": "KIND_GPU"}], "optimization": {"execution_accelerators": {
                "gpu_execution_accelerator": [{"name": accelerator.name, "parameters": dict(accelerator.parameters)}]}}}
        notes = load_gpu_libraries(ort)
        providers, chosen = choose_providers(config, ort.get_available_providers())
        log.info("%s on this machine: %s", self.name, "; ".join([*notes, *chosen]))
        options = ort.SessionOptions()
        options.log_severity_level = 3
        return ort.InferenceSession(str(path), options, providers=providers)

    def serving(self, precision: str) -> EncoderServing:
        return EncoderServing(platform="onnxruntime_onnx", device="KIND_GPU", accelerators=(self.accelerator,),
                              pad_widths=PAD_BUCKETS)

    def serving_graph(self, serving: EncoderServing, graph: Path) -> EncoderServing:
        """The engine cache in a folder of this graph's own, named by a digest of its files: ONNX Runtime names
        a cached engine after the graph's structure and names, not its weights, so two exports of one
        architecture on a server, or a re-export of new weights, would otherwise load each other's engines and
        answer with the other model's weights."""
        folder = graph_digest(graph)[:ENGINE_FOLDER_DIGITS]
        return replace(serving, accelerators=tuple(
            replace(a, parameters={**a.parameters, ENGINE_CACHE_PATH: f"{a.parameters[ENGINE_CACHE_PATH]}/{folder}"})
            if ENGINE_CACHE_PATH in a.parameters else a for a in serving.accelerators))


class OnnxRuntimeTensorRT(OnnxRuntimeGPU):
    name = "onnxruntime-tensorrt"
    accelerator = Accelerator("tensorrt", {
        "precision_mode": "FP16", "max_workspace_size_bytes": str(1 << 30),
        "trt_engine_cache_enable": "1", ENGINE_CACHE_PATH: ENGINE_CACHE,
        # TensorRT's own LayerNorm in fp32 too, as the graph keeps it (fp16.FP32_OPS)
        "trt_layer_norm_fp32_fallback": "1",
    })


class OnnxRuntimeCUDA(OnnxRuntimeGPU):
    name = "onnxruntime-cuda"
    accelerator = Accelerator("cuda", {})
