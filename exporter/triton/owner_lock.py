"""A folder marked as a live process's: a file in it that the process holds a lock (``flock``) on.

The kernel frees the lock when the process dies, so a live owner is told from a dead one even where process ids
mean nothing (another container's PID namespace, a reused id).  Whoever takes a dead owner's lock holds it until
done with the folder, so that one process alone clears it.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Literal

#: :func:`owner`'s answers: a live process holds the lock; its owner died (the lock now taken); no lock to tell
#: by (no such file, or a file system without locks)
LIVE, DEAD, UNMARKED = "live", "dead", "unmarked"


def hold(path: Path) -> int | None:
    """A lock on ``path`` (created), held until the returned descriptor is closed or the process dies; None on a
    file system without locks."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def owner(path: Path) -> tuple[Literal["live", "dead", "unmarked"], int | None]:
    """Whether the process that locked ``path`` lives; where it died, the descriptor that now holds its lock (the
    caller closes it once done with the folder)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return UNMARKED, None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        return (LIVE if isinstance(exc, BlockingIOError) else UNMARKED), None
    return DEAD, fd
