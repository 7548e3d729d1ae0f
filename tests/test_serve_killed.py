"""What a serve killed outright (SIGKILL) leaves: its children end with it (exporter/serving/parent_death.py), and
its folders are removed by a later serve once it has died, not before (exporter/serving/temporary_folders.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from nexus_sli.exporter.serving import temporary_folders

from helpers.waiting import wait_until

PREFIX = "serve-folder-"


def _made_by_another_process(parent: Path, prefix: str = PREFIX) -> tuple[subprocess.Popen, Path]:
    """A process that makes a folder in ``parent`` and lives on; the folder."""
    process = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from nexus_sli.exporter.serving import temporary_folders\n"
        f"print(temporary_folders.make({prefix!r}, {str(parent)!r}), flush=True)\n"
        "time.sleep(120)\n")], stdout=subprocess.PIPE, text=True)
    return process, Path(process.stdout.readline().strip())


def test_a_folder_goes_once_its_process_has_died_and_not_before(tmp_path):
    process, theirs = _made_by_another_process(tmp_path)
    try:
        (theirs / "model").mkdir()
        ours = temporary_folders.make(PREFIX, tmp_path)
        unmarked = tmp_path / f"{PREFIX}unmarked"  # one being made, or made by an older serve
        unmarked.mkdir()
        assert temporary_folders.remove_abandoned(PREFIX, tmp_path) == []
        assert theirs.is_dir() and ours.is_dir() and unmarked.is_dir()
        process.send_signal(signal.SIGKILL)
        process.wait()
        assert temporary_folders.remove_abandoned(PREFIX, tmp_path) == [theirs]
        assert not theirs.exists() and ours.is_dir() and unmarked.is_dir()
    finally:
        process.kill()
        process.wait()
    temporary_folders.remove(ours)
    assert not ours.exists() and ours not in temporary_folders._held
    assert sorted(p.name for p in tmp_path.iterdir()) == [unmarked.name]


def test_a_child_armed_to_die_with_its_parent_gets_the_signal_asked_for(tmp_path):
    # serve's export is told by SIGINT, on which it removes its staging folder, as on a Ctrl-C
    said = tmp_path / "said"
    child = tmp_path / "child.py"
    child.write_text("import time\n"
                     "try:\n"
                     f"    open({str(said)!r}, 'w').write('waiting')\n"
                     "    time.sleep(120)\n"
                     "except KeyboardInterrupt:\n"
                     f"    open({str(said)!r}, 'w').write('interrupted')\n")
    parent = subprocess.Popen([sys.executable, "-c", (
        "import signal, subprocess, sys, time\n"
        "from nexus_sli.exporter.serving.parent_death import dies_with_parent\n"
        f"subprocess.Popen([sys.executable, {str(child)!r}], preexec_fn=dies_with_parent(signal.SIGINT))\n"
        "print('started', flush=True)\n"
        "time.sleep(120)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "started"
        wait_until(lambda: said.is_file() and said.read_text() == "waiting", "the child to start", timeout=30)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        wait_until(lambda: said.is_file() and said.read_text() == "interrupted", "the child's KeyboardInterrupt",
                   timeout=30)
    finally:
        parent.kill()
        parent.wait()


def test_the_next_serve_removes_a_killed_serves_search_and_its_dead_exports_staging(tmp_path):
    from nexus_sli.exporter.serving.search import remove_abandoned_searches

    repository = tmp_path / "repo"
    repository.mkdir()
    process, search = _made_by_another_process(tmp_path, prefix=".repo-search-")
    ended = subprocess.Popen([sys.executable, "-c", ""])  # the search's export, gone too
    ended.wait()
    staging = tmp_path / f".{search.name}.staging-{ended.pid}-abc"
    staging.mkdir()
    process.send_signal(signal.SIGKILL)
    process.wait()
    remove_abandoned_searches(repository)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo"]
