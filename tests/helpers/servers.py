"""Starting, stopping and crashing the real Triton server the tests serve from."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path
from typing import Iterator

import psutil
import tritonclient.http as httpclient

from nexus_sli.bench.served import Gateway, free_ports
from nexus_sli.client.model_info import ModelInfo
from nexus_sli.exporter.serving import server as serve
from nexus_sli.exporter.serving.launcher import wait_exited


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


def step_counts(http: str, model: str, step: str) -> tuple[int, int]:
    """(inferences, executions) that Triton's statistics count for the work of ``model``'s ``step``
    (``tokenizer``, ``encoder``): the step model's own, plus, where ``nexus-sli serve`` joined the ensemble's
    steps in one model (its default), that model's, which runs every step of each of its requests."""
    stats = httpclient.InferenceServerClient(http)
    try:
        config = stats.get_model_config(model)
        joined = ModelInfo.from_config(model, config).joined
        counted = [f"{model}_{step}", *([model] if joined else [])]
        found = [stats.get_inference_statistics(name)["model_stats"][0] for name in counted]
    finally:
        stats.close()
    return sum(int(m["inference_count"]) for m in found), sum(int(m["execution_count"]) for m in found)


def start_gateway(triton: str, *args: str, log: Path) -> Gateway:
    """``nexus-sli gateway`` as a user starts it, on a free port (the bench's launcher); output in ``log``."""
    return Gateway(triton, *args, timeout_s=120, log=log).start()


@contextlib.contextmanager
def gateway_to(triton: str, *args: str, log: Path) -> Iterator[Gateway]:
    """:func:`start_gateway`'s gateway for the tests of a module, stopped after."""
    started = start_gateway(triton, *args, log=log)
    try:
        yield started
    finally:
        started.stop()


def running(process: psutil.Process) -> bool:
    """Not gone, nor a zombie: an orphan that has exited stays one until init reaps it."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def end_now(process) -> None:
    """A server the tests are done with, ended at once: its supervisor stopped, then SIGKILL to it and its
    python-backend processes, then its temporary folders removed.  A graceful stop (``serve.stop``) waits
    for the clients' idle connections (``--exit-timeout-secs``); the tests of stopping call that one."""
    supervisor = getattr(process, "supervisor", None)
    if supervisor is not None:
        supervisor.stop()
    kill_server({"process": process})
    process.remove_temporary_files()


def end_serve(process) -> None:
    """A ``nexus-sli serve`` process a failed test left running, with what it started (Triton, the gateway, a
    background search): Ctrl-C to its process group (started with ``start_new_session``), as a terminal sends
    it, then SIGKILL to the group: all at once, without the seconds of Triton's own stop on its parent's death."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def kill_server(server: dict) -> None:
    """A crash: SIGKILL to the server alone (its python-backend processes are ended after it).  The shared
    memory its backends made is removed afterwards: a killed server leaves it in /dev/shm, where every test
    run would add more."""
    process = server["process"]
    family = _family(process)
    regions = _shared_memory(family)
    if process.poll() is None:
        os.kill(process.pid, signal.SIGKILL)
    process.wait(30)
    for orphan in family[1:]:
        with contextlib.suppress(psutil.NoSuchProcess):
            orphan.kill()
    wait_exited(family[1:], timeout=30)
    for region in regions:
        Path(region).unlink(missing_ok=True)


def _family(process) -> list[psutil.Process]:
    """The server and its python-backend processes (none once it has exited)."""
    try:
        server = psutil.Process(process.pid)
        return [server, *server.children()]
    except psutil.NoSuchProcess:
        return []


def _shared_memory(processes: list[psutil.Process]) -> set[str]:
    """The /dev/shm regions ``processes`` have mapped (Triton's backends share tensors through them)."""
    regions: set[str] = set()
    for process in processes:
        with contextlib.suppress(psutil.Error):
            regions |= {m.path for m in process.memory_maps() if m.path.startswith("/dev/shm/")}
    return regions
