"""The files of the exporter's on-disk caches (:mod:`layer_cache`, :mod:`candidate_cache`).

Each cache is a directory of entry files of one suffix.  Writes go to a
temporary file in that directory, are fsynced and then ``os.replace``\\ d into
place, so a killed process leaves either the old entry, the new one, or
nothing; a temporary file names its writer's pid, so one a dead writer left is
removed when a cache next opens the directory.  Recency lives in the entries'
modification times: a hit touches the file, and keeping a cache within its
size bound removes the least recently used first.

There are no locks: every operation tolerates an entry vanishing under it
(another process evicted it), and two writers of one entry both write complete
files, the last ``os.replace`` winning.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger(__name__)

TEMP_SUFFIX = ".tmp"

#: Environment variable naming the default cache directory (CI and tests point it at a scratch folder).
CACHE_DIR_ENV = "NEXUS_SLI_CACHE_DIR"


def default_cache_dir() -> Path:
    """$NEXUS_SLI_CACHE_DIR, else ${XDG_CACHE_HOME:-~/.cache}/nexus-sli/layers: the layer cache's folder, in
    which the candidate cache keeps a folder of its own."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV])
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "nexus-sli" / "layers"

_last_tick = 0


def tick() -> int:
    """A nanosecond timestamp, strictly increasing within this process (ties would blur LRU order).

    Not locked: two threads racing here at worst share a timestamp, which only
    makes their two entries' relative order arbitrary.
    """
    global _last_tick
    _last_tick = max(time.time_ns(), _last_tick + 1)
    return _last_tick


def touch(path: Path) -> None:
    """Mark ``path`` as just used, where this process may: recency only orders evictions, so an entry it cannot
    mark (another user's in a shared cache, a read-only mount) is still a hit."""
    now = tick()
    try:
        os.utime(path, ns=(now, now))
    except FileNotFoundError:  # evicted by another process meanwhile: nothing to mark
        pass
    except OSError as exc:
        log.debug("cannot mark %s as used (%s)", path.name, exc)


def unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def discard(path: Path, what: str) -> None:
    """Delete a damaged entry where this process may; one it cannot delete stays a miss for it."""
    try:
        unlink(path)
    except OSError as exc:
        log.warning("%s: cannot delete %s (%s); it stays, and is a miss", what, path.name, exc)


def _fsync_directory(directory: Path) -> None:
    # The rename is durable only once the directory itself is on disk.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Have ``write`` fill ``path`` so that readers see the old file, the new one, or none."""
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=TEMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        unlink(Path(temp))
        raise
    _fsync_directory(path.parent)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, it is just someone else's
        return True
    return True


def _writer_pid(temp: Path, suffix: str) -> int | None:
    """The pid a temp file name carries (``.<entry>.<pid>.<random>.tmp``), or None if not one of ours."""
    parts = temp.name.rsplit(".", 3)
    if len(parts) != 4 or not parts[0].endswith(suffix) or not parts[1].isdigit():
        return None
    return int(parts[1])


def remove_dead_temps(directory: Path, suffix: str, what: str) -> None:
    """Remove the temporary files of ``suffix`` entries whose writer died before its ``os.replace``
    (one whose writer is alive may be in the middle of a write)."""
    for temp in directory.glob(".*" + TEMP_SUFFIX):
        pid = _writer_pid(temp, suffix)
        if pid is not None and not _pid_alive(pid):
            log.info("%s: removing %s left by dead writer %d", what, temp.name, pid)
            unlink(temp)


def entries(directory: Path, suffix: str) -> list[tuple[int, Path, int]]:
    """(last use in ns, path, bytes) of every entry, least recently used first."""
    found = []
    for path in directory.glob("*" + suffix):
        try:
            stat = path.stat()
        except FileNotFoundError:
            continue
        found.append((stat.st_mtime_ns, path, stat.st_size))
    return sorted(found)


def make_room(directory: Path, suffix: str, incoming: int, max_bytes: float, replacing: Path, what: str) -> None:
    """Evict least recently used entries until ``incoming`` more bytes fit within ``max_bytes``."""
    kept = [entry for entry in entries(directory, suffix) if entry[1] != replacing]
    total = sum(size for _, _, size in kept)
    for _, path, size in kept:
        if total + incoming <= max_bytes:
            break
        log.info("%s: evicting %s (%d bytes, least recently used)", what, path.name, size)
        unlink(path)
        total -= size
