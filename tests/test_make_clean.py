"""``make clean`` removes OUT's model folders and nothing else; ``make export`` and ``make serve`` pass on the
variables the README names (Makefile)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_make_clean_removes_the_model_folders_only(tmp_path):
    for model in ("tiny", "tiny_encoder"):
        (tmp_path / model / "1").mkdir(parents=True)
        (tmp_path / model / "config.pbtxt").write_text(f'name: "{model}"\n')
    (tmp_path / "src").mkdir()  # OUT=. by mistake: the checkout's own folders hold no config.pbtxt
    (tmp_path / "README.md").write_text("kept\n")
    subprocess.run(["make", "-s", "clean", f"OUT={tmp_path}"], cwd=ROOT, check=True, capture_output=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "src"]


def test_make_clean_refuses_no_repository():
    for out in ("", "/"):
        result = subprocess.run(["make", "-s", "clean", f"OUT={out}"], cwd=ROOT, capture_output=True, text=True)
        assert result.returncode != 0 and "names no repository" in result.stderr


def _dry_run(*args: str) -> str:
    return subprocess.run(["make", "-n", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def test_make_export_and_serve_pass_on_their_switches():
    switches = ["NO_SEARCH=1", "NO_TRUNCATE=1", "NO_CACHE=1", "ALLOW_PICKLE=1", "MAX_BATCH_SIZE=32"]
    flags = ["--no-search", "--no-truncate", "--no-cache", "--allow-pickle", "--max-batch-size '32'"]
    for target in ("export", "serve"):
        run = _dry_run(target, *switches)
        assert all(flag in run for flag in flags), (target, run)


def test_make_serve_of_a_gpu_export_passes_no_first_export_options(tmp_path):
    """``TARGET=gpu`` exports first, as make export does: serve then finds a model, and would say that the
    first export's options go unused."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.pbtxt").write_text('name: "m"\n')
    run = _dry_run("serve", "TARGET=gpu", f"OUT={tmp_path}", "MODEL=x", "NO_SEARCH=1")
    assert "nexus-sli serve" in run and "--model '" not in run and "--task" not in run and "--no-search" not in run
    assert "--model 'x'" in _dry_run("serve", f"OUT={tmp_path}", "MODEL=x")
