"""The benchmark harness end to end: ``nexus-sli bench --quick`` on a tiny model.

Not timed, and no figure is asserted: this only proves that the harness still
exports, serves, measures every path and writes well-formed results, so it
cannot rot silently.  (The tiny checkpoint has no sentence-transformers folder,
so the baseline is the PyTorch fallback.)
"""

from __future__ import annotations

import json

import pytest

from nexus_sli.bench.harness import variants
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
    assert served >= {(p, m) for p in ("fp32", "int8") for m in ("batch32", "concurrent16", "latency1", "seq_len")}
    assert {(r["path"], r["precision"]) for r in rows if r["protocol"] == "in-process"} >= {
        ("onnxruntime", "fp32"), ("onnxruntime", "int8")}
    # every configuration is served, or its export's failure is recorded with the reason
    served_labels = {r["precision"] for r in rows if r["path"] == "triton"}
    for label in variants():
        assert label in served_labels or any(label in s["path"] and s["reason"] for s in results["skipped"]), label
    # one reference per group of rows: the text set, single queries, and each sequence length
    references = [(r["mode"], r["seq_len"]) for r in rows if r["baseline"]]
    assert len(references) == len(set(references))
    assert {m for m, _ in references} == {"batch32", "latency1", "seq_len"}
    assert all(r["ratio_vs_baseline"] == 1.0 for r in rows if r["baseline"])
    assert sorted({r["seq_len"] for r in rows if r["mode"] == "seq_len"}) == results["settings"]["seq_lens"]
    # the HTTP gateway (OpenAI's API through the openai SDK) beside the direct gRPC rows, same vectors
    gateway = [r for r in rows if r["path"] == "gateway"]
    assert {(r["precision"], r["protocol"], r["mode"]) for r in gateway} == {
        ("fp32", "openai-http", m) for m in ("batch32", "concurrent16", "latency1")}
    direct = {r["mode"]: r for r in rows if (r["path"], r["precision"], r["protocol"]) == ("triton", "fp32", "grpc")}
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
    assert results["command"].startswith("nexus-sli bench") and "--quick" in results["command"]


def test_markdown_and_plot_are_written(quick):
    _, out = quick
    page = (out / "latest.md").read_text()
    assert "| path | precision | protocol | mode | texts/s" in page and "## Targets" in page
    assert (out / "latest.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_benchmarks_page_carries_the_latest_run_and_what_was_tried(quick):
    from nexus_sli.bench.report import TRIED, benchmarks_page

    results, out = quick
    page = benchmarks_page(results, (out / "latest.md").read_text())
    assert page.startswith("# Benchmarks") and "## Latest run" in page and "### Targets (issue 6)" in page
    assert page.rstrip().endswith(TRIED.read_text().rstrip())
    assert "## What was tried" in TRIED.read_text()
