"""``nexus-sli serve`` on a folder with no model: answer first, search after.

    the one graph that needs no search (ONNX Runtime fp32, the plain graph, validated at fp32's parity bar)
      -> exported and served (:func:`export_first`)
      -> the export asked for (``auto``: every configuration this CPU runs) in a background process
         (:class:`BackgroundSearch`), at a lower priority and on fewer threads, into a folder beside the
         repository, which Triton never reads
      -> its winner, where it is not the graph served, swapped in with no failed call (:mod:`swap`), unless the
         user exported the model into the repository meanwhile: that export stays, and the log says why

A search that fails, or is stopped (Ctrl-C), leaves the first export served and removes what it wrote.  A first
export stopped (Ctrl-C, or SIGTERM once serve has made it a KeyboardInterrupt) stops its export process too.
The search validates and times its graphs beside the served model: traffic while it times is in its figures
(validation.json records the timing as it ran).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from nexus_sli.exporter.triton.staging import remove_dead_stagings

from . import temporary_folders
from .binary import ServerError
from .parent_death import dies_with_parent
from .swap import models_in, stamp, swap_in

log = logging.getLogger(__name__)

#: What the first export serves: the configuration every supported family exports at exact parity, in the one
#: graph that needs neither a search nor timing.
FIRST = ("onnxruntime", "fp32")
#: How much lower the search's priority is than the server's (``nice``).
NICENESS = 10
#: How long a stopped first export has to clean up after its SIGINT (its staging folder) before it is killed.
EXPORT_GRACE_S = 10.0
#: How long it has to end on a terminal's Ctrl-C, which reaches it too, before it is sent one: a second SIGINT
#: would interrupt its clean-up.
OWN_CTRL_C_S = 1.0


@dataclass(frozen=True)
class ModelChoice:
    """The model ``nexus-sli serve`` exports into a folder with no model, and the export its search makes."""

    model: str = ""
    task: str = "auto"
    name: str = ""
    backend: str = "auto"
    precision: str = "auto"
    optimize: str = "balanced"
    allow_pickle: bool = False
    no_truncate: bool = False
    no_cache: bool = False
    max_batch_size: int | None = None

    def export_command(self, out: Path, name: str = "", first: bool = False) -> list[str]:
        """``nexus-sli export`` of this model into ``out``: the first export, or the search's."""
        backend, precision = FIRST if first else (self.backend, self.precision)
        return [sys.executable, "-m", "nexus_sli.cli.main", "export", "--task", self.task, "--backend", backend,
                "--precision", precision, "--optimize", self.optimize, "--out", str(out),
                *(["--model", self.model] if self.model else []),
                *(["--name", name or self.name] if name or self.name else []),
                *(["--max-batch-size", str(self.max_batch_size)] if self.max_batch_size is not None else []),
                *[flag for flag, given in (("--allow-pickle", self.allow_pickle), ("--no-truncate", self.no_truncate),
                                           ("--no-cache", self.no_cache), ("--no-search", first)) if given]]


def _search_prefix(repository: Path) -> str:
    """The name of a search's folder beside ``repository``, before its random part."""
    return f".{repository.name}-search-"


def remove_abandoned_searches(repository: Path) -> None:
    """What the searches of serves killed outright left beside ``repository`` (a whole export, where one was
    killed between its export and the swap): every serve of a local repository removes it, searching or not."""
    repository = Path(repository).resolve()
    for folder in temporary_folders.remove_abandoned(_search_prefix(repository), repository.parent):
        remove_dead_stagings(folder)  # its export's, where that was killed before it could remove it


def holds_a_model(repository: Path) -> bool:
    return any(p.joinpath("config.pbtxt").is_file() for p in Path(repository).glob("*"))


def export_first(choice: ModelChoice, repository: Path) -> str:
    """Export the first graph into ``repository`` (its log on stderr, as it goes); the model's name."""
    print("nexus-sli: no model in the repository yet: exporting the one graph that needs no search first "
          f"({' '.join(FIRST)}, validated against PyTorch), then serving it", file=sys.stderr, flush=True)
    # SIGINT where serve is killed outright: the export removes its staging folder, as on a Ctrl-C
    process = subprocess.Popen(choice.export_command(repository, first=True), stdout=subprocess.PIPE, text=True,
                               preexec_fn=dies_with_parent(signal.SIGINT))
    try:
        with process.stdout:
            out = process.stdout.read()
        code = process.wait()
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM made one: the export must not outlive serve
        _stop_export(process, Path(repository))
        raise
    if code != 0:
        raise ServerError(f"the first export failed (exit code {code}); nothing is served")
    return json.loads(out.strip().splitlines()[-1])["name"]


def _stop_export(process: subprocess.Popen, repository: Path, grace: float = EXPORT_GRACE_S) -> None:
    """Stop an export process: SIGINT, on which it removes its staging folder (and a repository folder it
    created) as a Ctrl-C has it do; SIGKILL past ``grace`` seconds, or at a second Ctrl-C.  What a killed export
    leaves beside the repository (its staging folder, named with its pid) is removed here."""
    try:
        try:
            process.wait(OWN_CTRL_C_S)
        except subprocess.TimeoutExpired:  # SIGTERM, or a SIGINT sent to serve alone, did not reach it
            print("nexus-sli: stopping the first export ...", file=sys.stderr, flush=True)
            process.send_signal(signal.SIGINT)
            process.wait(grace)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        process.kill()
        process.wait()
    # escaped: a repository's name may hold glob characters ("repo[1]")
    for staging in repository.resolve().parent.glob(glob.escape(f".{repository.name}.staging-{process.pid}-") + "*"):
        shutil.rmtree(staging, ignore_errors=True)


