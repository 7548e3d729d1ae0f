"""validation.json through :mod:`export.export_report`: one typed, versioned record, read and written there only."""

from __future__ import annotations

import copy
import json

import pytest

from helpers.reports import FP32, version_1
from nexus_sli.exporter.errors import ExportReportError
from nexus_sli.exporter.export import build_plan as bp
from nexus_sli.exporter.export import export_report
from nexus_sli.exporter.export.export_report import (VERSION, DenseRecord, ExportReport, LayerNormRecord, MeasuredRow,
                                                      PlanRecord, SpladeRecord, Timing)
from nexus_sli.exporter.export.report import FidelityShortfall, UnknownFailure, ValidationReport
from nexus_sli.exporter.triton import config as tc
from nexus_sli.exporter.triton import staging

def _plan(capability: str = "8.6") -> dict:
    """What build-plan records of a plan (its validation beside the plan's facts)."""
    return {**FP32, "precision": "fp16", "backend": "tensorrt-plan",
            "file": f"model.sm{capability.replace('.', '')}.plan",
            "tensorrt": "10.5.0", "gpu": "NVIDIA test GPU", "compute_capability": capability, "host": "gpu-host",
            "profile": {"min": [1, 1], "opt": [16, 128], "max": [64, 256]}, "fp32_layers": 14,
            "workspace_bytes": 1 << 30, "validated_on": "TensorRT on the GPU named in the record"}


def test_a_file_without_a_version_reads_as_version_1_into_typed_records():
    report = ExportReport.from_dict(version_1())
    assert report.version == 1 and report.extra == {}
    assert isinstance(report.validation, ValidationReport) and report.validation.passed
    assert (report.validation.backend, report.validation.precision, report.graph) == ("onnxruntime", "fp32", "plain")
    assert [a.left_out for a in report.attempts] == [None, "no NNCF static one"]
    assert isinstance(report.measured[0], MeasuredRow) and report.measured[2].timings_ms == {}
    assert isinstance(report.timing, Timing) and report.timing.heats[0].rounds == 5
    assert report.walk.skipped == {"unused": ["pooler.dense.weight"]}


def test_a_version_1_file_is_written_back_key_for_key_with_its_version():
    data = version_1()
    written = ExportReport.from_dict(copy.deepcopy(data)).to_dict()
    assert written == {"version": 1, **data} and list(written) == ["version", *data]


def test_a_new_report_round_trips_through_the_file(tmp_path):
    report = ExportReport.from_dict({"version": VERSION, **version_1()})
    report.validation.failures.append(FidelityShortfall("cosine_min 0.97 < 0.98"))
    path = export_report.write(report, tmp_path)
    assert path == tmp_path / "validation.json" and json.loads(path.read_text())["version"] == VERSION
    assert path.read_bytes() == report.encode() and path.read_text().endswith("}\n")
    again = export_report.read(tmp_path)
    assert again == report and again.validation.failures == [FidelityShortfall("cosine_min 0.97 < 0.98")]
    assert again.to_dict()["passed"] is False


def test_what_auto_chose_is_the_kept_row():
    report = ExportReport.from_dict(version_1())
    assert report.chosen == report.measured[0] and report.chosen.graph == "plain"
    assert report.optimize == "balanced"


def test_older_layouts_read_with_the_defaults_the_code_has_always_assumed():
    """Exports before the keys existed: no pooling in the graph (nor ``outputs``), no timing record, no device
    (a CPU export), rows and heats with ``score_ms`` where they now have a score."""
    data = version_1()
    for key in ("pooled_in_graph", "outputs", "timing", "device", "validated_on", "large_model"):
        del data[key]
    for row in data["measured"]:
        row["score_ms"] = row.pop("score")
    report = ExportReport.from_dict(data)
    assert (report.pooled_in_graph, report.outputs, report.timing, report.device) == (False, None, None, "cpu")
    assert report.optimize is None and report.measured[0].score is None
    assert report.measured[0].extra == {"score_ms": 1.0}
    written = report.to_dict()
    assert "outputs" not in written and written["timing"] == {} and written["measured"][0]["score_ms"] == 1.0


