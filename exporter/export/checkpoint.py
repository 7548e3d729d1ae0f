"""Lazy access to a checkpoint's tensors, one tensor at a time.

Safetensors files (single or sharded through ``model.safetensors.index.json``)
are memory-mapped and read key by key, so walking a model never holds more
than one layer's weights plus the model being assembled.  Pickle checkpoints
(``pytorch_model.bin``) can execute code when loaded, so they are read only
when the caller explicitly allows it, and only as tensors (:mod:`pickles`).
"""

from __future__ import annotations

import json
import os
import struct
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from nexus_sli.exporter.errors import CheckpointError, UnsafeCheckpointError

from .pickles import read_state_dict

# TF-era BERT checkpoints name LayerNorm parameters gamma/beta; torch names them weight/bias.
_LEGACY_SUFFIXES = {".gamma": ".weight", ".beta": ".bias"}


def _file_identity(file: Path) -> dict:
    """What says a file is unchanged without reading it: path, size, inode, mtime and ctime.

    ctime cannot be set by ``touch``/``cp -p``, so a rewrite that restores the
    old mtime still changes the identity.
    """
    stat = os.stat(file)
    return {"path": str(file.resolve()), "size": stat.st_size, "inode": stat.st_ino,
            "mtime_ns": stat.st_mtime_ns, "ctime_ns": stat.st_ctime_ns}


def _header(file: Path) -> dict:
    """The JSON header of a safetensors file (dtype, shape, data offsets per tensor): 8 + N bytes read."""
    with open(file, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return json.loads(handle.read(length))


def _cut_off(file: Path) -> str:
    """For a file cut short: the tensors whose data lies past its end, named (else "")."""
    try:
        header = _header(file)
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
        available = file.stat().st_size - 8 - length
        missing = sorted(key for key, entry in header.items()
                         if key != "__metadata__" and entry["data_offsets"][1] > available)
    except Exception:  # noqa: BLE001 - the header itself is unreadable: nothing more to say
        return ""
    if not missing:
        return ""
    return f"; the file is truncated: the data of {len(missing)} tensor(s) is cut off: {', '.join(missing)}"


def _modern_name(key: str) -> str:
    for old, new in _LEGACY_SUFFIXES.items():
        if key.endswith(old):
            return key[: -len(old)] + new
    return key


class Checkpoint:
    """Read-only view of a checkpoint directory's tensors, keyed by modern names."""

    def __init__(self, directory: str | Path, allow_pickle: bool = False):
        self.directory = Path(directory)
        self._stack = ExitStack()
        self._handles: dict[Path, object] = {}
        self._pickled: dict[str, torch.Tensor] = {}
        self._where: dict[str, tuple[Path, str]] = {}
        #: file -> (identity, header), taken before the file is opened so that a
        #: change while it is read shows up as a different identity next time
        self._sources: dict[Path, tuple[dict, dict]] = {}
        files = self._safetensors_files()
        if files:
            self.format = "safetensors"
            for file in files:
                identity = _file_identity(file)
                try:
                    handle = self._stack.enter_context(safe_open(str(file), framework="pt"))
                    self._sources[file] = (identity, _header(file))
                except Exception as exc:  # safetensors' own error types for truncated/corrupt headers
                    raise CheckpointError(f"{file.name} is not a readable safetensors file: {exc}"
                                          f"{_cut_off(file)}") from exc
                self._handles[file] = handle
                for key in handle.keys():
                    self._where[_modern_name(key)] = (file, key)
        else:
            self.format = "pickle"
            self._load_pickle(allow_pickle)

    def _safetensors_files(self) -> list[Path]:
        index = self.directory / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({self.directory / name for name in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(f"{index.name} lists shards that are missing: {', '.join(missing)}")
            return files
        single = self.directory / "model.safetensors"
        return [single] if single.is_file() else []

    def _load_pickle(self, allow_pickle: bool) -> None:
        index = self.directory / "pytorch_model.bin.index.json"
        if index.is_file():
            files = sorted({self.directory / n for n in json.loads(index.read_text())["weight_map"].values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(f"{index.name} lists shards that are missing: {', '.join(missing)}")
        else:
            files = [self.directory / "pytorch_model.bin"]
        if not all(f.is_file() for f in files):
            raise CheckpointError(
                f"no weights in {self.directory}: expected model.safetensors, a sharded "
                "model.safetensors.index.json, or pytorch_model.bin"
            )
        if not allow_pickle:
            raise UnsafeCheckpointError(
                f"{self.directory} has only pickle weights ({files[0].name}); loading pickle can run "
                "arbitrary code. Convert it to safetensors, or pass --allow-pickle (make: ALLOW_PICKLE=1) if you "
                "trust the source."
            )
        for file in files:
            for key, tensor in read_state_dict(file, allow_pickle).items():
                self._pickled[_modern_name(key)] = tensor
                self._where[_modern_name(key)] = (file, key)

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def tensor_source(self, key: str) -> dict | None:
        """Where ``key``'s bytes live, without reading them: the file's identity
        (path, size, inode, mtime, ctime) and the tensor's header entry (stored
        name, dtype, shape, data offsets).  A source key for caching built from
        these changes whenever the file is rewritten.  None for pickle
        checkpoints, which have no header to read this from.
        """
        if key not in self._where:
            raise CheckpointError(f"tensor {key!r} is not in the checkpoint")
        if self.format != "safetensors":
            return None
        file, original = self._where[key]
        identity, header = self._sources[file]
        return {"file": identity, "name": original, **header[original]}

    def get(self, key: str) -> torch.Tensor:
        """One tensor, floating point promoted to fp32 (the export precision)."""
        if key not in self._where:
            raise CheckpointError(f"tensor {key!r} is not in the checkpoint")
        file, original = self._where[key]
        try:
            tensor = self._pickled[key] if self.format == "pickle" else self._handles[file].get_tensor(original)
        except Exception as exc:  # safetensors raises its own types for truncated files
            raise CheckpointError(f"tensor {key!r} could not be read from {file.name}: {exc}") from exc
        return tensor.float() if tensor.is_floating_point() else tensor

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
