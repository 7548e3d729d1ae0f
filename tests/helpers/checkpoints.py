"""Editing a saved checkpoint the way a damaged or unusual download would look."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

from safetensors.torch import load_file, save_file


def copy_checkpoint(source: Path, tmp_path: Path) -> Path:
    """A copy of ``source`` to edit without touching the session's shared checkpoint."""
    return Path(shutil.copytree(source, tmp_path / "ckpt"))


def edit_weights(directory: Path, change: Callable[[dict], object]) -> None:
    """Apply ``change`` to the tensors of ``directory/model.safetensors`` and save them back."""
    path = directory / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
