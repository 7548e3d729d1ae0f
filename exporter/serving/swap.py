"""Swap a served model set for a new export of it, with no failed call.

The new set (the tokenizer, encoder and ensembles an export wrote into a repository of its own) takes the
served one's place folder by folder, each at the next version number, and the server loads it model by
model, the steps before the ensembles that call them.  Triton keeps serving a model's loaded version until
its new one has loaded, and only then unloads the old: calls in flight finish on the old graph, the next
ones run on the new.  A client that sees the new version number in an answer reads the model's description
again (its precision and backend).  While both are loaded the server holds the old encoder and the new one.

Where ``nexus-sli serve`` joins each ensemble's steps in one process, the joined model's shadow entries are
written again for the new steps (:func:`joined_steps.refresh`) before it is loaded.  A model that fails to
load puts the old folders back and loads those again: what was served stays served.  A rename that fails
part-way (or a Ctrl-C) undoes the renames made before it, newest first; where undoing one fails too, the folder
the old models were moved into stays beside the repository, and the error names it.

A caller that made the new set while the repository served (the search of :mod:`search`) first compares
:func:`stamp` of the folders with the one it took when it began: a changed stamp means the user exported
those names meanwhile, and swapping would delete that export.
"""

from __future__ import annotations

import compileall
import contextlib
import glob
import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from nexus_sli.exporter.errors import RepositoryError
from nexus_sli.exporter.triton import config as tc
from nexus_sli.exporter.triton.folders import newest_version
from nexus_sli.exporter.triton.staging import Renames

from .joined_steps import refresh

log = logging.getLogger(__name__)


def models_in(repository: Path) -> list[str]:
    """The model folders of ``repository`` (those with a config)."""
    return sorted(p.name for p in repository.iterdir() if (p / "config.pbtxt").is_file())


#: the files of a model folder whose content a re-export changes (the encoder's report among them)
STAMPED_FILES = ("config.pbtxt", "validation.json")


def stamp(repository: Path) -> dict[str, tuple]:
    """What ``repository`` holds now, per model folder: the folder's identity (an export renames a new folder
    into place) and the digests of its :data:`STAMPED_FILES`.  Two stamps differ where a model was exported,
    removed or added between them."""
    stamps = {}
    for name in models_in(repository):
        try:
            stamps[name] = _folder_stamp(repository / name)
        except FileNotFoundError:  # moved away since it was listed (an export replacing it): absent now
            continue
    return stamps


def _folder_stamp(folder: Path) -> tuple:
    identity = folder.stat().st_ino
    digests = [hashlib.sha256(folder.joinpath(f).read_bytes()).hexdigest() if folder.joinpath(f).is_file() else None
               for f in STAMPED_FILES]
    return (identity, *digests)


def _load_order(repository: Path, names: list[str]) -> list[str]:
    """``names`` with the ensembles last: an ensemble is loaded once the steps it calls are."""
    return sorted(names, key=lambda name: (tc.read(repository / name / "config.pbtxt").platform == "ensemble", name))


def swap_in(found: Path, repository: Path, server) -> list[str]:
    """Serve ``found``'s models (an export's repository, left empty) in place of ``repository``'s of the same
    names, on ``server`` (the :class:`~.launcher.TritonServer` serving ``repository``, with its supervisor);
    the names swapped.  Raises (after putting the served set back) where the server fails to load one, and a
    :class:`RepositoryError` where the folders cannot be moved (the repository as it was, or where the old
    models then are)."""
    names = models_in(found)
    version = 1 + max((newest_version(repository / name) for name in names if (repository / name).is_dir()),
                      default=0)
    for name in names:  # every model of the set at one new version: the number clients compare
        for old in [p for p in (found / name).iterdir() if p.is_dir() and p.name.isdigit()]:
            os.rename(old, found / name / str(version))
    # The python steps' bytecode written now, not by their first load: Triton reads a folder written to after a
    # model loaded as a changed model, and loads it again with the next ensemble that calls it.
    compileall.compile_dir(found, quiet=1)
    retired = Path(tempfile.mkdtemp(prefix=_retired_prefix(repository), dir=repository.parent))
    moves = Renames()
    try:
        _move_in(found, repository, retired, names, moves)
    except BaseException as exc:  # Ctrl-C too: never leave the served repository half-swapped
        _undo(moves, repository, retired, exc)
        if isinstance(exc, OSError):
            raise RepositoryError(f"cannot swap the new {', '.join(names)} into {repository}: {exc}; the "
                                  "repository is as it was, and the server serves what it served") from exc
        raise
    with server.supervisor.swapping(names):
        try:
            _load(repository, names, server)
        except BaseException as exc:
            log.error("the new models did not load (%s); putting the ones served before back", exc)
            _undo(moves, repository, retired, exc)
            _load(repository, names, server)
            raise
    shutil.rmtree(retired, ignore_errors=True)
    log.info("serving the new %s at version %d", ", ".join(names), version)
    return names


def _retired_prefix(repository: Path) -> str:
    return f".{repository.name}-retired-"


def retired_left(repository: Path) -> list[Path]:
    """The folders of models a swap took out of ``repository`` that are still there: its undo failed, or its serve
    stopped in the middle.  Never removed by serve: they may hold the models the repository served."""
    repository = Path(repository).resolve()
    return sorted(folder for folder in repository.parent.glob(glob.escape(_retired_prefix(repository)) + "*")
                  if folder.is_dir() and any(folder.iterdir()))


def _move_in(found: Path, repository: Path, retired: Path, names: list[str], moves: Renames) -> None:
    """Each of ``names`` from ``found`` into ``repository``, the folder it replaces into ``retired``."""
    for name in names:
        if os.path.lexists(repository / name):  # a dangling link too: a folder cannot be renamed over it
            moves.move(repository / name, retired / name)
        moves.move(found / name, repository / name)


def _undo(moves: Renames, repository: Path, retired: Path, failure: BaseException) -> None:
    """Undo ``moves`` (the served folders back in ``repository``, the new ones back where they came from), then
    remove the emptied ``retired``.  Where a rename back fails, ``retired`` holds served models: it stays, and
    the :class:`RepositoryError` raised says where it is."""
    stuck = moves.undo()
    if stuck:
        raise RepositoryError(f"cannot swap the new models into {repository}: {failure}; undoing it failed for "
                              f"{', '.join(stuck)}: the models served before are in {retired}; move them back into "
                              f"{repository} before the server starts again") from failure
    with contextlib.suppress(OSError):  # left where something unforeseen is in it
        retired.rmdir()


def _load(repository: Path, names: list[str], server) -> None:
    """Have ``server`` load ``names`` as ``repository`` holds them (through its joined shadow, where it has one)."""
    joined = getattr(server, "joined", None)
    if joined is not None:
        shadow, backends = joined
        refresh(repository, shadow, backends, names)
    for name in _load_order(repository, names):
        server.supervisor.load(name)

