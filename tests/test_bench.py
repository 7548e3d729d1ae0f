"""The benchmark harness end to end: ``nexus-sli bench --quick`` on a tiny model.

Not timed, and no figure is asserted: this only proves that the harness still
exports, serves, measures every path and writes well-formed results, so it
cannot rot silently.  (The tiny checkpoint has no sentence-transformers folder,
so the baseline is the PyTorch fallback.)  The bench's targets and their paired
per-repetition arithmetic are checked on synthetic rows, whose figures are known.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers.reports import measured_row, version_1
from helpers.bench_rows import DEFAULT, LIMIT, by_comparison, run_rows
from nexus_sli.bench import targets as bench_targets
from nexus_sli.exporter.export import export_report
from nexus_sli.exporter.export.export_report import ExportReport
from nexus_sli.bench.exports import export_choice, variant_label, variants
from nexus_sli.bench.measure import Measurement, Sample, in_process_precision
from nexus_sli.bench.repetitions import Repetitions, run_repetitions
from nexus_sli.bench.texts import bench_texts, generate_from_sources, length_stats
from nexus_sli.cli.main import main
from nexus_sli.exporter.targets.cpu import supports_bf16

ROW_TYPES = {
    "path": str, "precision": str, "protocol": str, "mode": str,
    "texts_per_s": float, "p50_ms": (float, type(None)), "p99_ms": (float, type(None)),
    "cosine_mean": float, "cosine_min": float, "ratio_vs_baseline": (float, type(None)),
}
FLAGS = ("avx512_vnni", "amx_int8", "amx_bf16", "avx512_bf16")


def test_stored_text_set_is_what_its_sources_give():
    texts = bench_texts()
    assert texts == generate_from_sources()
    assert len(texts) >= 512 and len(set(texts)) == len(texts)


def test_text_set_has_a_length_mix():
    words = [len(t.split()) for t in bench_texts()]
    assert sum(w <= 8 for w in words) >= 50            # short queries
    assert sum(10 <= w <= 40 for w in words) >= 200    # sentences
    assert sum(w >= 150 for w in words) >= 30          # paragraphs near the model limit and past it
    stats = length_stats([3, 20, 300], max_length=256)
    assert stats["truncated"] == 1 and stats["tokens_percentiles"]["p100"] == 256


@pytest.fixture(scope="module")
def quick(tiny_checkpoint, tmp_path_factory):
    work = tmp_path_factory.mktemp("bench")
    model = tiny_checkpoint("bert")
    code = main(["bench", "--quick", "--model", str(model), "--repo", str(work / "repo"), "--out", str(work / "out")])
    assert code == 0
    return json.loads((work / "out" / "latest.json").read_text()), work / "out"


def test_rows_have_the_documented_keys_and_types(quick):
    results, _ = quick
    assert results["rows"]
    for row in results["rows"]:
        for key, kind in ROW_TYPES.items():
            assert isinstance(row[key], kind), (key, row)
        assert row["texts_per_s"] > 0 and row["tokens_per_s"] > 0
        assert row["ratio_vs_baseline"] is None or row["ratio_vs_baseline"] > 0
        assert -1.0 <= row["cosine_min"] <= row["cosine_mean"] <= 1.0 + 1e-6


def test_every_path_and_mode_was_measured(quick):
    results, _ = quick
    rows = results["rows"]
    served = {(r["precision"], r["mode"]) for r in rows if r["path"] == "triton"}
    assert served >= {(p, m) for p in ("fp32", "int8")
                      for m in ("batch32", "concurrent16", "latency1", "seq_len", "short32")}
    assert {(r["path"], r["precision"]) for r in rows if r["protocol"] == "in-process"} >= {
        ("onnxruntime", "fp32"), ("onnxruntime", "int8")}
    # every configuration is served, or its export's failure is recorded with the reason
    served_labels = {r["precision"] for r in rows if r["path"] == "triton"}
    for label in variants():
        assert label in served_labels or any(label in s["path"] and s["reason"] for s in results["skipped"]), label
    # one reference per group of rows: the text set, its short texts, single queries, and each sequence length
    references = [(r["mode"], r["seq_len"]) for r in rows if r["baseline"]]
    assert len(references) == len(set(references))
    assert {m for m, _ in references} == {"batch32", "latency1", "seq_len", "short32"}
    # fp32 is the PyTorch model's arithmetic: its vectors are the baseline's to float rounding
    fp32_short = [r for r in rows if r["mode"] == "short32" and r["precision"] == "fp32"]
    assert fp32_short and all(r["cosine_min"] >= 0.9999 for r in fp32_short), fp32_short
    assert all(r["ratio_vs_baseline"] == 1.0 for r in rows if r["baseline"])
    assert sorted({r["seq_len"] for r in rows if r["mode"] == "seq_len"}) == results["settings"]["seq_lens"]
    # the HTTP gateway in front of the default (OpenAI's API through the openai SDK in every mode, TEI's /embed
    # and OpenAI's from a plain HTTP client on single queries, both OpenAI clients sent in turn with gRPC's
    # batches) beside the direct gRPC rows, same vectors
    label = results["default_configuration"]["label"]
    gateway = [r for r in rows if r["path"] == "gateway"]
    assert {(r["precision"], r["protocol"], r["mode"]) for r in gateway} == {
        *((label, "openai-http", m) for m in ("batch32", "concurrent16", "latency1", "paired32")),
        (label, "tei-http", "latency1"), *((label, "openai-http-plain", m) for m in ("latency1", "paired32"))}
    assert (label, "paired32") in served
    direct = {r["mode"]: r for r in rows if (r["path"], r["precision"], r["protocol"]) == ("triton", label, "grpc")}
    assert all(abs(r["cosine_min"] - direct[r["mode"]]["cosine_min"]) < 1e-4 for r in gateway)


def _openvino_measured(quick) -> tuple[set, set]:
    rows = quick[0]["rows"]
    in_process = {r["precision"] for r in rows if r["protocol"] == "in-process" and r["path"] == "openvino"}
    served = {r["precision"] for r in rows if r["path"] == "triton" and r["precision"].startswith("openvino-")}
    return in_process, served


@pytest.mark.skipif(not supports_bf16(), reason="the CPU has no avx512_bf16/amx_bf16: the bench measures OpenVINO fp32")
def test_openvino_bf16_is_measured_where_the_cpu_has_bf16(quick):
    in_process, served = _openvino_measured(quick)
    assert "bf16" in in_process and "openvino-bf16" in served


@pytest.mark.skipif(supports_bf16(), reason="the CPU has avx512_bf16/amx_bf16: the bench measures OpenVINO bf16")
def test_openvino_fp32_is_measured_where_the_cpu_has_no_bf16(quick):
    in_process, served = _openvino_measured(quick)
    assert "fp32" in in_process and "openvino-fp32" in served


def test_machine_memory_text_set_and_targets_are_recorded(quick):
    results, _ = quick
    machine = results["machine"]
    assert isinstance(machine["cpu_model"], str) and machine["cores"] >= 1
    assert all(isinstance(machine["flags"][flag], bool) for flag in FLAGS)
    assert results["server_memory"]["idle_mb"] > 0 and results["server_memory"]["processes"] >= 1
    assert results["text_set"]["texts"] > 0 and sum(results["text_set"]["histogram"].values()) == results["text_set"]["texts"]
    assert results["targets"] and all(isinstance(t["met"], bool) for t in results["targets"])
    # the targets are judged on what the auto export kept, served and run in process on single queries
    default = results["default_configuration"]
    assert default and sum(r["chosen"] for r in default["measured"]) == 1
    rows = results["rows"]
    assert any(r["path"] == "triton" and r["precision"] == default["label"] for r in rows)
    assert any(r["protocol"] == "in-process" and r["mode"] == "latency1" and not r["baseline"]
               and (r["path"], r["precision"]) == (default["backend"], default["precision"]) for r in rows)
    # one repetition: every row keeps it, and no target can be settled (met) on it
    assert results["settings"]["repetitions"] == 1
    assert all(len(r["texts_per_s_reps"]) == 1 for r in rows)
    speed = [t for t in results["targets"] if "fidelity" not in t["target"]]
    assert len(speed) == 13 and not any(t["met"] for t in speed)
    assert {t["status"] for t in speed} <= {"not settled", "not met", "not measured"}
    assert results["command"].startswith("nexus-sli bench") and "--quick" in results["command"]


def test_the_plan_and_the_folders_are_recorded(quick, tiny_checkpoint):
    results, out = quick
    # a tiny model is small: the quick plan, nothing reduced for its size, nothing said about it
    plan = results["settings"]["plan"]
    assert plan["name"] == "quick" and plan["reduced"] == [] and plan["flops_per_token"] > 0
    # --repo and --out as given; the model's own short name and make line (tests/test_bench_layout.py)
    where = results["layout"]
    assert where["out"] == str(out) and where["repository"] == str(out.parent / "repo")
    assert where["short_name"] == tiny_checkpoint("bert").name.lower()
    assert where["make"] == f"make bench MODEL={where['short_name']}"


def test_a_base_size_plan_serves_its_auto_export_beside_fp32(tiny_checkpoint, tmp_path, monkeypatch):
    """The base plan's path end to end on the tiny model, made to count as base-size: fp32 and the
    default only, the default being the auto export itself, in the served repository."""
    from nexus_sli.bench import run_size

    monkeypatch.setattr(run_size, "FULL_MAX_FLOPS_PER_TOKEN", 0.0)
    repo, out = tmp_path / "repo", tmp_path / "out"
    assert main(["bench", "--quick", "--model", str(tiny_checkpoint("bert")), "--repo", str(repo),
                 "--out", str(out)]) == 0
    results = json.loads((out / "latest.json").read_text())
    default = results["default_configuration"]
    assert results["settings"]["plan"]["name"] == "base quick" and default is not None
    base = results["served_models"]["fp32"].removesuffix("_auto")
    expected = {"fp32": f"{base}_auto"} if default["label"] == "fp32" else {
        "fp32": base, default["label"]: f"{base}_auto"}
    assert results["served_models"] == expected
    assert {r["precision"] for r in results["rows"] if r["path"] == "triton"} == set(expected)
    # the auto export is served from the repository: nothing beside it, no other configuration in it
    assert not (tmp_path / "repo-auto").exists()
    assert {p.name for p in repo.iterdir() if p.is_dir()} == {
        f"{name}{part}" for name in expected.values() for part in ("", "_tokenizer", "_encoder", "_tokens")}
    assert default["source"] == str(repo / f"{base}_auto_encoder" / "validation.json")
    assert "Plan: base quick, chosen from the model's size" in (out / "latest.md").read_text()


def test_markdown_and_plot_are_written(quick):
    _, out = quick
    page = (out / "latest.md").read_text()
    assert "| path | precision | protocol | mode | texts/s" in page and "## Targets" in page
    # a short query through each layer, side by side (a quick run serves over gRPC only)
    layers = page.split("## A short query, layer by layer")[1].split("\n## ")[0]
    assert all(f"| {what} |" in layers for what in ("the exported graph in process (tokenizers + the runtime)",
                                                    "Triton over gRPC, `EncoderClient`", "gateway, TEI `/embed`"))
    from nexus_sli.bench.report import REQUEST_PATH_TRIED, TRIED

    assert REQUEST_PATH_TRIED in layers and f"\n## {REQUEST_PATH_TRIED}\n" in TRIED.read_text()
    assert (out / "latest.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_benchmarks_page_carries_the_latest_run_and_what_was_tried(quick):
    from nexus_sli.bench.report import TRIED, TRIED_LINK, benchmarks_page

    from nexus_sli.bench.layout import layout

    results, out = quick
    latest = (out / "latest.md").read_text()
    # the packaged model's page (BENCHMARKS.md) carries what was tried on it
    page = benchmarks_page({**results, "layout": layout(None).record()}, latest)
    assert page.startswith("# Benchmarks\n") and "## Latest run" in page and "### Targets\n" in page
    # a results page: what was tried is linked (tried.md: its table of levers and the full record), not carried
    assert page.rstrip().endswith(TRIED_LINK.rstrip()) and TRIED.read_text().strip() not in page
    assert "## What was tried" in TRIED.read_text() and f"(bench/data/{TRIED.name})" in page
    # this run's model is another (the tiny checkpoint): its own page links the default's instead
    own = benchmarks_page(results, latest)
    assert own.startswith(f"# Benchmarks: {results['layout']['short_name']}\n") and "### Targets\n" in own
    assert "[BENCHMARKS.md](BENCHMARKS.md)" in own and "## What was tried" not in own and TRIED_LINK in own


# --- the targets on synthetic rows: paired per-repetition ratios ---------------------------------

def test_paired_ratio_arithmetic():
    assert bench_targets.paired_ratios([300, 330, None, 50], [100, 110, 90, 0]) == [3.0, 3.0]
    assert bench_targets.paired_differences([5.0, 5.5], [3.5, 3.0, 1.0]) == [1.5, 2.5]
    assert bench_targets.spread([3.0]) is None
    assert bench_targets.spread([1.0, 1.0, 1.3]) == pytest.approx(0.15)     # IQR 1.0..1.15 over median 1.0
    # one disturbed repetition out of five leaves the interquartile range alone: more repetitions settle
    assert bench_targets.spread([1.0, 1.0, 1.0, 1.0, 1.3]) == 0.0
    assert bench_targets.spread([-1.0, -1.2, -1.1]) == pytest.approx(0.1 / 1.1)


def test_targets_met_on_paired_ratios():
    results = bench_targets.evaluate(run_rows(), DEFAULT, LIMIT)
    found = by_comparison(results)
    batch = found[("(a)", "vs sentence-transformers encode(batch_size=32)")]
    assert batch["per_repetition"] == [3.0, 3.0, pytest.approx(305 / 101)] and batch["status"] == "met"
    assert batch["config"].startswith("served fp32 (onnxruntime fp32") and batch["config"].endswith("over grpc")
    # the fastest peer, in-process or server, is fastembed; paired repetition by repetition
    peer = found[("(a)", "vs the fastest peer")]
    assert "fastembed" in peer["comparison"] and peer["median"] == pytest.approx(1.5) and peer["met"]
    assert found[("(b)", "vs the fastest peer server")]["median"] == pytest.approx(2.0)
    # (c): the lowest peer server p50 decides "every peer server's"; overhead in ms against the graph in process
    assert "infinity-emb optimum" in found[("(c)", "p50 vs every peer server's")]["comparison"]
    overhead = found[("(c)", "serving overhead")]
    assert overhead["per_repetition"] == [pytest.approx(1.4), pytest.approx(1.5), pytest.approx(1.5)]
    assert overhead["required"] == "<= 2.00 ms"
    share = found[("(e)", "served batches of 32 over the precision's estimated peak")]
    assert share["per_repetition"] == [0.5, 0.55, pytest.approx(305 / 600)] and share["required"] == ">= 35%"
    # (f): gRPC p50 over the graph's in process, the OpenAI route's p50 minus gRPC's, its batches over gRPC's
    assert found[("(f)", "gRPC p50 vs the same graph's in-process p50")]["per_repetition"] == [
        pytest.approx(5.0 / 3.6), pytest.approx(5.2 / 3.7), pytest.approx(5.1 / 3.6)]
    assert found[("(f)", "OpenAI route p50 minus gRPC p50")]["median"] == pytest.approx(1.2)
    assert found[("(f)", "OpenAI route batches of 32 vs gRPC's")]["median"] == pytest.approx(295 / 305)
    speed = [t for t in results if "fidelity" not in t["target"]]
    assert len(speed) == 13 and all(t["status"] == "met" and t["met"] for t in speed), speed
    assert bench_targets.unsettled(results) == []
    fidelity = [t for t in results if "fidelity" in t["target"]]
    assert len(fidelity) == 1 and not fidelity[0]["met"] and "0.999" in fidelity[0]["gap"]


def test_the_request_paths_misses_report_their_gaps():
    # gRPC 5.0-5.2 ms over the graph's 2.5 ms; the OpenAI route 3 ms above gRPC; its batches 0.8x gRPC's
    results = bench_targets.evaluate(run_rows(graph_p50=(2.5, 2.5, 2.5), gateway_p50=(8.0, 8.2, 8.1),
                                               gateway_batch=(240, 264, 244)), DEFAULT)
    found = by_comparison(results)
    grpc = found[("(f)", "gRPC p50 vs the same graph's in-process p50")]
    assert grpc["status"] == "not met" and grpc["median"] == pytest.approx(5.1 / 2.5) and "allowed" in grpc["gap"]
    openai = found[("(f)", "OpenAI route p50 minus gRPC p50")]
    assert openai["required"] == "<= 1.50 ms" and "1.50 ms over" in openai["gap"]
    batches = found[("(f)", "OpenAI route batches of 32 vs gRPC's")]
    assert batches["status"] == "not met" and batches["median"] == pytest.approx(0.8)
    # without the gateway's rows (a run that did not measure them) they are not measured, never met
    rows = [r for r in run_rows() if r["path"] != "gateway"]
    missing = [t for t in bench_targets.evaluate(rows, DEFAULT) if t["target"].startswith("(f)")]
    assert [t["status"] for t in missing] == ["met", "not measured", "not measured"]


def test_target_not_met_reports_the_gap():
    results = bench_targets.evaluate(run_rows(served_batch=(184, 202, 186), served_p50=(8.0, 8.5, 8.1),
                                               served_p99=(15.0, 16.0, 15.5)), DEFAULT)
    found = by_comparison(results)
    batch = found[("(a)", "vs sentence-transformers encode(batch_size=32)")]
    assert batch["status"] == "not met" and not batch["met"]
    assert batch["median"] == pytest.approx(1.84) and "1.36x short" in batch["gap"]
    latency = found[("(c)", "p50 vs sentence-transformers's batch-1 p50")]
    assert latency["status"] == "not met" and "allowed" in latency["gap"] and "over" in latency["gap"]
    overhead = found[("(c)", "serving overhead")]
    assert overhead["median"] == pytest.approx(4.5) and "2.50 ms over" in overhead["gap"]
    tail = found[("(c)", "p99 vs its own p50")]
    assert tail["status"] == "not met" and "the same graph in process" not in tail["gap"]


def test_a_missed_tail_is_set_against_the_same_graphs_own_tail_in_process():
    # served p99 / p50: 1.875, 1.88, 1.91; the graph in process, same repetitions: 2.0, 2.2, 2.1
    results = bench_targets.evaluate(run_rows(served_p50=(8.0, 8.5, 8.1), served_p99=(15.0, 16.0, 15.5),
                                               graph_p99=(7.2, 8.14, 7.56)), DEFAULT)
    tail = by_comparison(results)[("(c)", "p99 vs its own p50")]
    assert tail["status"] == "not met" and tail["median"] == pytest.approx(16.0 / 8.5)
    assert tail["gap"].endswith("the same graph in process: p99 2.10x its p50 in this run")


def test_target_whose_repetitions_disagree_is_not_settled():
    # the baseline's repetitions are 100, 110, 101: these served figures give ratios 2.4, 3.6, 2.75
    results = bench_targets.evaluate(run_rows(served_batch=(240, 396, 277.75)), DEFAULT)
    batch = by_comparison(results)[("(a)", "vs sentence-transformers encode(batch_size=32)")]
    assert batch["median"] == pytest.approx(2.75) and batch["spread"] >= 0.10
    assert batch["status"] == "not settled" and not batch["met"] and batch["gap"].startswith("spread ")
    assert batch in bench_targets.unsettled(results)


def test_target_every_repetition_clears_is_met_however_wide_the_spread():
    # ratios 2.6, 3.6, 2.75: noisy (spread >= 10%), but no repetition is under 2.5x
    results = bench_targets.evaluate(run_rows(served_batch=(260, 396, 277.75)), DEFAULT)
    batch = by_comparison(results)[("(a)", "vs sentence-transformers encode(batch_size=32)")]
    assert batch["spread"] >= 0.10 and batch["status"] == "met" and batch["met"] and batch["gap"] == ""
    assert batch not in bench_targets.unsettled(results)  # nothing more repetitions could change


def test_no_peer_measured_is_said_and_never_met():
    results = bench_targets.evaluate(run_rows(peers=False), DEFAULT)
    peer_rows = [t for t in results if "peer" in t["comparison"]]
    assert len(peer_rows) == 3
    assert all(t["status"] == "not measured" and not t["met"] and "no peer" in t["gap"] for t in peer_rows)
    assert by_comparison(results)[("(a)", "vs sentence-transformers encode(batch_size=32)")]["met"]


def test_speed_of_a_configuration_that_does_not_qualify_never_counts():
    results = bench_targets.evaluate(run_rows(cosine=(0.996, 0.963)), DEFAULT, LIMIT)
    speed = [t for t in results if "fidelity" not in t["target"]]
    assert all(t["status"] == "not met" and "does not qualify" in t["gap"] and "0.9630" in t["gap"] for t in speed)
    assert bench_targets.unsettled(results) == []  # more repetitions cannot change that


def test_unknown_default_configuration_judges_nothing():
    results = bench_targets.evaluate(run_rows(), None)
    speed = [t for t in results if "fidelity" not in t["target"]]
    assert speed and all(t["status"] == "not measured" and not t["met"] for t in speed)


def test_auto_choice_maps_to_the_bench_label(tmp_path):
    report = {**version_1(), "measured": [
        {**measured_row("fp32", "plain", True), "score": 1.2},
        {**measured_row("bf16", "plain", True, chosen=True), "backend": "openvino"},
        {**measured_row("int8", "plain", False), "backend": "openvino"}]}
    (tmp_path / "x_encoder").mkdir()
    export_report.write(ExportReport.from_dict(report), tmp_path / "x_encoder")
    chosen = export_choice(tmp_path / "x_encoder").configuration
    assert (chosen["label"], chosen["backend"], chosen["precision"]) == ("openvino-bf16", "openvino", "bf16")
    assert len(chosen["measured"]) == 3
    assert variant_label("onnxruntime", "int8") == "int8"
    # ONNX Runtime's static int8, which only auto makes, is told apart from the dynamic int8 of a named export,
    # and its in-process rows keep the label (the path column names the runtime)
    static = variant_label("onnxruntime", "int8", "plain+static-sq0.75+attn-ffn-out-fp32")
    assert static == "int8-static" and in_process_precision(static) == static
    assert variants({"label": static, "backend": "onnxruntime", "precision": "int8"})[static] == (
        "onnxruntime", "int8", "_int8_static") and static not in variants()
    assert [in_process_precision(label) for label in ("fp32", "int8", "openvino-int8")] == ["fp32", "int8", "int8"]
    # a default outside the fixed variants is added to what the bench exports and serves
    odd = {"label": "openvino-fp16", "backend": "openvino", "precision": "fp16"}
    assert variants(odd)["openvino-fp16"] == ("openvino", "fp16", "_ov_fp16") and "openvino-fp16" not in variants()


class _NoSampler:
    def active(self, on: bool) -> None:
        pass


def _scripted(path: str, seconds: list[float], texts: list[str], **kwargs) -> Measurement:
    """A measurement whose repetitions take the given seconds (no clock involved)."""
    durations = iter(seconds)

    def run(batch: list[str]) -> Sample:
        return Sample(next(durations), [], np.ones((len(batch), 4)))
    return Measurement(path, "fp32", kwargs.pop("protocol", "in-process"), "batch32", texts, [3] * len(texts), run,
                       sliced=True, **kwargs)


def _repeat(served_seconds: list[float], minimum=3, maximum=6) -> tuple[Repetitions, list[Measurement]]:
    texts = [f"text {i}" for i in range(10)]
    measurements = [_scripted("sentence-transformers", [1.0] * 10, texts, baseline=True),
                    _scripted("triton", served_seconds, texts, protocol="grpc", served=True)]
    repetitions = Repetitions(minimum, maximum, 3, budget_s=1e9, default=DEFAULT)
    run_repetitions(measurements, repetitions, _NoSampler())
    return repetitions, measurements


def test_repetitions_stop_once_paired_ratios_agree():
    repetitions, measurements = _repeat([0.5] * 10)
    assert repetitions.done == 3 and "under the limit" in repetitions.stopped
    # three slices of a ten-text set: every text timed once, each repetition its own slice
    assert [s.indices for s in measurements[1].samples] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]


def test_repetitions_are_added_while_spread_then_capped():
    repetitions, measurements = _repeat([0.5, 0.25, 0.5, 0.25, 0.5, 0.25, 0.5, 0.25])
    assert repetitions.done == 6 and "cap of 6" in repetitions.stopped
    # open-ended: repetition r times slice r mod 3, so the fidelity still covers the whole set
    assert [s.indices[0] for s in measurements[0].samples] == [0, 1, 2, 0, 1, 2]
    assert not np.isnan(measurements[1].embeddings()).any()


def test_targets_table_names_the_cpu_status_spread_and_gap():
    from nexus_sli.bench.report import cpu_line, targets_table

    results = bench_targets.evaluate(run_rows(served_batch=(240, 396, 277.75), peers=False), DEFAULT)
    lines = targets_table(results)
    batch = next(line for line in lines if "(a)" in line and "sentence-transformers" in line)
    assert "| 2.75x |" in batch and "not settled: spread" in batch and "| 3 |" in batch
    assert any("vs the fastest peer" in line and "**not measured**" in line and "no peer was measured" in line
               for line in lines)
    overhead = next(line for line in lines if "serving overhead" in line)
    assert "<= 2.00 ms | 1.50 ms | 3.3% | 3 | met |" in overhead
    machine = {"cpu_model": "AMD EPYC", "cores": 2, "usable_cores": 2,
               "flags": {"avx2": True, "avx512f": True, "avx512_vnni": True, "amx_bf16": False}}
    assert cpu_line(machine) == ("CPU: AMD EPYC, 2 usable cores; instruction sets: AVX2, AVX-512, VNNI; "
                                 "without AMX-BF16.")


def test_served_protocols_and_the_gateway_take_turns_going_first():
    from nexus_sli.bench.repetitions import protocol_turns

    texts = ["a"]
    rows = [_scripted("sentence-transformers", [], texts, baseline=True)]
    for precision in ("fp32", "int8"):
        for protocol in ("grpc", "http"):
            rows += [Measurement("triton", precision, protocol, mode, texts, [1], None, served=True)
                     for mode in ("batch32", "latency1")]
    rows.append(_scripted("gateway", [], texts, protocol="openai-http", served=True))  # in front of fp32
    way = lambda m: "gateway" if m.path == "gateway" else m.protocol  # noqa: E731
    order = lambda repetition: [(m.precision, way(m)) for m in protocol_turns(rows, repetition)[1:]]  # noqa: E731
    fp32, int8 = (lambda *ways: [("fp32", w) for w in ways]), (lambda *ways: [("int8", w) for w in ways])
    assert order(0) == fp32("grpc", "grpc", "http", "http", "gateway") + int8("grpc", "grpc", "http", "http")
    assert order(1) == fp32("http", "http", "gateway", "grpc", "grpc") + int8("http", "http", "grpc", "grpc")
    assert order(2) == fp32("gateway", "grpc", "grpc", "http", "http") + int8("grpc", "grpc", "http", "http")
    for repetition in range(4):  # the baseline keeps its place; the same measurements, reordered
        turned = protocol_turns(rows, repetition)
        assert turned[0] is rows[0] and sorted(map(id, turned)) == sorted(map(id, rows))


def test_short_texts_are_judged_against_the_baselines_own_short_batches():
    # the baseline's short batches: 300, 330, 303 texts/s; served 700, 800, 720: 2.33x, 2.42x, 2.38x
    results = bench_targets.evaluate(run_rows(served_short=(700, 800, 720)), DEFAULT)
    short = next(t for t in results if t["target"].startswith("(d) client batches of 32 short texts"))
    assert short["median"] == pytest.approx(720 / 303) and short["status"] == "not met"
    assert short["per_repetition"] == pytest.approx([700 / 300, 800 / 330, 720 / 303], abs=1e-5)