#: An embedding pipeline's records as the exports write them: a LayerNorm, a Dense module on the token states
#: (bias-free) and one on the pooled vector with a projected residual; a sparse encoder's SpladePooling.
MODULES = {"layer_norm": {"weight": [1.0, 2.0], "bias": [0.0, -1.0], "eps": 1e-05},
           "dense": [{"weight": [[1.0, 0.0], [0.0, 1.0]], "bias": None, "activation": "Identity",
                      "input": "token_embeddings", "use_residual": False, "residual": None},
                     {"weight": [[0.5, 0.5]], "bias": [0.1], "activation": "Tanh", "input": "sentence_embedding",
                      "use_residual": True, "residual": [[1.0, 1.0]]}]}
SPLADE = {"splade": {"strategy": "max", "activation": "relu"}, "pooling": "splade", "normalize": False}


@pytest.mark.parametrize("records", [MODULES, SPLADE], ids=["sentence", "splade"])
def test_the_pipelines_modules_are_typed_records_written_back_as_read(records):
    data = {**version_1(), **copy.deepcopy(records)}
    report = ExportReport.from_dict(copy.deepcopy(data))
    if "dense" in records:
        assert isinstance(report.layer_norm, LayerNormRecord) and report.layer_norm.eps == 1e-05
        assert [type(module) for module in report.dense] == [DenseRecord, DenseRecord]
        assert (report.dense[0].bias, report.dense[1].input, report.dense[1].residual) == (None,
                                                                                           "sentence_embedding",
                                                                                           [[1.0, 1.0]])
    else:
        assert report.splade == SpladeRecord(strategy="max", activation="relu") and report.dense is None
    assert report.to_dict() == {"version": 1, **data}


def test_a_module_record_without_one_of_its_keys_is_a_clear_error():
    data = {**version_1(), **copy.deepcopy(MODULES)}
    del data["dense"][1]["activation"]
    with pytest.raises(ExportReportError, match=r"ExportReport\.dense\[1\]: no 'activation'"):
        ExportReport.from_dict(data)


def test_keys_a_newer_nexus_sli_wrote_are_kept_and_written_back():
    data = {**version_1(), "version": VERSION + 1, "new_fact": {"x": 1}}
    data["measured"][0]["energy_j"] = 0.5
    data["failures"] = [{"kind": "drift", "message": "a newer check"}]
    data["tensorrt_plans"] = {"8.6": {**_plan(), "sparsity": True}}
    report = ExportReport.from_dict(copy.deepcopy(data))
    assert report.extra == {"new_fact": {"x": 1}} and report.measured[0].extra == {"energy_j": 0.5}
    assert report.validation.failures == [UnknownFailure("a newer check", kind="drift")]
    assert report.tensorrt_plans["8.6"].extra == {"sparsity": True}
    data["passed"] = False  # the failure makes it so
    assert report.to_dict() == data and report.version == VERSION + 1


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("task"), "no 'task'"),
    (lambda d: d.pop("thresholds"), "no 'thresholds'"),
    (lambda d: d["measured"][1].pop("graph"), r"measured\[1\]: no 'graph'"),
    (lambda d: d.update(walk=[]), "walk: expected an object, found list"),
    (lambda d: d.update(attempts={}), "attempts: expected a list, found dict"),
])
def test_a_file_that_is_not_an_export_report_is_a_clear_error(change, message):
    data = version_1()
    change(data)
    with pytest.raises(ExportReportError, match=message):
        ExportReport.from_dict(data)


def test_a_missing_or_broken_file_is_a_clear_error(tmp_path):
    with pytest.raises(ExportReportError, match="validation.json is missing"):
        export_report.read(tmp_path)
    (tmp_path / "validation.json").write_text("{not json")
    with pytest.raises(ExportReportError, match="is not JSON"):
        export_report.read(tmp_path)


