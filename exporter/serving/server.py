"""Start the real Triton server on a model repository, keep its python-backend workers alive, stop it.

The public entry of ``nexus-sli serve``; each job lives in its own module:

- :mod:`binary`: which ``tritonserver`` runs (PATH, else the ``nvidia-pytriton`` wheel's) and its environment;
- :mod:`backend_folders`: the wheel's backend folder, the python backend and our encoder shims;
- :mod:`flags`: the server's flags, access to its restricted APIs included;
- :mod:`launcher`: the command, the process, waiting until it is ready, ending it;
- :mod:`stub_supervisor`: reloading a model whose python-backend process died;
- :mod:`keeper`: starting the server again when it dies (``serve_forever``);
- :mod:`parent_death`: what serve starts stops when serve is killed outright;
- :mod:`gpu_on_cpu`: a GPU repository served on the CPU, only when asked;
- :mod:`joined_steps`: each batched ensemble's steps in one process (unless ``separate_steps``).
"""

from __future__ import annotations

import secrets
import signal
import subprocess
import time
from pathlib import Path

from . import temporary_folders
from .backend_folders import SHIM_BACKENDS, STUB_EXECUTABLE, prepare_backends
from .binary import ServerError, system_binary
from .flags import ADMIN_HEADER, EXIT_TIMEOUT_S, REMOTE_PREFIXES, RESTRICTED_APIS, is_remote, server_args
from .gpu_on_cpu import servable
from .joined_steps import join
from .keeper import KeptServer
from .launcher import (ServerCommand, TritonServer, check_identity, client_host, end, server_command, stop, url,
                       wait_ready)
from .parent_death import dies_with_parent
from .stub_supervisor import StubSupervisor

__all__ = ["ADMIN_HEADER", "EXIT_TIMEOUT_S", "REMOTE_PREFIXES", "RESTRICTED_APIS", "SHIM_BACKENDS", "STUB_EXECUTABLE",
           "KeptServer", "ServerCommand", "ServerError", "StubSupervisor", "TritonServer", "client_host", "is_remote",
           "prepare_backends", "serve_forever", "server_args", "server_command", "start", "stop", "wait_ready"]


def _repository_to_serve(repository: Path | str, gpu_on_cpu: bool,
                         backends: Path | None) -> tuple[Path | str, tuple[Path, ...], Path | None]:
    """The repository Triton is given, the shadow folders made for it: GPU models on the CPU (when asked),
    then the batched ensembles' steps joined (where ``backends``, the encoder shims' folder, is given); and the
    joined shadow where it is made over the repository itself, else None."""
    if is_remote(repository):
        if gpu_on_cpu:
            raise ServerError("--gpu-models-on-cpu rewrites configs in a local shadow folder and cannot apply to "
                              f"{repository}; publish a CPU export there, or serve a local copy")
        return repository, (), None
    repository = Path(repository).resolve()
    if not any(p.joinpath("config.pbtxt").is_file() for p in repository.glob("*")):
        raise ServerError(f"{repository} holds no model (run 'make export' first)")
    shadows = [shadow for shadow in [servable(repository, gpu_on_cpu)] if shadow]
    try:  # a GPU export tried on the CPU is joined as it is on a GPU: over the shadow that moved it
        joined = join(shadows[-1] if shadows else repository, backends) if backends is not None else None
    except BaseException:
        for shadow in shadows:
            temporary_folders.remove(shadow)
        raise
    # A swap rewrites the joined shadow's entries from the repository (joined_steps.refresh): right where the
    # join is over the repository itself (with --gpu-models-on-cpu too, on an export with no GPU model), wrong
    # over the GPU models' shadow, whose configs differ from the repository's.
    over_repository = joined if joined and not shadows else None
    shadows += [joined] if joined else []
    return (shadows[-1] if shadows else repository), tuple(shadows), over_repository


