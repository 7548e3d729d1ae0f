"""The one reader of pickle files: every ``torch.save`` file an export reads comes through :func:`read_state_dict`.

A checkpoint's ``pytorch_model.bin`` (and its shards), a sentence-transformers Dense module's
``pytorch_model.bin``, BGE-M3's ``sparse_linear.pt`` and ``colbert_linear.pt``, a Stanford ColBERT
projection: all are pickles, and unpickling can call any function the file names.  One policy holds
for all of them (docs/export.md says it to users):

- a pickle file is read only where the user passed ``--allow-pickle`` (they trust its source);
  otherwise :class:`UnsafeCheckpointError` names the file and the flag;
- it is then read with torch's weights-only unpickler, which builds tensors and plain containers and
  refuses anything else (a class, a function call) before calling it; a refused file, or one that
  is no state dict (names to tensors), is a :class:`CheckpointError` naming the file, in one line.

torch is imported here only when a file is read: ``nexus-sli validate`` on a serving host imports the
modules that call this without having PyTorch.
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path
from typing import Any

from nexus_sli.exporter.errors import CheckpointError, UnsafeCheckpointError

#: where torch's weights-only unpickler says why it refused a file, in its many-line message
_REFUSAL = re.compile(r"WeightsUnpickler error:\s*(.*?)(?:\.\s|\n\n|$)", re.S)


def read_state_dict(file: Path, allow_pickle: bool) -> dict[str, Any]:
    """The state dict (name -> ``torch.Tensor``) pickled at ``file``, read under the module's policy."""
    if not allow_pickle:
        raise UnsafeCheckpointError(
            f"{file} is a pickle file; loading pickle can run arbitrary code. Convert it to safetensors, or pass "
            "--allow-pickle (make: ALLOW_PICKLE=1) if you trust the source (it is then read as tensors only)")
    import pickle

    import torch

    try:
        # torch.save's zip format (since torch 1.6) is mapped, not read into memory; older files cannot be mapped
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(file))
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"{file} holds more than tensors and was not loaded (torch's weights-only unpickler: "
                              f"{_reason(exc)}); nothing in it ran") from exc
    except Exception as exc:  # torch raises many types for a file cut short or no torch.save file at all
        raise CheckpointError(f"{file} is not a readable torch.save file "
                              f"({_one_line(f'{type(exc).__name__}: {exc}')})") from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"{file} holds {type(state).__name__}; expected a state dict (names to tensors)")
    odd = next((key for key, value in state.items()
                if not (isinstance(key, str) and isinstance(value, torch.Tensor))), None)
    if odd is not None:
        raise CheckpointError(f"{file} holds {odd!r}: {type(state[odd]).__name__}; a state dict holds tensors only")
    return state


def _reason(exc: Exception) -> str:
    """The unpickler's own reason (``Unsupported global: GLOBAL io.open ...``), without torch's advice around it."""
    found = _REFUSAL.search(str(exc))
    return _one_line(found.group(1) if found and found.group(1).strip() else str(exc))


def _one_line(text: str, limit: int = 200) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit - 3] + "..."
