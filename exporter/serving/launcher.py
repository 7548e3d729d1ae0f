"""The ``tritonserver`` process: its command, starting it, waiting until it is ready, ending it.

:mod:`binary` says which binary runs, :mod:`flags` what it is told and
:mod:`backend_folders` what the wheel's binary loads its backends from.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from . import temporary_folders
from .backend_folders import prepare_backends
from .binary import ServerError, system_binary, wheel_binary, wheel_environment
from .flags import ADMIN_HEADER, server_args
from .stub_supervisor import SHARED_MEMORY, StubSupervisor, orphaned_workers


@dataclass
class ServerCommand:
    argv: list[str]
    env: dict[str, str]
    backend_dir: Path | None
    #: the backend folder is a temporary one made for this command (removed when the server stops)
    temporary_backend_dir: bool = False


def server_command(repository: Path | str, http_port: int, grpc_port: int, metrics_port: int,
                   host: str = "127.0.0.1", backend_dir: Path | None = None,
                   admin_key: str | None = None, reload_models: bool = False) -> ServerCommand:
    """The command for ``tritonserver`` on PATH as it is, else for the wheel's with a backend
    folder (``backend_dir``, or a temporary one) and the environment it needs."""
    args = server_args(repository, http_port, grpc_port, metrics_port, host, admin_key, reload_models)
    system = system_binary()
    if system:
        return ServerCommand([system, *args], dict(os.environ), None)
    binary = wheel_binary()
    temporary = backend_dir is None
    backend_dir = prepare_backends(backend_dir or temporary_folders.make(temporary_folders.BACKENDS_PREFIX))
    argv = [str(binary), *args, f"--backend-directory={backend_dir}"]
    return ServerCommand(argv, wheel_environment(), backend_dir, temporary)


def client_host(host: str) -> str:
    """Where a local client reaches a server bound to ``host`` (a wildcard address is not one)."""
    return {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)


def url(host: str, port: int, path: str) -> str:
    """``path`` on the server bound to ``host``:``port``, as a local client reaches it."""
    host = client_host(host)
    return f"http://{f'[{host}]' if ':' in host else host}:{port}{path}"


class TritonServer(subprocess.Popen):
    """The ``tritonserver`` process (a :class:`subprocess.Popen`: ``pid``, ``poll()``,
    ``wait()``), plus the :class:`StubSupervisor` that :func:`server.start` attaches to it.

    Its ``args`` are redacted: the model-control secret is never shown."""

    supervisor: StubSupervisor | None = None
    #: (shadow, backends) where each batched ensemble is served joined (:mod:`joined_steps`), else None
    joined: tuple[Path, Path] | None = None

    def __init__(self, command: ServerCommand, admin_key: str | None, temporary: tuple[Path, ...] = (), **popen):
        super().__init__(command.argv, env=command.env, **popen)
        self.args = [a.replace(admin_key, "<secret>") if admin_key else a for a in command.argv]
        #: folders made for this server (its backends, a shadow repository), removed once it has stopped
        self._temporary_dirs = [*([command.backend_dir] if command.temporary_backend_dir else []), *temporary]

    def remove_temporary_files(self) -> None:
        """What this server leaves once it has stopped: the folders made for it (backends, a shadow
        repository); after a crash, its python-backend workers (each exits by itself within about 0.3 s of
        noticing); and the shared memory regions of its workers that Triton did not remove (all of them after
        a crash, a dead worker's after a clean stop: Triton never finishes unloading that worker's model)."""
        if self.poll() is not None:
            _end(orphaned_workers(self.pid))
            for region in self.supervisor.regions if self.supervisor is not None else ():
                (SHARED_MEMORY / region).unlink(missing_ok=True)
            for folder in self._temporary_dirs:
                temporary_folders.remove(folder)
            self._temporary_dirs = []


def _end(workers: list, timeout: float = 10.0) -> None:
    """SIGKILL to a dead server's python-backend workers, and wait for them.  Until they go, one may hold a
    listening socket it inherited (a worker started by a reload after the server opened its ports), so a
    server started again on those ports waits for this."""
    import psutil

    for worker in workers:
        try:
            worker.kill()
        except psutil.NoSuchProcess:
            pass
    wait_exited(workers, timeout)


def wait_exited(processes: list, timeout: float) -> None:
    """Until each of ``processes`` (``psutil.Process``) has exited, or ``timeout``.
    An exited process whose parent died stays a zombie until PID 1 reaps it, which some machines' init does a
    second or two later: it holds no socket, file or memory by then, so it counts as exited (waiting for it to
    be reaped, as ``psutil.wait_procs`` does, cost each restart after a crash that time)."""
    deadline = time.monotonic() + timeout
    while any(_running(process) for process in processes) and time.monotonic() < deadline:
        time.sleep(0.01)


def _running(process) -> bool:
    """Not gone (its pid not taken by another process since), nor a zombie whose threads have all ended (its leader
    shows as a zombie once it alone has).  A zombie is reaped here where this process is its parent: the subreaper
    a crashed server's workers are given to, as ``nexus-sli serve`` is when it runs as a container's PID 1."""
    import psutil

    try:
        if process.is_running() and (process.status() != psutil.STATUS_ZOMBIE or process.num_threads() > 1):
            return True
    except psutil.NoSuchProcess:
        return False
    with contextlib.suppress(ChildProcessError):
        os.waitpid(process.pid, os.WNOHANG)
    return False


def wait_ready(http_port: int, process: subprocess.Popen, timeout: float = 180.0, host: str = "127.0.0.1") -> None:
    """Return once the server answers ready; a :class:`ServerError` if it exits first or takes past ``timeout``."""
    deadline = time.monotonic() + timeout
    ready = url(host, http_port, "/v2/health/ready")
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerError(f"tritonserver exited with code {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(ready, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise ServerError(f"tritonserver was not ready within {timeout:.0f} s")


def check_identity(host: str, http_port: int, admin_key: str) -> None:
    """The server that answered is ours: it refuses its restricted APIs without our secret and answers with it.
    Another one on the same port refuses our secret (restricted with its own) or answers anyone (unrestricted,
    as a plain ``tritonserver`` is)."""
    logging_api = url(host, http_port, "/v2/logging")
    if _status(logging_api, {ADMIN_HEADER: admin_key}) == 403 or _status(logging_api, {}) != 403:
        raise ServerError(f"another server answers on port {http_port} (is one running there already?); "
                          "this tritonserver could not take the port")


def _status(address: str, headers: dict[str, str]) -> int:
    """The HTTP status of a GET of ``address``."""
    try:
        with urllib.request.urlopen(urllib.request.Request(address, headers=headers), timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def end(process: subprocess.Popen, grace: float) -> None:
    """SIGTERM, then SIGKILL if ``process`` has not exited within ``grace`` seconds."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def stop(process: subprocess.Popen, grace: float = 15.0) -> None:
    """Stop the supervisor, then the server (killed after ``grace`` seconds), then remove what it leaves
    (:meth:`TritonServer.remove_temporary_files`)."""
    supervisor = getattr(process, "supervisor", None)
    if supervisor is not None:
        supervisor.stop()
    end(process, grace)
    if isinstance(process, TritonServer):
        process.remove_temporary_files()
