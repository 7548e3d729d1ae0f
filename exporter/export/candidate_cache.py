"""An on-disk cache of the candidate graphs an export derives (quantized, above all), in the layer cache's spirit.

A second export of a model makes the same int8 graphs again: NNCF's static
quantization of each OpenVINO variant and of ONNX Runtime's static graph, ONNX
Runtime's dynamic quantization.  They are most of an ``auto`` export's time
after the walk (bench/data/tried.md, "Exports: one graph that passes alone").
This cache keeps what each such step wrote, so the next export restores it
instead.  Validation is no step of it: every candidate, restored or made, is
validated against PyTorch as before.

Each entry is one uncompressed tar file: a manifest, then the files the step
wrote (the graph, and what it reads beside it: an OpenVINO IR's ``.bin``, an
ONNX graph's ``.data``).  The manifest names the entry's key and each file's
size and SHA-256, checked as the file is restored: a damaged entry is deleted,
logged and a miss, and a restore that fails leaves nothing half written beside
the graph.  Files are written, kept within a size bound and evicted as the
layer cache's are (:mod:`cache_files`).

The key is a SHA-256 over what the graph depends on:

- the content of the graphs the step reads (the plain graph, or the pooled and
  padding-trimmed one OpenVINO quantizes), which carries everything that made
  them: the checkpoint's weights, the family, the task, the pooling, the export
  code; the plain ONNX export is deterministic, so the same model gives the
  same digest (``tests/test_candidate_cache.py``);
- the recipe: the step, the MatMuls kept in higher precision, SmoothQuant's
  alpha, a digest of the calibration feeds (texts, tokenizer, batching), the
  int8 settings, and the name the graph is written under (an ONNX graph names
  its data file);
- the versions of the libraries that write graphs (NNCF, OpenVINO, ONNX
  Runtime, ONNX; whichever distribution provides each module, such as
  ``onnxruntime-gpu``) and the source of the modules that call them.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import logging
import os
import re
import tarfile
import time
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from . import cache_files, onnx_files
from .cache_files import default_cache_dir

log = logging.getLogger(__name__)

_FORMAT = "nexus-sli-candidate-cache/1"
_ENTRY_SUFFIX = ".tar"
_MANIFEST = "manifest.json"
_WHAT = "candidate cache"
_GIB = 1024**3
#: the folder of the layer cache's directory the candidates live in
FOLDER = "candidates"
#: the libraries whose versions change what a step writes
LIBRARIES = ("nncf", "openvino", "onnxruntime", "onnx")
#: the modules (of this package) that call them: a change to their source is a new key
MAKERS = ("static_int8.py", "quantize.py", "onnx_files.py")
_CHUNK = 16 << 20
#: how long ago a file must have changed for its stat to stand for its content (FAT's mtime ticks are 2 s)
_SETTLED_NS = 2_000_000_000


def graph_files(path: Path) -> list[Path]:
    """The model file and what it reads beside it: an OpenVINO IR's weights, an ONNX graph's external data."""
    path = Path(path)
    if path.suffix == ".xml":
        return [path, path.with_suffix(".bin")]
    return onnx_files.files(path)


def graph_digest(path: Path) -> str:
    """SHA-256 over the bytes of a graph's files (:func:`graph_files`): its weights as well as its structure."""
    digest = hashlib.sha256()
    for file in graph_files(path):
        digest.update(_file_digest(file).encode())
    return digest.hexdigest()


def feeds_digest(feeds: list[Mapping[str, np.ndarray]]) -> str:
    """SHA-256 over every batch's arrays (name, dtype, shape, bytes): what a calibration reads."""
    digest = hashlib.sha256()
    for batch in feeds:
        for name in sorted(batch):
            array = np.ascontiguousarray(batch[name])
            digest.update(json.dumps([name, array.dtype.str, list(array.shape)]).encode())
            digest.update(memoryview(array).cast("B"))
    return digest.hexdigest()


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@functools.cache  # what a process has imported stays as it was, whatever is installed meanwhile
def _versions() -> dict[str, list[str]]:
    """Each library's installed distributions as ``name==version``, found by the module they provide: the
    ``onnxruntime`` module may come from ``onnxruntime-gpu`` (or another build), where a lookup by the module's
    name finds no version at all and an upgrade would leave the key as it was."""
    providers = metadata.packages_distributions()
    return {name: sorted(f"{dist}=={metadata.version(dist)}" for dist in set(providers.get(name, [])))
            for name in LIBRARIES}


