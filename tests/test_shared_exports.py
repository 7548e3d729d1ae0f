"""The session's shared exports (helpers.exports) stand in for exports of the tests' own.

A copy under another name must be what an export under that name writes: the same
files, byte for byte, but for the names in the configs."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.exports import ExportStore
from nexus_sli.exporter.export import export_report
from nexus_sli.exporter.export.pipeline import ExportOptions, run_export


def _files(repository: Path) -> dict[str, bytes]:
    return {str(p.relative_to(repository)): p.read_bytes() for p in sorted(repository.rglob("*")) if p.is_file()}


def test_a_renamed_copy_is_what_an_export_under_that_name_writes(tiny_checkpoint, tmp_path, monkeypatch):
    from nexus_sli.exporter.export import timing

    monkeypatch.setattr(timing, "run_ms", lambda runner, feeds: 1.0)  # both keep the same graph
    model = str(tiny_checkpoint("bert"))
    store = ExportStore(tmp_path / "store")
    copied = store.copy("shared", tmp_path / "copied", as_name="mine", model=model)
    run_export(ExportOptions(model=model, name="mine", out=tmp_path / "direct"))
    got, want = _files(copied), _files(tmp_path / "direct")
    assert sorted(got) == sorted(want) and any(name.startswith("mine_tokens/") for name in got)
    assert [name for name in want if got[name] != want[name]] == ["mine_encoder/validation.json"]
    # ... whose only differences are what each run found: the memory free to time in, the layer cache's hits
    reports = [export_report.read(repository / "mine_encoder").to_dict() for repository in (copied, tmp_path / "direct")]
    for report in reports:
        del report["timing"]["memory_budget_bytes"], report["walk"]["from_cache"]
    assert reports[0] == reports[1]


def test_a_second_copy_exports_nothing_again(tiny_checkpoint, tmp_path, monkeypatch):
    from helpers import exports

    store = ExportStore(tmp_path / "store")
    first = store.copy("shared", tmp_path / "a", model=str(tiny_checkpoint("bert")))
    monkeypatch.setattr(exports, "run_export", lambda options: pytest.fail("exported again"))
    again = ExportStore(tmp_path / "store")  # another process of the run, with the same folder
    again.copy("shared", tmp_path / "b", as_name="other", model=str(tiny_checkpoint("bert")))
    assert (tmp_path / "b" / "other_encoder" / "config.pbtxt").is_file() and first == tmp_path / "a"
    model = str(tiny_checkpoint("bert"))
    assert again.export("shared", model=model).graph == store.export("shared", model=model).graph


def test_an_export_left_unfinished_is_made_again(tiny_checkpoint, tmp_path):
    store = ExportStore(tmp_path / "store")
    (tmp_path / "store" / "shared" / "shared_encoder").mkdir(parents=True)  # a killed process's leftovers
    store.copy("shared", tmp_path / "a", model=str(tiny_checkpoint("bert")))
    assert export_report.read(tmp_path / "a" / "shared_encoder").validation.passed
