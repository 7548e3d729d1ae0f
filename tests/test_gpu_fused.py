"""The GPU check's fused-graph lever (bench/gpu_fused.py): the CUDA target's export with ONNX Runtime's fused graph
in fp16 validates against PyTorch as every export does (on ONNX Runtime's CPU provider here: the fp16 weights and
the graph, not fp16 arithmetic), runs far fewer operators than the exported plain graph, is served with the same
config, and leaves the registry's CUDA target as it was."""

from __future__ import annotations

from nexus_sli.bench.gpu_fused import FusedCUDA, export_fused, operators
from nexus_sli.exporter.export.pipeline import ExportOptions, run_export
from nexus_sli.exporter.targets import TARGETS
from nexus_sli.exporter.targets.onnxruntime_gpu import OnnxRuntimeCUDA
from nexus_sli.exporter.triton import config as tc


def test_the_fused_gpu_export_validates_with_a_fraction_of_the_operators(tiny_checkpoint, tmp_path):
    model = str(tiny_checkpoint("bert"))
    fused = export_fused(tmp_path / "fused", model=model, name="tiny")
    assert type(TARGETS["onnxruntime-cuda"]) is OnnxRuntimeCUDA  # the registry's entry is back
    plain = run_export(ExportOptions(model=model, name="tiny", device="gpu", backend="onnxruntime-cuda",
                                     precision="fp16", out=tmp_path / "plain"))
    assert (fused.report.graph, plain.report.graph) == ("fused-fp16", "plain-fp16")
    for result in (fused, plain):
        assert result.report.validation.passed and result.report.validation.cosine_min >= 0.9999
    found = {name: operators(tmp_path / name / "tiny_encoder" / "1" / "model.onnx") for name in ("fused", "plain")}
    layers = 2  # the tiny bert's
    assert found["fused"]["Attention"] == layers and found["fused"]["EmbedLayerNormalization"] == 1
    assert "Attention" not in found["plain"] and "Softmax" in found["plain"]
    assert sum(found["fused"].values()) * 4 < sum(found["plain"].values())
    configs = {name: tc.read(tmp_path / name / "tiny_encoder" / "config.pbtxt") for name in ("fused", "plain")}
    assert configs["fused"] == configs["plain"]  # served alike: only the graph differs


def test_the_fused_target_is_the_cuda_target_but_for_its_candidates():
    assert issubclass(FusedCUDA, OnnxRuntimeCUDA) and FusedCUDA.name == OnnxRuntimeCUDA.name
    assert FusedCUDA().serving("fp16") == OnnxRuntimeCUDA().serving("fp16")
