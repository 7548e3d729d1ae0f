"""Writing into a served repository (exporter/triton/staging.py): a publish that fails part-way is undone, one
killed part-way is finished by the next export, a dangling link does not stop one, and only dead exports'
staging folders are removed, told by their lock.  No export: staged folders stand in for models."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nexus_sli.exporter.errors import RepositoryError
from nexus_sli.exporter.triton import staging
from nexus_sli.exporter.triton.staging import Staging

OLD = ("tiny", "tiny_encoder", "tiny_postprocess", "tiny_tokenizer")
NEW = ("tiny", "tiny_encoder", "tiny_tokenizer")


def _repository(out: Path) -> Path:
    for name in OLD:
        (out / name / "1").mkdir(parents=True)
        (out / name / "config.pbtxt").write_text(f"old {name}")
    return out


def _contents(out: Path) -> dict[str, str]:
    return {str(p.relative_to(out)): p.read_text() if p.is_file() else "" for p in sorted(out.rglob("*"))}


def _stage(stage: Staging) -> None:
    for name in NEW:
        (stage.model_dir(name) / "config.pbtxt").write_text(f"new {name}")


def _dead_pid() -> int:
    """A process id no process has: past the kernel's largest."""
    return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1


def _staging_folders(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f".{out.name}.staging-*"))


@pytest.mark.parametrize("failing, end", [
    ("tiny_tokenizer", 0),     # the old tokenizer moved out
    ("tiny_tokenizer", 1),     # the new one moved in, the old already out
    ("tiny_postprocess", 0),   # the step the new ensemble no longer uses retired
])
def test_a_publish_that_fails_part_way_leaves_the_repository_as_it_was(tmp_path, monkeypatch, failing, end):
    """A rename fails after the ensemble and the encoder were moved in: every earlier rename is undone, so no
    model is missing and none is new beside old ones."""
    out = _repository(tmp_path / "repo")
    before = _contents(out)
    rename, failed = os.rename, []

    def failing_rename(*ends):
        if Path(ends[end]) == out / failing and not failed:  # once: undoing it may rename there
            failed.append(ends)
            raise PermissionError(13, "Permission denied", str(ends[0]))
        rename(*ends)

    monkeypatch.setattr(staging.os, "rename", failing_rename)
    with pytest.raises(RepositoryError, match="Permission denied.*the repository is as it was"):
        with Staging(out) as stage:
            _stage(stage)
            stage.publish(retire=("tiny_postprocess",))
    monkeypatch.undo()
    assert _contents(out) == before
    assert _staging_folders(out) == []


#: a publish of NEW over OLD, retiring tiny_postprocess, SIGKILLed right after the rename into argv[2]
KILLED_PUBLISH = """
import os, signal, sys
from pathlib import Path
from nexus_sli.exporter.triton import staging
out, into = Path(sys.argv[1]), sys.argv[2]
rename = os.rename
def rename_then_die(source, target):
    rename(source, target)
    if str(Path(target).relative_to(Path(target).parent.parent)) == into:
        os.kill(os.getpid(), signal.SIGKILL)
stage = staging.Staging(out)
for name in sys.argv[3:]:
    (stage.model_dir(name) / "config.pbtxt").write_text(f"new {name}")
staging.os.rename = rename_then_die
stage.publish(retire=("tiny_postprocess",))
"""


@pytest.mark.parametrize("into", [
    "repo/tiny",                        # the new ensemble in, its steps old
    ".retired/tiny_tokenizer",          # the old tokenizer out, the new not yet in: none there
    "repo/tiny_tokenizer",              # every model in, the unused step not yet retired
])
def test_a_publish_killed_part_way_is_finished_by_the_next_export(tmp_path, into):
    out = _repository(tmp_path / "repo")
    killed = subprocess.run([sys.executable, "-c", KILLED_PUBLISH, str(out), into, *NEW], capture_output=True,
                            text=True, timeout=60)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert _contents(out) != _new_contents(), "killed before it had published every model"
    with Staging(out):
        assert _contents(out) == _new_contents()
    assert _staging_folders(out) == []


def _new_contents() -> dict[str, str]:
    return {**{name: "" for name in NEW}, **{f"{name}/config.pbtxt": f"new {name}" for name in NEW}}


def test_a_dangling_link_named_like_a_model_is_replaced(tmp_path):
    out = _repository(tmp_path / "repo")
    (out / "tiny_encoder" / "config.pbtxt").unlink()
    (out / "tiny_encoder" / "1").rmdir()
    (out / "tiny_encoder").rmdir()
    (out / "tiny_encoder").symlink_to(tmp_path / "unmounted" / "tiny_encoder")
    with Staging(out) as stage:
        _stage(stage)
        stage.publish()
    assert (out / "tiny_encoder" / "config.pbtxt").read_text() == "new tiny_encoder"
    assert not (out / "tiny_encoder").is_symlink()


def test_a_live_exports_staging_folder_is_kept_whatever_its_process_id_says(tmp_path):
    """An export in another PID namespace (another container writing the same volume): its process id names no
    process here, but it holds its staging folder's lock, so another export leaves the folder alone."""
    out = tmp_path / "repo"
    with Staging(out) as live:
        foreign = live.root.with_name(f".repo.staging-{_dead_pid()}-abc")
        os.rename(live.root, foreign)
        live.root = foreign
        with Staging(out):
            assert foreign.is_dir()
    assert _staging_folders(out) == []


def test_a_dead_exports_staging_folder_is_removed_though_its_process_id_was_reused(tmp_path):
    """Its lock is free: the export died, whichever process has its id now (here: this one)."""
    out = tmp_path / "repo"
    dead = tmp_path / f".repo.staging-{os.getpid()}-abc"
    (dead / "tiny_encoder").mkdir(parents=True)
    (dead / ".lock").touch()
    with Staging(out):
        assert not dead.exists()


def test_a_dead_exports_staging_folder_is_removed_where_the_repositorys_name_has_glob_characters(tmp_path):
    out = tmp_path / "repo[1]"
    dead = tmp_path / f".repo[1].staging-{_dead_pid()}-abc"
    (dead / "tiny_encoder").mkdir(parents=True)
    with Staging(out):
        assert not dead.exists()
