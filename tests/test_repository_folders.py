"""An export's name never replaces another model's folders (exporter/triton/folders.py), and a repository an
export cannot rename into is refused before any work (exporter/triton/staging.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers.exports import MINILM
from nexus_sli.cli.main import main
from nexus_sli.exporter.errors import NexusError, RepositoryError
from nexus_sli.exporter.triton.folders import check_free, written_by
from nexus_sli.exporter.triton.staging import Staging


@pytest.fixture(scope="module")
def repo(tmp_path_factory, exports):
    """The default export, with its token ensemble, as ``tiny``."""
    out = tmp_path_factory.mktemp("repo")
    exports.copy(MINILM, out, as_name="tiny")
    return out


def test_the_folders_an_export_writes(repo):
    assert written_by("tiny") == {"tiny", "tiny_tokens", "tiny_tokenizer", "tiny_encoder", "tiny_postprocess"}
    assert {p.name for p in repo.iterdir() if p.is_dir()} <= written_by("tiny")


@pytest.mark.parametrize("name, clash", [
    ("tiny_encoder", "tiny_encoder"),  # the model's encoder step
    ("tiny_tokenizer", "tiny_tokenizer"),
    ("tiny_tokens", "tiny_tokens"),  # its token ensemble
])
def test_a_name_that_would_replace_another_models_folder_is_refused(repo, name, clash):
    with pytest.raises(NexusError, match=f"would replace {clash} .*which the model 'tiny"):
        check_free(repo, name)


def test_the_model_itself_and_unrelated_names_are_free(repo):
    check_free(repo, "tiny")  # exported again: its own folders
    check_free(repo, "other")
    check_free(repo / "missing", "tiny_encoder")  # a repository not made yet


def test_a_model_named_like_another_models_step_is_not_replaced_by_that_model(repo, tmp_path, exports):
    """A model exported as ``tiny_tokens`` is not ``tiny``'s token ensemble: exporting ``tiny`` would replace it."""
    out = tmp_path / "repo"
    exports.copy(MINILM, out, as_name="tiny_tokens")
    with pytest.raises(NexusError, match="would replace tiny_tokens .*which the model 'tiny_tokens'"):
        check_free(out, "tiny")


def test_the_cli_refuses_before_any_work_and_leaves_the_repository_as_it_was(repo, capsys):
    before = sorted((p.relative_to(repo), p.stat().st_mtime_ns) for p in repo.rglob("*"))
    assert main(["export", "--name", "tiny_encoder", "--out", str(repo)]) == 2
    assert "would replace tiny_encoder" in capsys.readouterr().err
    assert sorted((p.relative_to(repo), p.stat().st_mtime_ns) for p in repo.rglob("*")) == before


@pytest.mark.skipif(not os.path.ismount("/dev/shm") or not os.access("/dev/shm", os.W_OK),
                    reason="needs /dev/shm as a writable mount point of its own")
def test_a_mount_point_as_the_repository_is_refused_saying_where_to_export(tmp_path):
    """An export stages beside the repository and renames into it: from another file system no rename reaches a
    mount point's root (EXDEV), so it is refused before any work, naming a folder inside that works."""
    with pytest.raises(RepositoryError, match=r"/dev/shm is a mount point.*--out /dev/shm/model_repository"):
        Staging(Path("/dev/shm"))
    assert not list(Path("/dev").glob(".shm.staging-*"))
