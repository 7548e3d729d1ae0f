"""Reload a model whose python-backend process died.

Every python-backend model instance runs in its own stub process
(:data:`backend_folders.STUB_EXECUTABLE`), and Triton does not restart one that
dies: the model then fails every request.  :class:`StubSupervisor` watches those
processes and reloads such a model through the repository API, which the server
restricts to the secret header (:mod:`flags`).
"""

from __future__ import annotations

import http.client
import json
import logging
import subprocess
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from google.protobuf.text_format import ParseError

from nexus_sli.exporter.triton.config import read as read_config
from nexus_sli.exporter.triton.folders import newest_version

from .backend_folders import STUB_EXECUTABLE
from .flags import ADMIN_HEADER, is_remote

log = logging.getLogger(__name__)

#: Where the python backend's shared memory regions live (boost's ``shared_memory_object`` on Linux).
SHARED_MEMORY = Path("/dev/shm")
#: A worker's command line: ``STUB MODEL_PATH REGION DEFAULT_SIZE GROWTH SERVER_PID ...`` (Triton 2.51's
#: python backend, ``stub_launcher.cc``)
_REGION_ARG, _SERVER_PID_ARG = 2, 5
#: What a check meets where the server stops or restarts under it, or answers with something else than its API's:
#: a connection refused or dropped (``OSError``), an answer cut short or not HTTP (``HTTPException``), a body that
#: is not the JSON expected (``ValueError``, ``LookupError``)
_UNANSWERED = (OSError, http.client.HTTPException, ValueError, LookupError)
#: The longest wait between two checks, reached by doubling ``interval`` after each failure in a row
_MAX_WAIT_S = 30.0
#: Past this many doublings any ``interval`` is at :data:`_MAX_WAIT_S` (and ``2.0 ** 1024`` overflows a float)
_MAX_DOUBLINGS = 64


def orphaned_workers(server_pid: int) -> list:
    """The python-backend workers (``psutil.Process``) still running for a server that ran as ``server_pid`` and
    has ended: each names its server on its command line, and exits within about 0.3 s of noticing it is gone."""
    import psutil

    found = []
    for process in psutil.process_iter(["cmdline"]):
        argv = process.info["cmdline"] or []
        if (len(argv) > _SERVER_PID_ARG and Path(argv[0]).name == STUB_EXECUTABLE
                and argv[_SERVER_PID_ARG] == str(server_pid)):
            found.append(process)
    return found


