"""Starting, stopping and crashing the real Triton server the tests serve from."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Iterator

import psutil

from nexus_sli.bench.served import free_ports
from nexus_sli.exporter.serving import server as serve


@contextlib.contextmanager
def serving(repository: Path | str, **options) -> Iterator[dict]:
    """``nexus-sli serve``'s server for ``repository`` on free loopback ports, for the tests of a module:
    ``{"repo", "process", "http", "grpc", "metrics"}`` (addresses as ``host:port``); ended at once after.
    ``options`` go to :func:`serve.start` (``gpu_on_cpu``, ``stdout`` ...)."""
    http, grpc, metrics = free_ports(3)
    process = serve.start(repository, http, grpc, metrics, **options)
    try:
        yield {"repo": repository, "process": process, "http": f"127.0.0.1:{http}", "grpc": f"127.0.0.1:{grpc}",
               "metrics": f"127.0.0.1:{metrics}"}
    finally:
        end_now(process)


def end_now(process) -> None:
    """A server the tests are done with, ended at once: its supervisor stopped, then SIGKILL to it and its
    python-backend processes, then its temporary folders removed.  A graceful stop (``serve.stop``) waits
    for the clients' idle connections (``--exit-timeout-secs``); the tests of stopping call that one."""
    process.supervisor.stop()
    kill_server({"process": process})
    process.remove_temporary_files()


def kill_server(server: dict) -> None:
    """A crash: SIGKILL to the server alone (its python-backend processes are ended after it)."""
    orphans = [p for ps in server["process"].supervisor.stub_processes().values() for p in ps]
    if server["process"].poll() is None:
        os.kill(server["process"].pid, signal.SIGKILL)
    server["process"].wait(30)
    for orphan in orphans:
        with contextlib.suppress(psutil.NoSuchProcess):
            orphan.kill()
