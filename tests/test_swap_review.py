"""The search's swap into a served repository (exporter/serving/swap.py) when a rename fails part-way, is
interrupted, or cannot be undone, and the clean-up of the search's folders beside a repository whose name holds
glob characters (exporter/serving/search.py).  No server: a stand-in records the loads."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nexus_sli.exporter.errors import RepositoryError
from nexus_sli.exporter.serving import swap
from nexus_sli.exporter.serving.binary import ServerError
from nexus_sli.exporter.serving.search import BackgroundSearch, ModelChoice, _stop_export
from nexus_sli.exporter.serving.swap import swap_in
from nexus_sli.exporter.triton import config as tc

NAMES = ("tiny", "tiny_encoder", "tiny_tokenizer")


def _model_set(path: Path, which: str) -> Path:
    """A tokenizer, an encoder and the ensemble calling them at version 1, each marked ``which``."""
    tokenizer = tc.pb.ModelConfig(name="tiny_tokenizer", backend="python", max_batch_size=8)
    encoder = tc.pb.ModelConfig(name="tiny_encoder", platform="onnxruntime_onnx", max_batch_size=8)
    ensemble = tc.pb.ModelConfig(name="tiny", platform="ensemble", max_batch_size=8)
    for step in (tokenizer, encoder):
        ensemble.ensemble_scheduling.step.add(model_name=step.name, model_version=-1)
    for config in (tokenizer, encoder, ensemble):
        (path / config.name / "1").mkdir(parents=True)
        (path / config.name / "1" / "marker").write_text(f"{which} {config.name}")
        tc.write(config, path / config.name)
    return path


def _contents(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): p.read_text() if p.is_file() else "" for p in sorted(folder.rglob("*"))}


def _retired(tmp_path: Path) -> list[Path]:
    return sorted(tmp_path.glob(".repo-retired-*"))


class _Server:
    """A stand-in for the served :class:`~.launcher.TritonServer`: its supervisor records the models loaded, and
    fails to load those in ``failing`` once each."""

    joined = None

    def __init__(self, failing=()):
        self.supervisor = self
        self.loaded: list[str] = []
        self.failing = set(failing)

    @contextlib.contextmanager
    def swapping(self, names=()):
        yield self

    def load(self, name: str) -> None:
        if name in self.failing:
            self.failing.discard(name)
            raise ServerError(f"{name} did not load")
        self.loaded.append(name)


def _failing_rename(monkeypatch, faults: list[tuple[Path | None, Path | None, BaseException]]) -> None:
    """``os.rename`` failing once for each (source, target, error) of ``faults`` (None: any path)."""
    rename, left = os.rename, list(faults)

    def failing(source, target):
        for fault in left:
            if fault[0] in (None, Path(source)) and fault[1] in (None, Path(target)):
                left.remove(fault)
                raise fault[2]
        rename(source, target)

    monkeypatch.setattr(swap.os, "rename", failing)


def _denied(path: Path) -> PermissionError:
    return PermissionError(13, "Permission denied", str(path))


@pytest.mark.parametrize("end, name", [
    (0, "tiny"),            # the first old folder moved out
    (1, "tiny_encoder"),    # the new encoder moved in, the old one out, the ensemble swapped already
    (0, "tiny_tokenizer"),  # the last old folder moved out
    (1, "tiny_tokenizer"),  # the last rename
])
def test_a_swap_whose_rename_fails_part_way_leaves_the_repository_as_it_was(tmp_path, monkeypatch, end, name):
    repository, found = _model_set(tmp_path / "repo", "old"), _model_set(tmp_path / "found", "new")
    before = _contents(repository)
    ends = [None, None]
    ends[end] = repository / name
    _failing_rename(monkeypatch, [(*ends, _denied(repository / name))])
    server = _Server()
    with pytest.raises(RepositoryError, match="Permission denied.*the repository is as it was"):
        swap_in(found, repository, server)
    monkeypatch.undo()
    assert _contents(repository) == before
    assert server.loaded == [] and _retired(tmp_path) == []
    assert sorted(p.name for p in found.iterdir()) == list(NAMES)  # the new set back where the search removes it


def test_a_swap_interrupted_part_way_leaves_the_repository_as_it_was(tmp_path, monkeypatch):
    """Ctrl-C between two renames: those made are undone, and the interrupt goes on."""
    repository, found = _model_set(tmp_path / "repo", "old"), _model_set(tmp_path / "found", "new")
    before = _contents(repository)
    _failing_rename(monkeypatch, [(found / "tiny_encoder", None, KeyboardInterrupt())])
    with pytest.raises(KeyboardInterrupt):
        swap_in(found, repository, _Server())
    monkeypatch.undo()
    assert _contents(repository) == before and _retired(tmp_path) == []


def _kept_old_models(tmp_path: Path, repository: Path, message: str) -> None:
    """Every old model is in ``repository`` or in the retired folder ``message`` names, with its version."""
    retired = _retired(tmp_path)
    assert len(retired) == 1 and str(retired[0]) in message
    for name in NAMES:
        held = [folder / name for folder in (repository, retired[0])
                if (folder / name / "1" / "marker").is_file()
                and (folder / name / "1" / "marker").read_text() == f"old {name}"]
        assert held, f"the old {name} is lost"


def test_a_swap_whose_undo_fails_keeps_the_old_models_and_says_where(tmp_path, monkeypatch):
    """The new tokenizer cannot move in, and the new encoder, moved in already, cannot move back out: the old
    encoder cannot go back, and stays in the retired folder the error names."""
    repository, found = _model_set(tmp_path / "repo", "old"), _model_set(tmp_path / "found", "new")
    _failing_rename(monkeypatch, [(found / "tiny_tokenizer", None, _denied(repository / "tiny_tokenizer")),
                                  (repository / "tiny_encoder", found / "tiny_encoder",
                                   _denied(repository / "tiny_encoder"))])
    with pytest.raises(RepositoryError, match="undoing it failed for") as raised:
        swap_in(found, repository, _Server())
    monkeypatch.undo()
    _kept_old_models(tmp_path, repository, str(raised.value))


def test_a_swap_whose_load_fails_and_whose_undo_fails_keeps_the_old_models_and_says_where(tmp_path, monkeypatch):
    """The new encoder does not load, and its folder cannot move back out: the old one stays in the retired folder
    the error names, and the mixed repository is not loaded."""
    repository, found = _model_set(tmp_path / "repo", "old"), _model_set(tmp_path / "found", "new")
    _failing_rename(monkeypatch, [(repository / "tiny_encoder", found / "tiny_encoder",
                                   _denied(repository / "tiny_encoder"))])
    server = _Server(failing=["tiny_encoder"])
    with pytest.raises(RepositoryError, match="did not load; undoing it failed for") as raised:
        swap_in(found, repository, server)
    monkeypatch.undo()
    _kept_old_models(tmp_path, repository, str(raised.value))
    assert server.loaded == []


def test_a_swap_whose_load_fails_serves_the_old_models_again(tmp_path):
    repository, found = _model_set(tmp_path / "repo", "old"), _model_set(tmp_path / "found", "new")
    before = _contents(repository)
    server = _Server(failing=["tiny_encoder"])
    with pytest.raises(ServerError, match="did not load"):
        swap_in(found, repository, server)
    assert _contents(repository) == before and _retired(tmp_path) == []
    assert server.loaded == ["tiny_encoder", "tiny_tokenizer", "tiny"]  # the old set again, steps first


def test_a_dangling_link_named_like_a_served_model_is_swapped_out(tmp_path):
    """Where a link to a removed folder holds a model's name, the new folder still moves in (a folder cannot be
    renamed over a link)."""
    repository, found = _model_set(tmp_path / "repo", "old"), _model_set(tmp_path / "found", "new")
    shutil.rmtree(repository / "tiny_encoder")
    (repository / "tiny_encoder").symlink_to(tmp_path / "removed")
    server = _Server()
    assert swap_in(found, repository, server) == list(NAMES)
    assert (repository / "tiny_encoder" / "2" / "marker").read_text() == "new tiny_encoder"
    assert server.loaded == ["tiny_encoder", "tiny_tokenizer", "tiny"] and _retired(tmp_path) == []


def test_the_search_removes_its_folders_beside_a_repository_whose_name_holds_glob_characters(tmp_path):
    repository = _model_set(tmp_path / "repo[1]", "old")
    search = BackgroundSearch(ModelChoice(), repository, "tiny", server=None)
    assert search.out.is_dir()  # made beside the repository, marked as this process's
    staging = tmp_path / f".{search.out.name}.staging-{os.getpid()}-abc"
    staging.mkdir()
    other = tmp_path / f".{search.out.name.replace('[1]', '1')}.staging-{os.getpid()}-abc"  # matched by "[1]" unescaped
    other.mkdir()
    search._remove_folders()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["repo[1]", other.name])


def test_a_stopped_first_exports_staging_folder_goes_where_the_repositorys_name_holds_glob_characters(tmp_path):
    ended = subprocess.Popen([sys.executable, "-c", ""])
    ended.wait()
    staging = tmp_path / f".repo[1].staging-{ended.pid}-abc"
    other = tmp_path / f".repo1.staging-{ended.pid}-abc"  # another repository's, matched by "[1]" unescaped
    for folder in (staging, other):
        folder.mkdir()
    _stop_export(ended, tmp_path / "repo[1]", grace=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == [other.name]


def test_a_retired_folder_left_beside_the_repository_is_named_and_kept(tmp_path):
    """A swap's folder of the models it took out, left by a serve stopped during the swap (or an undo that failed):
    serve names it at start, never removes it; an empty one, or another repository's, is not named."""
    from nexus_sli.exporter.serving.swap import retired_left

    repository = _model_set(tmp_path / "repo[1]", "new")
    left = _model_set(tmp_path / ".repo[1]-retired-abc", "old")
    (tmp_path / ".repo[1]-retired-empty").mkdir()
    _model_set(tmp_path / ".repo1-retired-abc", "another's")
    assert retired_left(repository) == [left]