class StubSupervisor(threading.Thread):
    """Reloads a model whose python-backend process has died.

    Every ``interval`` seconds it counts the server's live stub processes per
    model (the model is the folder of the file a stub runs:
    ``<repository>/<model>/<version>/model.py`` or ``.../model.onnx``); when a
    model has fewer than it had, it unloads and loads that model through the
    restricted repository API, then loads again whatever else was ready
    before (the ensemble that uses it).  Until then the model answers with an
    error ("Stub process ... is not healthy"), which the client reports as
    retryable :class:`~nexus_sli.client.ModelUnavailableError`.

    ``base_url``: the server's HTTP endpoint as a local client reaches it;
    ``admin_key``: the secret its restricted APIs require.
    """

    def __init__(self, server: subprocess.Popen, repository: Path | str, base_url: str, admin_key: str,
                 interval: float = 0.5):
        super().__init__(name="nexus-sli-stub-supervisor", daemon=True)
        self.server, self.interval = server, interval
        self.repository = repository if is_remote(repository) else Path(repository).resolve()
        self._base = base_url
        self._key = admin_key
        self._stopping = threading.Event()
        self.restarts: list[tuple[float, str]] = []  # (time.time(), model), for tests and operators
        #: the shared memory region of every worker seen, removed once the server has stopped (launcher.py)
        self.regions: set[str] = set()
        self._expected = self.stub_counts()
        self._ready = set(self._ready_models())
        self._ensembles: set[str] | None = None
        #: held while the stub processes are counted and reloaded, and while models are swapped (:meth:`swapping`)
        self._checking = threading.Lock()

    def stub_processes(self) -> dict[str, list]:
        """Live stub processes (``psutil.Process``) of this server, per model name."""
        import psutil

        found: dict[str, list] = {}
        try:
            children = psutil.Process(self.server.pid).children()
        except psutil.Error:
            return found
        for child in children:
            try:
                if child.status() == psutil.STATUS_ZOMBIE:
                    continue
                argv = child.cmdline()
            except psutil.Error:
                continue
            if len(argv) < 2 or Path(argv[0]).name != STUB_EXECUTABLE:
                continue
            if len(argv) > _REGION_ARG:
                self.regions.add(argv[_REGION_ARG])
            model = self._model_of(Path(argv[1]).parent.parent)
            if model is not None:
                found.setdefault(model, []).append(child)
        return found

    def _model_of(self, model_dir: Path) -> str | None:
        """The model a stub serves, from the folder it runs in: ``<repository>/<model>`` for a
        folder; for an object store, Triton's local copy (a random ``/tmp/folderXXXXXX``) of the
        model folder, named by the ``name`` in the config.pbtxt copied with it."""
        if not isinstance(self.repository, str):
            return model_dir.name if model_dir.parent == self.repository else None
        try:
            return read_config(model_dir / "config.pbtxt").name or None
        except (OSError, ParseError):  # not a model copy (or gone: unloaded meanwhile)
            return None

    def dead_workers(self) -> int:
        """The python-backend processes that died and that the server has not reaped (zombies): Triton
        reaps a worker when it finishes unloading the worker's model, which it never does for a dead one."""
        import psutil

        try:
            children = psutil.Process(self.server.pid).children()
        except psutil.Error:
            return 0
        dead = 0
        for child in children:
            try:  # a zombie has no command line left; /proc keeps the first 15 characters of its name
                dead += child.status() == psutil.STATUS_ZOMBIE and child.name() == STUB_EXECUTABLE[:15]
            except psutil.Error:
                continue
        return dead

    def stub_counts(self) -> dict[str, int]:
        return {model: len(processes) for model, processes in self.stub_processes().items()}

    def _post(self, path: str, body: dict | None = None) -> bytes:
        request = urllib.request.Request(self._base + path, data=json.dumps(body or {}).encode(), method="POST",
                                         headers={ADMIN_HEADER: self._key, "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.read()

    def _ready_models(self) -> list[str]:
        index = json.loads(self._post("/v2/repository/index", {"ready": True}) or b"[]")
        return [entry["name"] for entry in index]

    def _serving(self) -> bool:
        """Live and not shutting down (Triton closes its endpoints when asked to stop).  Not "ready": with a
        model that failed to load (a reload that failed), Triton is not ready until it loads, which only a reload
        can do."""
        if self._stopping.is_set() or self.server.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(self._base + "/v2/health/live", timeout=2) as response:
                return response.status == 200
        except (OSError, http.client.HTTPException):  # refused, dropped, or cut short: a server going away
            return False

    def _is_ensemble(self, model: str) -> bool:
        with urllib.request.urlopen(self._base + f"/v2/models/{model}/config", timeout=30) as response:
            return json.loads(response.read()).get("platform") == "ensemble"

    def reload(self, model: str) -> None:
        """Unload and load ``model``, then load whatever else was ready before and is not now.

        From an object store, every model that was ready is loaded again, the ensembles last: a
        load reads the model's config from the store, where a publish may have pinned newer step
        versions since this server started; reloading one step alone would leave the ensemble
        pinning a version that step no longer serves.  The replica then serves the store's
        current set (docs/deployment.md)."""
        log.warning("the python backend process of model %s exited; reloading the model", model)
        remote = isinstance(self.repository, str)
        if remote and self._ensembles is None:  # asked once, while every model is still loaded
            self._ensembles = {m for m in self._ready if self._is_ensemble(m)}
        ensembles = self._ensembles or set()
        self._post(f"/v2/repository/models/{model}/unload")
        self._post(f"/v2/repository/models/{model}/load")
        others = self._ready if remote else self._ready - set(self._ready_models())
        for other in sorted(others - {model}, key=lambda m: (m in ensembles, m)):
            self._post(f"/v2/repository/models/{other}/load")
        # as many workers as the loads started: the store's versions, or a re-export's instance count, may differ
        # from the ones loaded before (expecting the old count would reload such a model again and again)
        counts = self.stub_counts()
        if remote:
            self._expected = counts
        else:  # another model that lost a worker meanwhile is still expected to have it
            self._expected.update({m: counts.get(m, 0) for m in others | {model}})
        self.restarts.append((time.time(), model))
        log.warning("model %s reloaded", model)

    @contextmanager
    def swapping(self, names=()):
        """While the models ``names`` are swapped for new ones (:mod:`swap`): no reload, since the old models'
        processes go on purpose; then the new processes and ready models are the ones expected.  A server that does not
        answer for its ready models then (it stops, or restarts) leaves the names ready before, which a swap
        keeps: the swap's own outcome, or its error, is what the caller gets."""
        with self._checking:
            try:
                yield self
            finally:
                self._wait_old_versions_gone()
                # the swapped models' workers as they are now; every other model's as many as before at least,
                # so one that died during the swap is still lost
                counts = self.stub_counts()
                self._expected = {m: counts.get(m, 0) if m in names else max(counts.get(m, 0), self._expected.get(m, 0))
                                  for m in {*counts, *self._expected}}
                try:
                    self._ready = set(self._ready_models())
                except _UNANSWERED as exc:
                    log.warning("could not read the ready models after a swap (%s: %s); keeping the names read "
                                "before it", type(exc).__name__, exc)

    def _wait_old_versions_gone(self, timeout: float = 60.0) -> None:
        """Until no process serves a version older than its model's newest (Triton unloads the old version once
        the new one is ready, and its processes then exit): counted before, they would read as lost after."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self._stopping.is_set():
            old = [process for processes in self.stub_processes().values() for process in processes
                   if self._is_old(process)]
            if not old:
                return
            time.sleep(0.2)
        log.warning("python-backend processes of replaced model versions still run after %.0f s", timeout)

    def _is_old(self, process) -> bool:
        """Whether a stub serves a version folder older than its model's newest."""
        import psutil

        try:
            version = Path(process.cmdline()[1]).parent
            newest = newest_version(version.parent)
        except (psutil.Error, IndexError, OSError):  # OSError: its model's folder is gone, so no newer version
            return False
        return version.name.isdigit() and int(version.name) < newest

    def load(self, model: str) -> None:
        """Load ``model`` as the repository holds it now (Triton serves the loaded one until it has)."""
        self._post(f"/v2/repository/models/{model}/load")

    def run(self) -> None:
        failures = 0
        while not self._stopping.wait(self._backoff(failures)):
            if self.server.poll() is not None:
                return
            with self._checking:
                failures = self._check(failures)

    def _backoff(self, failures: int) -> float:
        """Seconds to the next check: ``interval``, doubled by each failure in a row up to :data:`_MAX_WAIT_S`."""
        return min(self.interval * 2.0 ** min(failures, _MAX_DOUBLINGS), _MAX_WAIT_S)

    def _check(self, failures: int) -> int:
        """Reload each model that lost a stub process; the failures in a row (the next wait's backoff).

        Any failure is logged and tried again after the backoff: an exception out of :meth:`run` would end
        this thread, and no process that dies later would be noticed."""
        doing = "count the python backend processes"
        try:
            counts = self.stub_counts()
            lost = [m for m, n in self._expected.items() if counts.get(m, 0) < n]
            if not lost:  # a check that finds every worker: the next comes after the interval again
                return 0
            if not self._serving():
                return failures
            for model in lost:
                doing = f"reload model {model}"
                self.reload(model)
            return 0
        except _UNANSWERED as exc:
            log.error("could not %s (%s: %s); trying again", doing, type(exc).__name__, exc)
        except Exception:  # a bug: its traceback logged, and tried again no sooner than a failure
            log.exception("could not %s; trying again", doing)
        return failures + 1

    def stop(self) -> None:
        self._stopping.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join(timeout=30)