def _gpu_encoder(folder, data: dict) -> tc.pb.ModelConfig:
    """An encoder folder as a GPU export leaves it: its config, the ONNX graph, and ``data`` as validation.json."""
    (folder / "1").mkdir(parents=True)
    (folder / "1" / bp.ONNX_FILE).write_bytes(b"graph")
    config = tc.pb.ModelConfig(name=folder.name, platform="onnxruntime_onnx", max_batch_size=64)
    config.instance_group.add(kind=tc.pb.ModelInstanceGroup.KIND_GPU, count=1)
    tc.write(config, folder)
    (folder / "validation.json").write_text(json.dumps(data, indent=2) + "\n")
    return config


def test_build_plan_adds_its_plans_through_the_report_and_keeps_the_rest(tmp_path):
    data = {**version_1(), "device": "gpu", "newer": "kept"}
    folder = tmp_path / "gpu_encoder"
    config = _gpu_encoder(folder, data)
    assert bp.gpu_export(folder)[1] == ExportReport.from_dict(data)
    record = PlanRecord.from_dict(_plan())
    bp.install(folder, config, b"engine", record)
    written = json.loads((folder / "validation.json").read_text())
    assert written == {"version": 1, **data, "tensorrt_plans": {"8.6": _plan()}}
    assert export_report.read(folder).tensorrt_plans == {"8.6": record}
    bp.install(folder, tc.read(folder / "config.pbtxt"), b"engine", PlanRecord.from_dict(_plan("9.0")))
    assert list(export_report.read(folder).tensorrt_plans) == ["8.6", "9.0"]


def test_a_crash_in_build_plans_update_leaves_the_report_as_it_was(tmp_path, monkeypatch):
    folder = tmp_path / "gpu_encoder"
    config = _gpu_encoder(folder, {**version_1(), "device": "gpu"})
    before = (folder / "validation.json").read_bytes()
    real = staging.replace_file

    def crash(path, data):
        if path.name == "validation.json":
            raise OSError("disk full")
        real(path, data)

    monkeypatch.setattr(staging, "replace_file", crash)
    with pytest.raises(OSError):
        bp.install(folder, config, b"engine", PlanRecord.from_dict(_plan()))
    assert (folder / "validation.json").read_bytes() == before


def test_the_record_build_plan_makes_on_the_gpu_host_is_the_one_it_installs(tmp_path, monkeypatch, capsys):
    """TensorRT and the GPU stand in for themselves here (neither can run on these machines): what is checked
    is the record build_plan makes of them, typed, and written into the report by install."""
    from types import SimpleNamespace

    from nexus_sli.cli.main import main
    from nexus_sli.exporter.targets.tensorrt_plan import GPU

    config = _gpu_encoder(tmp_path / "gpu_encoder", {**version_1(), "device": "gpu"})
    passed = ValidationReport.from_dict({**FP32, "precision": "fp16", "backend": "tensorrt-plan"})
    monkeypatch.setattr(bp, "import_tensorrt", lambda: SimpleNamespace(__version__="10.5.0"))
    monkeypatch.setattr(bp, "CudaRuntime", lambda: SimpleNamespace(device=lambda: GPU("NVIDIA test GPU", 8, 6)))
    monkeypatch.setattr(bp, "build_engine", lambda trt, onnx, inputs, dims, workspace: (b"engine", 14))
    monkeypatch.setattr(bp, "EngineRunner", lambda trt, plan: SimpleNamespace(io_types=lambda: bp.io_types(config)))
    monkeypatch.setattr(bp, "against_reference", lambda folder, runner, backend, trims: passed)
    record = bp.build_plan(tmp_path, "gpu", workspace=1 << 30)
    assert isinstance(record, PlanRecord) and record.validation == passed and record.fp32_layers == 14
    assert record.profile == {"min": [1, 1], "opt": [16, 128], "max": [64, 256]}
    assert export_report.read(tmp_path / "gpu_encoder").tensorrt_plans == {"8.6": record}
    assert (tmp_path / "gpu_encoder" / "1" / record.file).read_bytes() == b"engine"
    assert main(["build-plan", "--repository", str(tmp_path), "--model", "gpu"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "model": "gpu", "file": "model.sm86.plan", "gpu": "NVIDIA test GPU", "compute_capability": "8.6",
        "tensorrt": "10.5.0", "cosine_min": FP32["cosine_min"], "agreement": None, "passed": True}
