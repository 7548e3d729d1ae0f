"""``make clean`` removes OUT's model folders and nothing else (Makefile)."""

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
