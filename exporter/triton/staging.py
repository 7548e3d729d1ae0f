"""Writing into a Triton model repository without ever breaking it.

An export builds every model directory in a staging folder *beside* the
repository (Triton would try to load anything inside it), on the same file
system, and only when everything has validated moves each directory into
place with ``rename``; a publish that fails part-way through is undone.  A
failed export, or one killed before it publishes, therefore leaves the served
repository exactly as it was; stale staging folders of dead exports are removed
by the next export.  One killed while it moved its validated models in (between
two renames) left the repository with some of them: the next export moves in
the rest first.  Each export holds a lock on its staging folder, which the kernel frees when the
process dies: a live export is told from a dead one even where its process id
means nothing (another container's PID namespace, a reused id).  A repository
folder the export created is removed again when it fails before publishing (it
is then empty).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from nexus_sli.exporter.errors import RepositoryError
from nexus_sli.exporter.triton import owner_lock

_STAGING = ".staging-"
#: the file in a staging folder its export holds a lock on while it runs
_LOCK = ".lock"
#: the file a staging folder holds while its export moves its models in: the models ``retire`` names, as JSON
_PUBLISHING = ".publishing"

log = logging.getLogger(__name__)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _claim(folder: Path) -> tuple[bool, int | None]:
    """(dead, lock): whether the export of the staging ``folder`` has died, by its lock, else by the process id
    in its name (a folder made just before its lock, by an older export, or on a file system without locks);
    where dead, the lock now held on its behalf (None where it has none), so that one export alone clears it."""
    state, fd = owner_lock.owner(folder / _LOCK)
    if state != owner_lock.UNMARKED:
        return state == owner_lock.DEAD, fd
    pid = folder.name.rsplit(_STAGING, 1)[1].split("-")[0]
    return not _pid_alive(int(pid)), None


def _dead_stagings(out: Path) -> Iterator[Path]:
    """Each staging folder of a dead export into ``out``, its lock held on the dead export's behalf until the next
    is asked for (one export alone clears it)."""
    prefix = f".{out.name}{_STAGING}"
    # escaped: a repository's name may hold glob characters ("repo[1]"); matched whole: another repository's
    # name may start like this one's (".repo.staging-1" beside "repo")
    for stale in Path(out).resolve().parent.glob(glob.escape(prefix) + "*"):
        if not re.fullmatch(re.escape(prefix) + r"\d+-[a-z0-9_]+", stale.name):
            continue
        dead, lock = _claim(stale)
        try:
            if dead:
                yield stale
        finally:
            if lock is not None:
                os.close(lock)


def remove_dead_stagings(out: Path) -> None:
    """The staging folders of dead exports into ``out``, removed without finishing a publish: for a repository
    that goes itself (the search's of a serve killed outright, whose export may have been killed mid-way)."""
    for stale in _dead_stagings(out):
        shutil.rmtree(stale, ignore_errors=True)


class Staging:
    """``with Staging(out) as stage: ...; stage.publish()``"""

    def __init__(self, out: Path):
        self.out = Path(out)
        #: set where a failed publish could not be undone: the staging folder holds the models it replaced
        self._keep = False
        #: the folders this export creates for the repository, deepest first: removed again if it fails
        self._created = [p for p in (self.out.absolute(), *self.out.absolute().parents) if not p.exists()]
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RepositoryError(f"cannot create repository {self.out}: {exc}") from exc
        parent = self.out.resolve().parent
        if os.stat(parent).st_dev != os.stat(self.out).st_dev:  # a mount point: no rename reaches it from beside
            raise RepositoryError(f"{self.out} is a mount point, and an export builds each model beside the "
                                  "repository and renames it in: export into a folder inside it (--out "
                                  f"{self.out / 'model_repository'}) and serve that folder")
        self._remove_stale()
        prefix = f".{self.out.name}{_STAGING}{os.getpid()}-"
        try:
            self.root = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
            self._lock = owner_lock.hold(self.root / _LOCK)
        except OSError as exc:
            raise RepositoryError(f"cannot stage the export beside {self.out} ({exc}): an export builds each model "
                                  f"in {parent} and renames it in; make {parent} writable, or export into a "
                                  f"folder inside (--out {self.out / 'model_repository'}) and serve that") from exc
        self.work = self.root / ".work"  # scratch files that are never published
        self.work.mkdir()

    def _remove_stale(self) -> None:
        """Remove the staging folders of dead exports into this repository, first finishing the publish of one
        killed while it moved its models in."""
        for stale in _dead_stagings(self.out):
            if self._finish(stale):
                shutil.rmtree(stale, ignore_errors=True)

    def _finish(self, stale: Path) -> bool:
        """Move in what a killed export had left to publish; whether ``stale`` may go."""
        if not (stale / _PUBLISHING).is_file():
            return True
        left = sorted(p.name for p in stale.iterdir() if not p.name.startswith("."))
        log.warning("an export into %s was killed while it moved its models in; moving in the rest: %s", self.out,
                    ", ".join(left) or "none")
        try:
            _publish(stale, self.out, tuple(json.loads((stale / _PUBLISHING).read_text())), Renames())
        except (OSError, ValueError) as exc:
            log.warning("could not finish it (%s): %s keeps them", exc, stale)
            return False
        return True

    def model_dir(self, name: str) -> Path:
        path = self.root / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def publish(self, retire: tuple[str, ...] = ()) -> list[Path]:
        """Move every staged model directory into the repository, replacing old ones; then move the
        repository's models named in ``retire`` out (a step the new ensemble no longer uses).  A rename that
        fails undoes those before it, so the repository keeps its old models, none missing or mixed with new;
        where the export is killed in between, the next export moves in the rest."""
        self.out.mkdir(parents=True, exist_ok=True)  # another export into this new repository failed: it removed it
        staged = sorted(p.name for p in self.root.iterdir() if not p.name.startswith("."))
        retire = tuple(sorted(set(retire) - set(staged)))  # what a resumed publish, staging less, still retires
        marker = self.root / _PUBLISHING
        marker.write_text(json.dumps(retire))
        moves = Renames()
        try:
            _publish(self.root, self.out, retire, moves)
        except BaseException as exc:  # Ctrl-C too: never leave a repository half-published
            marker.unlink()  # undone here, not finished by the next export
            error = self._undo(moves, exc)
            if isinstance(exc, OSError):
                raise error from exc
            raise
        marker.unlink()
        return [self.out / name for name in staged]

    def _undo(self, moves: "Renames", failure: BaseException) -> RepositoryError:
        """Undo ``moves``; the error to raise for ``failure``."""
        stuck = moves.undo()
        if not stuck:
            return RepositoryError(f"cannot publish into {self.out}: {failure}; the repository is as it was")
        self._keep = True  # the models it replaced are only there now
        return RepositoryError(f"cannot publish into {self.out}: {failure}; undoing it failed for "
                               f"{', '.join(stuck)}: the models it replaced are in {self.root / '.retired'}; move "
                               "them back before another export into this repository removes that folder")

    def __enter__(self) -> "Staging":
        return self

    def __exit__(self, failed, *exc) -> None:
        if not self._keep:
            shutil.rmtree(self.root, ignore_errors=True)
        if self._lock is not None:
            os.close(self._lock)
        if failed is not None:
            self._remove_created()

    def _remove_created(self) -> None:
        """The folders made for the repository, where the export failed: only while empty (nothing published)."""
        for folder in self._created:
            try:
                folder.rmdir()
            except OSError:  # something was written there after all: it stays, and so do the folders above it
                return


def _publish(root: Path, out: Path, retire: tuple[str, ...], moves: "Renames") -> None:
    """Move the models staged in ``root`` into ``out``, the ones they replace and those named in ``retire`` into
    ``root/.retired``, recording each rename in ``moves``.  Resumable: a model moved in already is no longer
    staged, and one whose old folder was moved out already has nothing to move out."""
    retired = root / ".retired"
    retired.mkdir(exist_ok=True)
    staged = sorted(p.name for p in root.iterdir() if not p.name.startswith("."))
    for name in staged:
        target = out / name
        if os.path.lexists(target):  # a dangling link too: a directory cannot be renamed over it
            moves.move(target, retired / name)
        moves.move(root / name, target)
    for name in retire:  # after the ensemble that used it is replaced
        if (out / name).is_dir() and not os.path.lexists(retired / name):
            moves.move(out / name, retired / name)


class Renames:
    """Folders moved one by one, each rename recorded as it is made, so that a failure part-way undoes the ones
    made and no others (here, and in a swap: :mod:`serving.swap`)."""

    def __init__(self):
        self.made: list[tuple[Path, Path]] = []

    def move(self, source: Path, target: Path) -> None:
        os.rename(source, target)
        self.made.append((source, target))

    def undo(self) -> list[str]:
        """Each rename undone, newest first; the ones that could not be, as ``"target (why)"``."""
        stuck = []
        for source, target in reversed(self.made):
            try:
                os.rename(target, source)
            except OSError as exc:
                stuck.append(f"{target} ({exc})")
        self.made.clear()
        return stuck


def replace_file(path: Path, data: bytes) -> None:
    """``data`` at ``path`` by a rename: readers (a serving Triton among them) see the old file or the new
    one, never a part."""
    partial = path.with_name(f".{path.name}.partial")
    with open(partial, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)
