"""The packaged all-MiniLM-L6-v2: fp32 parity, int8 fidelity, and failure safety."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest

from helpers.exports import MINILM
from nexus_sli.exporter.export import export_report, pipeline, validate
from nexus_sli.cli.main import main
from nexus_sli.exporter.errors import NexusError, ValidationError
from nexus_sli.exporter.export.pipeline import Attempt, ExportOptions, run_export
from nexus_sli.exporter.export.report import FidelityShortfall, ValidationReport
from nexus_sli.exporter.targets.base import Candidate
from nexus_sli.exporter.targets.registry import TARGETS, Configuration


@pytest.fixture(scope="module")
def repo(tmp_path_factory, exports):
    """The default export and int8, in a repository of the module's own (the tests below export into it)."""
    out = tmp_path_factory.mktemp("repo")
    for name in (MINILM, "minilm_int8"):
        exports.copy(name, out)
    return out


def _report(repo, name):
    return export_report.read(repo / f"{name}_encoder")


def test_default_name_and_fp32_parity(repo):
    report = _report(repo, "all_minilm_l6_v2")
    assert (repo / "all_minilm_l6_v2_encoder" / "1" / "model.onnx").is_file()
    assert {"precision", "reference", "max_abs_diff", "cosine_min", "cosine_mean", "agreement", "thresholds",
            "passed"} <= set(report.to_dict())
    assert report.validation.passed is True and report.validation.precision == "fp32"
    assert report.validation.agreement is None
    assert report.validation.max_abs_diff <= 1e-4 and report.validation.thresholds == {"max_abs_diff": 1e-4}
    assert report.validation.texts >= 200
    assert (report.pooling, report.normalize, report.max_length) == ("mean", True, 256)
    # the graph ends in the pooling: validation compared its [batch, 384] embeddings as they come
    assert report.pooled_in_graph is True and report.validation.cosine_min > 0.99999
    graph = onnx.load(str(repo / "all_minilm_l6_v2_encoder" / "1" / "model.onnx")).graph
    # ... with the token states beside it, for the NAME_tokens ensemble (TEI's /embed_all)
    assert [o.name for o in graph.output] == ["EMBEDDING", "TOKEN_EMBEDDINGS"]


def test_int8_fidelity(repo):
    report = _report(repo, "minilm_int8")
    assert report.validation.passed is True and report.validation.precision == "int8"
    assert report.validation.cosine_mean >= 0.99 and report.validation.cosine_min >= 0.95
    assert report.validation.thresholds == {"cosine_mean": 0.99, "cosine_min": 0.95}
    ops = {node.op_type for node in onnx.load(str(repo / "minilm_int8_encoder" / "1" / "model.onnx")).graph.node}
    assert {"DynamicQuantizeLinear", "MatMulInteger"} <= ops


def test_failed_validation_changes_nothing(repo, monkeypatch, tiny_checkpoint):
    before = {p: p.stat().st_mtime_ns for p in repo.rglob("*")}
    # A threshold no real export can meet stands in for a broken graph; the export that fails replaces the
    # served model of the same name (a seeded tiny one: what is under test is the pipeline's, not the model's)
    monkeypatch.setitem(validate.THRESHOLDS, "fp32", {"max_abs_diff": 0.0})
    with pytest.raises(ValidationError, match="nothing was written"):
        run_export(ExportOptions(model=str(tiny_checkpoint("bert")), name=MINILM, out=repo))
    assert {p: p.stat().st_mtime_ns for p in repo.rglob("*")} == before
    assert not list(repo.parent.glob(f".{repo.name}.staging-*"))


def test_allow_degraded_is_recorded(tmp_path, monkeypatch, tiny_checkpoint):
    monkeypatch.setitem(validate.THRESHOLDS, "fp32", {"max_abs_diff": 0.0})
    run_export(ExportOptions(model=str(tiny_checkpoint("bert")), out=tmp_path, allow_degraded=True, name="degraded"))
    report = _report(tmp_path, "degraded")
    assert report.validation.passed is False and report.allow_degraded is True and report.validation.failures


def test_a_configuration_whose_graphs_cannot_be_made_is_left_out_of_auto(tmp_path, monkeypatch, tiny_checkpoint,
                                                                          caplog):
    def broken(self, graph, precision):
        raise RuntimeError("the quantizer failed on this graph")

    monkeypatch.setattr(type(TARGETS["openvino"]), "candidates", broken)
    model = str(tiny_checkpoint("bert"))
    result = run_export(ExportOptions(model=model, out=tmp_path, name="auto", precision="fp32", backend="auto"))
    assert result.report.validation.backend == "onnxruntime"  # ONNX Runtime fp32 still answers
    recorded = {(a.backend, a.passed): a.failures for a in _report(tmp_path, "auto").attempts}
    assert list(recorded) == [("onnxruntime", True), ("openvino", False)]  # in the order tried
    assert recorded[("openvino", False)] == ["its graphs could not be made or validated: RuntimeError: the "
                                             "quantizer failed on this graph"]
    assert "openvino fp32: its graphs could not be made or validated" in caplog.text
    assert "the quantizer failed on this graph" in caplog.text  # its traceback, logged
    with pytest.raises(RuntimeError, match="the quantizer failed"):  # asked for alone: its error is the export's
        run_export(ExportOptions(model=model, out=tmp_path, name="alone", precision="fp32", backend="openvino"))


