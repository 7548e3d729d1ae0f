"""The folders serve makes for itself (the server's backend folder, the shadows of the repository, the search's
repository), marked as this process's while it lives, so that a later serve removes those of one killed outright.

A serve killed by SIGKILL removes nothing: :mod:`parent_death` stops what it started, but its folders stay.  The
mark is a lock on a file in the folder (:mod:`nexus_sli.exporter.triton.owner_lock`), which the kernel frees when
the process dies.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
from pathlib import Path

from nexus_sli.exporter.triton import owner_lock

#: the names in the temporary folder of those :func:`server.start` makes (its backend folder; the shadows of the
#: repository: GPU models moved to the CPU, each batched ensemble's steps joined)
BACKENDS_PREFIX, GPU_ON_CPU_PREFIX, JOINED_PREFIX = "nexus-sli-backends-", "nexus-sli-gpu-on-cpu-", "nexus-sli-joined-"
SERVER_PREFIXES = (BACKENDS_PREFIX, GPU_ON_CPU_PREFIX, JOINED_PREFIX)
#: the file in a folder whose lock its serve holds
MARK = ".nexus-sli-owner"

#: each folder this process made and has not removed: the descriptor that holds its mark's lock
_held: dict[Path, int] = {}


def make(prefix: str, parent: Path | None = None) -> Path:
    """A new folder (``tempfile.mkdtemp``'s), this process's until :func:`remove`."""
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    pending = folder / f"{MARK}.new"
    fd = owner_lock.hold(pending)
    if fd is None:  # a file system without locks: left unmarked, so no other serve ever removes it
        return folder
    os.rename(pending, folder / MARK)  # only a mark already locked is ever seen under its name
    _held[folder] = fd
    return folder


def remove(folder: Path) -> None:
    """Remove ``folder`` and let go of its mark."""
    shutil.rmtree(folder, ignore_errors=True)
    fd = _held.pop(Path(folder), None)
    if fd is not None:
        os.close(fd)


def remove_abandoned(prefix: str, parent: Path | None = None) -> list[Path]:
    """Remove the folders named ``prefix``... in ``parent`` (the temporary folder) whose serve has died; the
    folders removed.  A folder without a mark is left: one being made, or not made by :func:`make`."""
    removed = []
    for folder in Path(parent or tempfile.gettempdir()).glob(glob.escape(prefix) + "*"):
        state, fd = owner_lock.owner(folder / MARK)
        if state == owner_lock.DEAD:
            shutil.rmtree(folder, ignore_errors=True)
            os.close(fd)
            removed.append(folder)
    return removed
