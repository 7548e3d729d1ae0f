"""The folders serve makes for itself (the server's backend folder, the shadows of the repository, the search's
repository), marked as this process's while it lives, so that a later serve removes those of one killed outright.

A serve killed by SIGKILL removes nothing: :mod:`parent_death` stops what it started, but its folders stay.  The
mark is a lock (``flock``) on a file in the folder, which the kernel frees when the process dies: a live serve's
folder is told from a dead one's even where process ids mean nothing (another container's namespace, a reused id).
"""

from __future__ import annotations

import fcntl
import glob
import os
import shutil
import tempfile
from pathlib import Path

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
    fd = os.open(pending, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # a file system without locks: left unmarked, so no other serve ever removes it
        os.close(fd)
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
        try:
            fd = os.open(folder / MARK, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # taken: its owner is gone (held: it lives, this one too)
        except OSError:
            continue
        else:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
        finally:
            os.close(fd)
    return removed