def test_cli_reports_bad_input_clearly(tmp_path, capsys):
    with pytest.raises(SystemExit) as refused:  # argparse lists the registered choices
        main(["export", "--precision", "fp8", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "invalid choice: 'fp8'" in err
    assert all(choice in err.split("choose from")[1] for choice in ("auto", "fp32", "int8", "bf16"))
    assert main(["export", "--name", "../escape", "--out", str(tmp_path)]) == 2
    assert "invalid model name" in capsys.readouterr().err
    assert main(["export", "--model", str(tmp_path / "nope"), "--out", str(tmp_path)]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:  # as the command line is read
        main(["export", "--max-batch-size", "0", "--out", str(tmp_path)])
    assert refused.value.code == 2 and "takes a number of rows from 1 to 2048, got '0'" in capsys.readouterr().err
    assert main(["export", "--task", "translation", "--out", str(tmp_path)]) == 2
    assert "known tasks: embedding" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_hub_id_without_network_fails_fast_with_guidance(tmp_path):
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "nexus_sli.cli.main", "export", "--model", "nexus-sli-test/no-such-model",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "MODEL=/path/to/model" in result.stderr
    assert time.monotonic() - start < 60, "an unreachable hub must not hang the export"


def test_killed_export_leaves_the_repository_as_it_was(repo, tiny_checkpoint):
    import signal

    before = {p: p.stat().st_mtime_ns for p in repo.rglob("*")}
    process = subprocess.Popen([sys.executable, "-m", "nexus_sli.cli.main", "export", "--out", str(repo)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for line in process.stderr:  # kill it mid-export, after the walk has started writing to staging
        if "graph:" in line:
            break
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert {p: p.stat().st_mtime_ns for p in repo.rglob("*")} == before
    stale = list(repo.parent.glob(f".{repo.name}.staging-*"))
    assert stale, "the killed export should have left its staging folder behind"
    run_export(ExportOptions(model=str(tiny_checkpoint("bert")), out=repo, name="after_kill"))  # any model will do
    assert not [p for p in stale if p.exists()], "the next export removes staging folders of dead exports"


def _failed(graph, cosine_mean=None, agreement=None, max_abs_diff=0.5, passed=False):
    """A candidate whose validation found ``cosine_mean`` / ``agreement`` / ``max_abs_diff``."""
    failures = [] if passed else [FidelityShortfall("below the bar")]
    report = ValidationReport("int8", "onnxruntime", {}, 8, max_abs_diff, cosine_mean, cosine_mean, agreement, 0, 0,
                              failures)
    return Candidate(graph, Path(f"/nowhere/{graph}.onnx"), report)


def _attempt(backend, *candidates):
    return Attempt(Configuration(TARGETS[backend], "int8", "asked"), list(candidates))


@pytest.mark.parametrize(("figures", "nearest"), [
    # vectors: the highest mean cosine, in whichever configuration it is
    ([{"cosine_mean": 0.97}, {"cosine_mean": 0.991}, {"cosine_mean": 0.98}], 1),
    # labels (no cosine): the highest agreement
    ([{"agreement": 0.80}, {"agreement": 0.95}, {"agreement": 0.90}], 1),
    # neither: the smallest difference
    ([{"max_abs_diff": 0.3}, {"max_abs_diff": 0.2}, {"max_abs_diff": 0.05}], 2),
])
def test_allow_degraded_keeps_the_failing_graph_nearest_pytorch(figures, nearest):
    candidates = [_failed(f"graph{n}", **f) for n, f in enumerate(figures)]
    attempts = [_attempt("onnxruntime", candidates[0]), _attempt("openvino", candidates[1], candidates[2])]
    attempt, chosen = pipeline._choose(attempts, None, allow_degraded=True)
    assert chosen is candidates[nearest] and any(c is chosen for c in attempt.candidates)


def test_a_graph_that_passed_is_kept_over_nearer_failing_ones():
    failing, passing = _failed("near", cosine_mean=0.9999), _failed("fast", cosine_mean=0.99, passed=True)
    attempts = [_attempt("onnxruntime", failing), _attempt("openvino", passing)]
    assert pipeline._choose(attempts, passing, allow_degraded=True) == (attempts[1], passing)


def test_without_allow_degraded_no_failing_graph_is_kept():
    attempts = [_attempt("onnxruntime", _failed("plain", cosine_mean=0.97))]
    with pytest.raises(ValidationError, match="nothing was written.*--allow-degraded"):
        pipeline._choose(attempts, None, allow_degraded=False)


def test_max_batch_size_asked_for_sets_every_step_and_the_clients_request_size(tmp_path, tiny_checkpoint):
    from nexus_sli.client.model_info import ModelInfo
    from nexus_sli.exporter.triton import config as tc

    run_export(ExportOptions(model=str(tiny_checkpoint("bert")), task="embedding", name="tiny", out=tmp_path,
                             max_batch_size=256, search=False))
    configs = {folder.name: tc.read(folder / "config.pbtxt") for folder in tmp_path.iterdir()
               if (folder / "config.pbtxt").exists()}
    assert set(configs) >= {"tiny", "tiny_tokenizer", "tiny_encoder"}
    assert {c.max_batch_size for c in configs.values()} == {256} != {tc.MAX_BATCH_SIZE}
    from google.protobuf import json_format

    ensemble = json_format.MessageToDict(configs["tiny"], preserving_proto_field_name=True)
    assert ModelInfo.from_config("tiny", ensemble).max_batch_size == 256  # the client sends 256 texts a request


@pytest.mark.parametrize("rows", [0, -8, 2049, 64.0, True])
def test_a_max_batch_size_no_repository_can_serve_is_refused_before_any_work(rows, tmp_path):
    with pytest.raises(NexusError, match=f"max_batch_size must be a whole number from 1 to 2048, got {rows!r}"):
        run_export(ExportOptions(model=str(tmp_path / "never-read"), out=tmp_path / "repo", max_batch_size=rows))
    assert not (tmp_path / "repo").exists()