def start(repository: Path | str, http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002,
          host: str = "127.0.0.1", timeout: float = 180.0, supervise: bool = True, gpu_on_cpu: bool = False,
          separate_steps: bool = False, **popen) -> TritonServer:
    """Start the server and return once it reports ready; with ``supervise`` (the
    default) a model whose python-backend process dies is reloaded.  ``gpu_on_cpu``:
    serve GPU models on the CPU where there is no GPU (:mod:`gpu_on_cpu`).  Each batched
    ensemble runs its steps in one process (:mod:`joined_steps`) unless ``separate_steps``,
    or unless the server is a ``tritonserver`` on PATH, whose native backends serve the encoders.

    ``repository`` may be an object store (``s3://HOST:PORT/bucket/prefix``, credentials
    from the standard AWS environment): Triton reads it itself, so the local checks and
    the shadows (local rewrites of configs) do not apply there."""
    # the wheel's server gets a backend folder of ours, made now: the joined models load its encoder shims
    for prefix in temporary_folders.SERVER_PREFIXES:  # what serves killed outright left
        temporary_folders.remove_abandoned(prefix)
    backends = None if system_binary() else temporary_folders.make(temporary_folders.BACKENDS_PREFIX)
    made = [backends] if backends else []
    try:
        served, shadows, joined = _repository_to_serve(repository, gpu_on_cpu, None if separate_steps else backends)
        made += shadows
        repository = served
        admin_key = secrets.token_urlsafe(32)
        command = server_command(repository, http_port, grpc_port, metrics_port, host, backend_dir=backends,
                                 admin_key=admin_key, reload_models=supervise)
        process = TritonServer(command, admin_key, tuple(made), **popen)
        process.joined = (joined, backends) if joined else None
    except BaseException:  # nothing started: the folders made for it go
        for folder in made:
            temporary_folders.remove(folder)
        raise
    try:
        wait_ready(http_port, process, timeout, host)
        check_identity(host, http_port, admin_key)
        if supervise:
            process.supervisor = StubSupervisor(process, repository, url(host, http_port, ""), admin_key)
            process.supervisor.start()
    except BaseException:
        stop(process)
        raise
    return process


def _wait_any(processes: list[subprocess.Popen | KeptServer]) -> int:
    """The exit code of the first of ``processes`` to end."""
    if len(processes) == 1:
        return processes[0].wait()
    while True:
        for process in processes:
            if process.poll() is not None:
                return process.returncode
        time.sleep(0.2)


def serve_forever(repository: Path, http_port: int, grpc_port: int, metrics_port: int, host: str,
                  gpu_on_cpu: bool = False, beside: list[str] | None = None, separate_steps: bool = False,
                  background=None) -> int:
    """The ``serve`` command: start, print the URLs, stop cleanly on Ctrl-C / SIGTERM (exit code 0).
    A server that dies by itself, or holds too many dead workers, is started again (:mod:`keeper`).

    ``beside``: the command of a process started once Triton is ready (the HTTP
    gateway); whichever of the two ends first, the other is stopped too, and the
    exit code is the one that ended first's: its own, or 128 + the signal that
    killed it (the shell's convention; a negative code would become 256 - n).

    ``background``: called with the kept server once it is ready, a thread to start beside it (the search of
    :mod:`search`), stopped before the server is."""
    # serve killed outright (SIGKILL) runs none of the clean-up below: the kernel stops Triton and the gateway
    process = KeptServer(lambda: start(repository, http_port, grpc_port, metrics_port, host, gpu_on_cpu=gpu_on_cpu,
                                       separate_steps=separate_steps, preexec_fn=dies_with_parent(signal.SIGTERM)))
    companion = worker = None
    try:
        print(f"Triton is ready: HTTP http://{host}:{http_port}  gRPC {host}:{grpc_port}  "
              f"metrics http://{host}:{metrics_port}/metrics", flush=True)
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        companion = subprocess.Popen(beside, preexec_fn=dies_with_parent(signal.SIGTERM)) if beside else None
        worker = background(process) if background else None
        if worker is not None:
            worker.start()
        code = _wait_any([process, *([companion] if companion else [])])
        code = 128 - code if code < 0 else code  # Popen's -N (killed by signal N) as the shell says it
        if companion is not None and companion.poll() is not None:
            print(f"the process beside Triton exited (code {code}); stopping Triton ...", flush=True)
    except KeyboardInterrupt:
        print("stopping Triton ...", flush=True)
        code = 0
    finally:
        # before the search and the gateway are stopped, which takes seconds: a terminal's Ctrl-C reaches
        # tritonserver too (serve's process group), and the keeper would take its exit for a crash
        process.stop_keeping()
        try:
            if worker is not None:
                worker.stop()
            if companion is not None:
                end(companion, grace=10.0)
        finally:  # also where a second Ctrl-C (or SIGTERM) cut the above short: tritonserver must not outlive serve
            process.stop()  # also when the server was given up on: the supervisor and temporary files go too
    return code
