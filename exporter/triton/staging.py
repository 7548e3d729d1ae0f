"""Writing into a Triton model repository without ever breaking it.

An export builds every model directory in a staging folder *beside* the
repository (Triton would try to load anything inside it), on the same file
system, and only when everything has validated moves each directory into
place with ``rename``.  A failed or killed export therefore leaves the served
repository exactly as it was; stale staging folders of dead exports are
removed by the next export.  A repository folder the export created is removed
again when it fails before publishing (it is then empty).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from nexus_sli.exporter.errors import RepositoryError

_STAGING = ".staging-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Staging:
    """``with Staging(out) as stage: ...; stage.publish()``"""

    def __init__(self, out: Path):
        self.out = Path(out)
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
        except OSError as exc:
            raise RepositoryError(f"cannot stage the export beside {self.out} ({exc}): an export builds each model "
                                  f"in {parent} and renames it in; make {parent} writable, or export into a "
                                  f"folder inside (--out {self.out / 'model_repository'}) and serve that") from exc
        self.work = self.root / ".work"  # scratch files that are never published
        self.work.mkdir()

    def _remove_stale(self) -> None:
        for stale in self.out.resolve().parent.glob(f".{self.out.name}{_STAGING}*"):
            pid = stale.name.rsplit(_STAGING, 1)[1].split("-")[0]
            if pid.isdigit() and not _pid_alive(int(pid)):
                shutil.rmtree(stale, ignore_errors=True)

    def model_dir(self, name: str) -> Path:
        path = self.root / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def publish(self, retire: tuple[str, ...] = ()) -> list[Path]:
        """Move every staged model directory into the repository, replacing old ones; then move the
        repository's models named in ``retire`` out (a step the new ensemble no longer uses)."""
        published = []
        self.out.mkdir(parents=True, exist_ok=True)  # another export into this new repository failed: it removed it
        retired = self.root / ".retired"
        retired.mkdir(exist_ok=True)
        staged_models = sorted(p for p in self.root.iterdir() if not p.name.startswith("."))
        for staged in staged_models:
            target = self.out / staged.name
            if target.exists():
                os.rename(target, retired / staged.name)
            os.rename(staged, target)
            published.append(target)
        for name in set(retire) - {p.name for p in staged_models}:  # after the ensemble that used it is replaced
            if (self.out / name).is_dir():
                os.rename(self.out / name, retired / name)
        return published

    def __enter__(self) -> "Staging":
        return self

    def __exit__(self, failed, *exc) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        if failed is not None:
            self._remove_created()

    def _remove_created(self) -> None:
        """The folders made for the repository, where the export failed: only while empty (nothing published)."""
        for folder in self._created:
            try:
                folder.rmdir()
            except OSError:  # something was written there after all: it stays, and so do the folders above it
                return


def replace_file(path: Path, data: bytes) -> None:
    """``data`` at ``path`` by a rename: readers (a serving Triton among them) see the old file or the new
    one, never a part."""
    partial = path.with_name(f".{path.name}.partial")
    with open(partial, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)
