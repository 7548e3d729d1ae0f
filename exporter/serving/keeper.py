"""Keep ``nexus-sli serve``'s Triton server up: start it again when it dies, and before its dead workers pile up.

Triton 2.51's python backend can abort the whole server when one of its worker processes is killed: a
worker that dies while it holds one of the mutexes it shares with the server (in their shared memory)
leaves it to the server's next lock, which throws ``boost::interprocess::lock_exception`` where the backend
catches nothing (docs/reliability.md).  And each worker that dies stays a zombie child of the server, beside
a model version Triton never finishes unloading, until the server stops.  Neither can be fixed from outside
the backend, so :class:`KeptServer` watches the server :func:`server.start` started and starts it again, on
the same ports and repository, when it exits without being asked to, or when it holds
:data:`MAX_DEAD_WORKERS` dead workers.  Clients that retry (``EncoderClient``'s retries, the gateway's
``--triton-retry``) carry on once it is back.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from typing import Callable

from .launcher import TritonServer, stop

log = logging.getLogger(__name__)

#: Dead python-backend workers (zombies) a server may hold before it is stopped cleanly and started again.
MAX_DEAD_WORKERS = 16
#: A server that had to be started again this many times within :data:`RESTART_WINDOW_S` is left down (a
#: repository that crashes it at once would otherwise be started forever).
MAX_RESTARTS, RESTART_WINDOW_S = 5, 600.0
#: Seconds before a start that failed is tried again (it counts as one of :data:`MAX_RESTARTS`): what fails it
#: may pass (a repository read in the middle of an export, the port not yet released).
RETRY_PAUSE_S = 2.0
#: What a server stopped for its dead workers gives its requests in flight before it is killed: the rest of
#: Triton's own exit timeout would go on waiting for the dead workers' models, which never unload, while
#: every client waits for the server to be back (bench/data/tried.md, "A killed joined worker under load").
STOP_GRACE_S = 2.0


class KeptServer:
    """The server ``launch()`` returns, started again by ``launch()`` whenever it ends without :meth:`stop`.

    ``process``: the :class:`TritonServer` running now; ``restarts``: ``(time.time(), why)`` for each start
    after the first; ``failed_starts``: ``time.time()`` of each start again that failed (tried again after
    ``retry_pause_s``); ``returncode``: None while it is kept, else the exit code of the server it gave up on
    (after ``max_restarts`` starts, failed ones included, within ``window_s`` seconds), or of the one
    :meth:`stop` stopped.
    """

    def __init__(self, launch: Callable[[], TritonServer], max_dead_workers: int = MAX_DEAD_WORKERS,
                 max_restarts: int = MAX_RESTARTS, window_s: float = RESTART_WINDOW_S, interval: float = 0.5,
                 retry_pause_s: float = RETRY_PAUSE_S):
        self._launch, self.max_dead_workers, self._interval = launch, max_dead_workers, interval
        self._max_restarts, self._window_s, self._retry_pause_s = max_restarts, window_s, retry_pause_s
        self.process = launch()
        self.restarts: list[tuple[float, str]] = []
        self.failed_starts: list[float] = []
        self.returncode: int | None = None
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="nexus-sli-server-keeper", daemon=True)
        self._watcher.start()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code once the server is down for good (given up on, or stopped); None after ``timeout``."""
        self._watcher.join(timeout)
        return self.returncode

    def stop_keeping(self) -> None:
        """Start the server again no more, whatever it does from now on (it may be stopping already: a
        terminal's Ctrl-C reaches tritonserver too, in serve's process group)."""
        self._stopping.set()

    def stop(self, grace: float = 15.0) -> None:
        """Stop keeping the server, and stop it (:func:`launcher.stop`)."""
        self.stop_keeping()
        with self._lock:
            process = self.process
        stop(process, grace)
        # a start under way finishes first: the watcher stops what it started
        self._watcher.join()
        if self.returncode is None:
            self.returncode = process.returncode

    def _watch(self) -> None:
        why = None  # kept while a start that failed is tried again
        while True:
            process = self.process
            why = why or self._why_restart(process)
            if why is None:
                # stopped: this thread ends once the server has, since a server it started is signalled when it
                # ends (parent_death), which would be before serve has stopped the gateway and the search
                process.wait()
                return
            if not self._may_restart():
                log.error("tritonserver %s; it was started again, or tried, %d times in the last %.0f s: leaving "
                          "it down", why, self._max_restarts, self._window_s)
                self.returncode = process.returncode or 1
                return
            log.error("tritonserver %s; starting it again on the same ports", why)
            # the supervisor, the server, what is left of it: its workers and their shared memory
            stop(process, STOP_GRACE_S)
            if self._stopping.is_set():
                return
            try:
                started = self._launch()
            # Any failure, not only a ServerError (a repository read in the middle of an export, a GPU export put
            # there meanwhile): a watcher ended by an exception would leave serve waiting on a server that is gone.
            except Exception as exc:  # noqa: BLE001
                self.failed_starts.append(time.time())
                log.error("tritonserver could not be started again: %s; trying again in %.0f s", exc,
                          self._retry_pause_s)
                if self._stopping.wait(self._retry_pause_s):
                    return
                continue
            with self._lock:
                if self._stopping.is_set():
                    stop(started)
                    return
                self.process = started
            self.restarts.append((time.time(), why))
            why = None
            log.warning("tritonserver is ready again (start %d)", len(self.restarts) + 1)

    def _why_restart(self, process: TritonServer) -> str | None:
        """Wait until ``process`` ended by itself (why, in words), holds too many dead workers (why), or the
        keeper is stopped (None)."""
        while not self._stopping.is_set():
            try:
                code = process.wait(self._interval)
            except subprocess.TimeoutExpired:
                dead = process.supervisor.dead_workers() if process.supervisor is not None else 0
                if dead >= self.max_dead_workers and self._may_restart():  # else it serves on, with them
                    return f"holds {dead} dead python-backend workers (zombies)"
                continue
            if self._stopping.is_set():
                return None
            return f"exited by itself ({f'signal {-code}' if code < 0 else f'code {code}'})"
        return None

    def _may_restart(self) -> bool:
        starts = [t for t, _ in self.restarts] + self.failed_starts
        return sum(time.time() - t < self._window_s for t in starts) < self._max_restarts