def _code_digest() -> str:
    here = Path(__file__).parent
    return hashlib.sha256(b"".join((here / name).read_bytes() for name in MAKERS)).hexdigest()


class CandidateCache:
    """Derived graphs on disk by what they depend on (see the module docstring); ``max_cache_size_gb``
    bounds the entries' total size, the least recently used going first."""

    def __init__(self, cache_dir: str | os.PathLike, max_cache_size_gb: float = 10.0):
        self.cache_dir = Path(cache_dir)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_cache_size_gb * _GIB
        #: (path, size, mtime, ctime, inode) -> SHA-256: one export digests its plain graph once for every step
        #: (ctime: a rewrite that puts the old mtime back still changes it)
        self._digests: dict[tuple, str] = {}
        self._fixed = {"format": _FORMAT, "libraries": _versions(), "code": _code_digest()}
        cache_files.remove_dead_temps(self.cache_dir, _ENTRY_SUFFIX, _WHAT)

    def made(self, target: Path, make: Callable[[], Path], sources: list[Path], recipe: Mapping[str, Any]) -> Path:
        """The graph ``make()`` writes at ``target`` from the graphs ``sources`` by ``recipe``: restored where
        an earlier export cached it, else made and cached."""
        target = Path(target)
        key = self.key(target, sources, recipe)
        if self.restore(key, target):
            log.info("%s: restored from the candidate cache (made by an earlier export)", target.name)
            return target
        made = make()
        try:
            self.store(key, made)
        except OSError as exc:  # a full or read-only cache disk must not stop the export
            log.warning("candidate cache: could not store %s (%s); the export goes on", made.name, exc)
        return made

    def key(self, target: Path, sources: list[Path], recipe: Mapping[str, Any]) -> str:
        """The entry key of ``target`` made from ``sources`` by ``recipe`` (a JSON-able mapping)."""
        material = {**self._fixed, "file": Path(target).name, "recipe": dict(recipe),
                    "sources": [self._digest(file) for source in sources for file in graph_files(source)]}
        return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()

    def entry_path(self, key: str, name: str) -> Path:
        """Where the entry of ``key`` lives, with a readable prefix from the graph's file name."""
        readable = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[-48:]
        return self.cache_dir / f"{readable}-{key[:32]}{_ENTRY_SUFFIX}"

    def store(self, key: str, graph: Path) -> Path | None:
        """Cache ``graph`` and its files under ``key``; None where they alone pass the size bound."""
        files = graph_files(graph)
        manifest = {"format": _FORMAT, "key": key,
                    "files": [{"name": f.name, "size": f.stat().st_size, "sha256": _file_digest(f)} for f in files]}
        size = sum(entry["size"] for entry in manifest["files"])
        if size > self.max_bytes:
            log.warning("%s (%d bytes) exceeds the candidate cache's bound of %d bytes; not cached",
                        graph.name, size, self.max_bytes)
            return None
        path = self.entry_path(key, graph.name)
        cache_files.make_room(self.cache_dir, _ENTRY_SUFFIX, size, self.max_bytes, path, _WHAT)
        cache_files.write_atomic(path, lambda handle: _write_tar(handle, manifest, files))
        cache_files.touch(path)
        return path

    def restore(self, key: str, target: Path) -> bool:
        """Put the files of ``key``'s entry beside ``target`` under the names they were made with; False on
        a miss (absent, or damaged: then deleted)."""
        path = self.entry_path(key, target.name)
        try:
            handle = open(path, "rb")  # held open: a concurrent replace or eviction cannot tear what is read
        except FileNotFoundError:
            return False
        except OSError as exc:
            log.warning("candidate cache: cannot read %s (%s); making the graph instead", path.name, exc)
            return False
        with handle:
            try:
                problem = _extract(handle, key, target)
            except _TargetUnwritable as exc:  # the target's folder is full or not writable: the entry is sound
                log.warning("candidate cache: cannot write %s's files beside it (%s); making the graph instead",
                            target.name, exc.__cause__)
                return False
            except (tarfile.TarError, OSError, ValueError, KeyError, EOFError) as exc:
                problem = f"unreadable ({type(exc).__name__}: {exc})"
        if problem:
            log.warning("candidate cache entry %s is damaged: %s; deleting it", path.name, problem)
            cache_files.discard(path, _WHAT)
            return False
        cache_files.touch(path)
        return True

    def size_bytes(self) -> int:
        """Total bytes of the entries now in the cache directory."""
        return sum(size for _, _, size in cache_files.entries(self.cache_dir, _ENTRY_SUFFIX))

    def _digest(self, path: Path) -> str:
        stat = path.stat()
        memo = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino)
        if memo in self._digests:
            return self._digests[memo]
        digest = _file_digest(path)
        # File timestamps advance in clock ticks (coarse on many kernels and file systems): a file changed
        # within one may change again under the same stat, so only a settled file's digest is remembered.
        if time.time_ns() - max(stat.st_mtime_ns, stat.st_ctime_ns) > _SETTLED_NS:
            self._digests[memo] = digest
        return digest


