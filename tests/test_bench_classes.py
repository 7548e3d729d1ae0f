"""The CPU classes table of BENCHMARKS.md and target (e), the share of the compute peak.

Pure functions over results: no server, no model.  The kept runs in
bench/results/classes/ are real data from full `make bench` runs; the rest is built here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nexus_sli.bench import cpu_classes
from nexus_sli.bench import targets as bench_targets
from helpers.bench_rows import DEFAULT, LIMIT, by_comparison, run_rows

#: the repository's root: the kept runs and the page are read from there, whatever the working directory
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

AVX2 = {"avx2": True, "avx512f": False, "avx512_vnni": False, "avx512_bf16": False,
        "amx_tile": False, "amx_int8": False, "amx_bf16": False}


@pytest.mark.parametrize("flags, expected", [
    (AVX2, "avx2"),
    ({**AVX2, "avx512f": True}, "avx2"),  # AVX-512 without VNNI: int8 is no faster, the AVX2 class's choices
    ({**AVX2, "avx512f": True, "avx512_vnni": True}, "avx512-vnni"),
    ({**AVX2, "avx512f": True, "avx512_vnni": True, "avx512_bf16": True}, "avx512-vnni-bf16"),
    ({**AVX2, "avx512f": True, "avx512_vnni": True, "amx_tile": True, "amx_int8": True, "amx_bf16": True}, "amx"),
])
def test_cpu_class_from_flags(flags, expected):
    assert cpu_classes.cpu_class(flags) == expected


def _results(flags=AVX2, rows=None, limit=LIMIT, quick=False):
    return {"machine": {"flags": flags, "cpu_model": "Test CPU"}, "created": "2026-11-26T05:00:00+00:00",
            "checkout": {"commit": "abc123def456", "clean": True}, "default_configuration": DEFAULT,
            "rows": rows if rows is not None else run_rows(), "compute_limit": limit, "quick": quick}


def test_a_kept_run_is_its_class_row_judged_by_the_current_targets(tmp_path):
    kept = cpu_classes.keep(_results(), tmp_path)
    assert kept == tmp_path / "classes" / "avx2.json"
    (row,) = [r for r in cpu_classes.rows(tmp_path, tmp_path / "none.json") if r["class"] == "avx2"]
    assert (row["cpu"], row["date"], row["default"]) == ("Test CPU", "2026-11-26", "onnxruntime fp32")
    assert row["source"] == "`make bench`, clean checkout"
    # batches of 32: paired ratios 3.0, 3.0, 3.02 -> median 3.00x, met, so no status beside it
    assert row["figures"][0] == "3.00x" and row["figures"][4] == "50.8%"
    judged = [t for t in bench_targets.evaluate(run_rows(), DEFAULT, LIMIT) if t["status"] != "not measured"]
    assert row["met"] == f"{sum(t['met'] for t in judged)}/{len(judged)}"


def test_a_missed_target_shows_its_status_and_classes_without_runs_say_so(tmp_path):
    cpu_classes.keep(_results(rows=run_rows(served_batch=(184, 202, 186))), tmp_path)
    notes = tmp_path / "notes.json"
    notes.write_text(json.dumps({"avx512-vnni": {"reported": {
        "cpu": "Reported CPU", "date": "2026-11-01", "source": "reported elsewhere", "default": "openvino int8",
        "figures": ["3.27x", "-", "2.24x", "-", "15-20%"], "met": "6/9"}, "stops": "int8 at 15-20% of its peak"}}))
    found = {r["class"]: r for r in cpu_classes.rows(tmp_path, notes)}
    assert [r["class"] for r in cpu_classes.rows(tmp_path, notes)] == [c for c, _ in cpu_classes.CLASSES]
    assert found["avx2"]["figures"][0] == "1.84x (not met)"
    assert found["avx512-vnni"]["figures"][0] == "3.27x" and found["avx512-vnni"]["source"] == "reported elsewhere"
    assert found["avx512-vnni"]["stops"] == "int8 at 15-20% of its peak"
    assert found["amx"]["figures"] == ["not run"] * len(cpu_classes.COLUMNS)
    table = cpu_classes.section(tmp_path, notes)
    assert table[0] == "## CPU classes side by side"
    assert sum(line.startswith("| ") for line in table) == 1 + len(cpu_classes.CLASSES)  # heading + one per class
    rows_end = 6 + len(cpu_classes.CLASSES)  # the heading, its rule and one line per class, from table[4]
    assert all(line.count("|") == table[4].count("|") for line in table[4:rows_end])
    # the reasons are numbered notes below the table, each row's cell naming its note
    assert table[rows_end:][-1] == "1. AVX-512 with VNNI, no bf16 (Intel Ice Lake seen): int8 at 15-20% of its peak"
    assert table[4 + 2 + 2].endswith(" | 1 |") and table[4 + 2].endswith(" | - |")


def test_the_kept_avx512_bf16_run_is_rejudged_by_the_current_rules():
    kept = json.loads((cpu_classes.classes_dir(RESULTS) / "avx512-vnni-bf16.json")
                      .read_text())
    row = cpu_classes.summary(kept)
    assert row["class"] == "avx512-vnni-bf16" and row["default"] == "openvino int8"
    found = by_comparison(kept["targets"])
    assert row["figures"][0].startswith(f"{found[('(a)', 'vs sentence-transformers encode(batch_size=32)')]['median']:.2f}x")
    # a run kept from before the short-text row existed (that row left out): said, not guessed
    older = {**kept, "rows": [r for r in kept["rows"] if r["mode"] != "short32"]}
    assert cpu_classes.summary(older)["figures"][1] == "not measured"


def test_share_of_peak_needs_the_estimate_and_reports_its_gap():
    found = by_comparison(bench_targets.evaluate(run_rows(), DEFAULT))
    share = found[("(e)", "served batches of 32 over the precision's estimated peak")]
    assert share["status"] == "not measured" and "no peak estimate" in share["gap"]
    low = {**LIMIT, "peaks": {"fp32": {"flops": 3000e9, "instruction_set": "avx512-full"}}}
    share = by_comparison(bench_targets.evaluate(run_rows(), DEFAULT, low))[
        ("(e)", "served batches of 32 over the precision's estimated peak")]
    assert share["comparison"].endswith("(fp32, avx512-full)")
    assert share["status"] == "not met" and share["median"] == pytest.approx(305 / 3000, abs=1e-6)
    assert share["gap"] == "10% measured, >= 35% needed"


def test_the_committed_page_is_what_its_run_renders(monkeypatch):
    """BENCHMARKS.md is rendered from bench/results (never edited by hand), and the latest full run is
    its CPU class's kept run."""
    from nexus_sli.bench.report import benchmarks_page

    # the run records its folders relative to the repository's root, where `make bench` renders the page
    monkeypatch.chdir(ROOT)
    results = json.loads((RESULTS / "latest.json").read_text())
    page = benchmarks_page(results, (RESULTS / "latest.md").read_text())
    assert (ROOT / "BENCHMARKS.md").read_text() == page
    # a cell holds one sentence at most: the reasons are notes below the table
    cells = [cell for line in page.splitlines() if line.startswith("| ") for cell in line.strip("| ").split(" | ")]
    assert not [cell for cell in cells if ". " in cell]
    kept = cpu_classes.classes_dir(RESULTS) / f"{cpu_classes.cpu_class(results['machine']['flags'])}.json"
    assert json.loads(kept.read_text()) == results