def _served(encoder: Path) -> tuple[str, str, str]:
    """(backend, precision, graph) of the encoder in ``encoder``, from its validation.json."""
    report = json.loads((encoder / "validation.json").read_text())
    return report["backend"], report["precision"], report["graph"]


class BackgroundSearch(threading.Thread):
    """The search's export in a process of its own, then its winner swapped in on the kept server.

    ``server``: the :class:`~.keeper.KeptServer` serving ``repository`` (the server it runs when the search
    ends is the one swapped).  ``threads``: the environment that gives the export fewer threads than the cores
    (the caller knows the exporter's variable: ``{variable: count}``).  ``outcome``: None while it runs, then
    ``"swapped"``, ``"kept"`` (the served graph won), ``"changed"`` (the user exported the model into the
    repository meanwhile: nothing swapped), ``"failed"`` or ``"stopped"``.

    What the repository holds is stamped when the search is made (:func:`swap.stamp`, once the server serves
    it): a swap replaces only what was served then, never an export the user made while the search ran."""

    def __init__(self, choice: ModelChoice, repository: Path, name: str, server, threads: dict[str, str] | None = None):
        super().__init__(name="nexus-sli-search", daemon=True)
        self.threads = threads or {}
        self.choice, self.repository, self.model_name, self.server = choice, Path(repository).resolve(), name, server
        # where the search exports, beside the repository: Triton never reads it
        self.out = temporary_folders.make(_search_prefix(self.repository), self.repository.parent)
        self.outcome: str | None = None
        self.served_stamp = stamp(self.repository)
        self._process: subprocess.Popen | None = None
        self._stopping = threading.Event()
        #: held while the export process is started, and while :meth:`stop` looks for it: a stop in between
        #: would find none to stop, and the export would run on after serve has exited
        self._starting = threading.Lock()

    def run(self) -> None:
        try:
            self.outcome = self._search()
        except Exception as exc:  # noqa: BLE001 - whatever went wrong, the first export stays served
            log.error("the background search failed (%s); serving the first export", exc)
            self.outcome = "failed"
        finally:
            self._remove_folders()

    def _search(self) -> str:
        env = {**os.environ, **self.threads}
        log.info("searching for a faster graph in the background (%s %s, at a lower priority%s); serving %s "
                 "meanwhile", self.choice.backend, self.choice.precision,
                 "".join(f", {k}={v}" for k, v in self.threads.items()), " ".join(self._served()))
        with self._starting:
            if self._stopping.is_set():
                return "stopped"
            self._process = subprocess.Popen(self.choice.export_command(self.out, name=self.model_name), env=env,
                                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                             preexec_fn=dies_with_parent(signal.SIGINT, lambda: os.nice(NICENESS)))
        for line in self._process.stderr:  # its log, said as the search's
            print(f"search: {line.rstrip()}", file=sys.stderr, flush=True)
        code = self._process.wait()
        if self._stopping.is_set():
            return "stopped"
        if code != 0:
            log.error("the background search exited with code %d; serving the first export", code)
            return "failed"
        found = _served(self.out / f"{self.model_name}_encoder")
        changed = self._changed()
        if changed:
            log.warning("not swapping in the search's winner (%s): %s changed in %s since the search started (a "
                        "re-export?), and the swap would delete it; the server serves what it loaded until serve "
                        "is started again", " ".join(found), ", ".join(changed), self.repository)
            return "changed"
        if found == self._served():
            log.info("the search kept the graph served (%s): nothing to swap", " ".join(found))
            return "kept"
        log.info("swapping in the search's winner, %s, for %s", " ".join(found), " ".join(self._served()))
        swap_in(self.out, self.repository, self.server.process)
        log.info("now serving %s, the search's winner", " ".join(self._served()))
        return "swapped"

    def _served(self) -> tuple[str, str, str]:
        return _served(self.repository / f"{self.model_name}_encoder")

    def _changed(self) -> list[str]:
        """The folders the swap would replace that differ from what the repository held when the search began."""
        now = stamp(self.repository)
        return [name for name in models_in(self.out) if now.get(name) != self.served_stamp.get(name)]

    def stop(self, grace: float = 30.0) -> None:
        """Stop the search (what it wrote goes; the first export stays served)."""
        with self._starting:
            self._stopping.set()
            process = self._process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGINT)  # the export's own clean-up runs (its staging folder goes)
            try:
                process.wait(grace)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self.is_alive():  # a search not started yet starts no export once stopped
            self.join(grace)
        self._remove_folders()

    def _remove_folders(self) -> None:
        """The search's repository, and the staging folders of its export (a killed one leaves its own)."""
        temporary_folders.remove(self.out)
        for staging in self.out.parent.glob(glob.escape(f".{self.out.name}.staging-") + "*"):  # see _stop_export
            shutil.rmtree(staging, ignore_errors=True)