def _write_tar(handle: BinaryIO, manifest: dict, files: list[Path]) -> None:
    with tarfile.open(fileobj=handle, mode="w", format=tarfile.PAX_FORMAT) as tar:
        data = json.dumps(manifest).encode()
        info = tarfile.TarInfo(_MANIFEST)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        for file in files:
            tar.add(file, arcname=file.name, recursive=False)


def _extract(handle: BinaryIO, key: str, target: Path) -> str | None:
    """Restore an entry's files beside ``target``, each checked against the manifest; why the entry is not a
    sound one of ``key`` for ``target``, or None once every file is in place."""
    with tarfile.open(fileobj=handle, mode="r:") as tar:
        first = tar.next()
        if first is None or first.name != _MANIFEST:
            return "no manifest first"
        manifest = json.loads(tar.extractfile(first).read())
        if manifest.get("format") != _FORMAT or manifest.get("key") != key:
            return f"it holds {manifest.get('format')!r} key {manifest.get('key')!r}"
        listed = manifest["files"]
        if not listed or listed[0]["name"] != target.name:
            return f"its graph is {listed[0]['name'] if listed else None!r}, not {target.name!r}"
        partial: list[Path] = []
        try:
            for entry in listed:
                member = tar.next()
                if member is None or member.name != entry["name"] or member.size != entry["size"] \
                        or "/" in member.name or not member.isfile():
                    return f"{entry['name']} missing or not as the manifest lists it"
                partial.append(target.parent / f".{member.name}.restoring")
                if _copy_checked(tar.extractfile(member), partial[-1]) != entry["sha256"]:
                    return f"{entry['name']}: checksum mismatch"
            for entry, temp in zip(listed, partial):
                _on_target(os.replace, temp, target.parent / entry["name"])
            partial = []
        finally:
            for temp in partial:
                with contextlib.suppress(OSError):  # a cleanup must not hide why the restore stopped
                    cache_files.unlink(temp)
    return None


class _TargetUnwritable(Exception):
    """Restoring failed on the target's side, not the entry's (raised from the OSError)."""


def _on_target(operation: Callable, *args):
    """``operation(*args)``, a write beside the target: its OSError is a :class:`_TargetUnwritable`."""
    try:
        return operation(*args)
    except OSError as exc:
        raise _TargetUnwritable() from exc


def _copy_checked(source: BinaryIO, path: Path) -> str:
    """Copy ``source`` to ``path``; the SHA-256 of what was copied."""
    digest = hashlib.sha256()
    out = _on_target(open, path, "wb")
    try:
        while chunk := source.read(_CHUNK):
            digest.update(chunk)
            _on_target(out.write, chunk)
    finally:
        _on_target(out.close)
    return digest.hexdigest()


def open_candidate_cache(cache_dir: str | os.PathLike | None = None) -> CandidateCache | None:
    """The candidate cache in the layer cache's directory (``cache_dir``, None: its default), or None with a
    warning where it cannot be used: a read-only home must not stop an export."""
    folder = Path(cache_dir if cache_dir is not None else default_cache_dir()) / FOLDER
    try:
        return CandidateCache(folder)
    except OSError as exc:
        log.warning("candidate cache disabled, cannot use %s (%s); pass --cache-dir DIR or --no-cache", folder, exc)
        return None
