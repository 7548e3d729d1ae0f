"""The stub supervisor's thread lives through whatever one check meets: a Triton that cuts an answer short, answers
with something that is not HTTP, or with JSON of another shape, is logged and tried again after the backoff.

Triton is stood in for by a local HTTP server answering the routes the supervisor calls, and the server process by
a Python process whose child runs as ``triton_python_backend_stub <repository>/<model>/1/model.py``, as Triton's
python-backend workers do: the supervisor finds it, and a SIGKILL leaves it a zombie, as Triton leaves its workers.
"""

from __future__ import annotations

import http.server
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager, suppress
from pathlib import Path

import psutil
import pytest

from nexus_sli.exporter.serving import stub_supervisor
from nexus_sli.exporter.serving.backend_folders import STUB_EXECUTABLE
from nexus_sli.exporter.serving.stub_supervisor import StubSupervisor
from helpers.waiting import wait_until

MODEL = "encoder"
INDEX, HEALTH, READY = "/v2/repository/index", "/v2/health/live", "/v2/health/ready"
UNLOAD, LOAD = f"/v2/repository/models/{MODEL}/unload", f"/v2/repository/models/{MODEL}/load"
#: seconds between two checks: short, since every test waits for checks
INTERVAL = 0.02

#: The server: starts its worker (naming itself, as Triton does), never reaps it (a worker that dies stays a
#: zombie), and waits to be killed
SERVER = "import os, signal, subprocess, sys\nsubprocess.Popen(sys.argv[1:] + [str(os.getpid())])\nsignal.pause()\n"
#: A worker's model.py: runs until its server is gone, as Triton's stub does
WORKER = "import os, sys, time\nwhile os.getppid() == int(sys.argv[-1]):\n    time.sleep(0.05)\n"


def cut_short(handler, body: bytes) -> None:
    """Headers that promise more than is sent, then the connection closed (``IncompleteRead``)."""
    handler.send_response(200)
    handler.send_header("Content-Length", str(len(body) + 100))
    handler.end_headers()
    handler.wfile.write(body)


def not_http(handler, body: bytes) -> None:
    """A line that is no HTTP status line (``BadStatusLine``)."""
    handler.wfile.write(b"garbage\r\n\r\n")


def unnamed(handler, body: bytes) -> None:
    """An index whose entries have no name (``KeyError``)."""
    well_formed(handler, json.dumps([{"model": MODEL, "state": "READY"}]).encode())


def well_formed(handler, body: bytes) -> None:
    handler.send_response(200)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self._answer()

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._answer()

    def _answer(self):
        triton = self.server
        triton.requests.append((time.monotonic(), self.path))
        if self.path not in triton.answers:
            self.send_error(404)
            return
        faults = triton.faults.get(self.path)
        answer = faults.pop(0) if faults else well_formed
        answer(self, triton.answers[self.path])

    def log_message(self, *args):
        pass


class TritonStandIn(http.server.ThreadingHTTPServer):
    """The routes of Triton the supervisor calls, on loopback: ``MODEL`` ready, its loads and unloads done.
    ``faults``: route -> the answers (functions above) given in place of its next well-formed ones;
    ``requests``: (time.monotonic(), route) of every request."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.answers = {INDEX: json.dumps([{"name": MODEL, "version": "1", "state": "READY"}]).encode(),
                        HEALTH: b"", READY: b"", UNLOAD: b"", LOAD: b""}
        self.faults: dict[str, list] = {}
        self.requests: list[tuple[float, str]] = []
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def routes(self) -> list[str]:
        return [route for _, route in self.requests]

    def times(self, route: str) -> list[float]:
        return [at for at, asked in self.requests if asked == route]


@pytest.fixture
def triton():
    server = TritonStandIn()
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture
def repository(tmp_path) -> Path:
    folder = tmp_path.resolve() / "repository"
    (folder / MODEL / "1").mkdir(parents=True)
    (folder / MODEL / "1" / "model.py").write_text(WORKER)
    return folder


@pytest.fixture
def server(tmp_path, repository):
    """The process standing in for tritonserver, once its one worker runs."""
    stub = tmp_path / STUB_EXECUTABLE
    stub.symlink_to(sys.executable)
    process = subprocess.Popen([sys.executable, "-c", SERVER, str(stub), str(repository / MODEL / "1" / "model.py")])
    started = []
    try:
        started = wait_until(lambda: workers(process), "the worker to start", timeout=10)
        yield process
    finally:
        for worker in started:
            with suppress(psutil.NoSuchProcess):
                worker.kill()
        process.kill()
        process.wait()


def workers(server) -> list:
    return [child for child in psutil.Process(server.pid).children()
            if [Path(arg).name for arg in child.cmdline()[:1]] == [STUB_EXECUTABLE]]


@contextmanager
def supervising(server, repository, triton, faults=None, answers=None, interval=INTERVAL):
    """A supervisor of ``server``, started once ``triton`` gives ``faults`` and ``answers`` (after the ones the
    supervisor asks for when it starts), whose worker is then killed; stopped on leaving."""
    supervisor = StubSupervisor(server, repository, triton.url, "secret", interval=interval)
    triton.faults.update(faults or {})
    triton.answers.update(answers or {})
    supervisor.start()
    try:
        os.kill(workers(server)[0].pid, signal.SIGKILL)
        yield supervisor
    finally:
        supervisor.stop()


def reloaded_or_ended(supervisor) -> list:
    """Waits for the first reload, or the thread's end (the failure these tests look for)."""
    wait_until(lambda: supervisor.restarts or not supervisor.is_alive(), "a reload", timeout=5, poll_s=0.01)
    assert supervisor.is_alive(), "the supervisor's thread ended"
    return supervisor.restarts


def errors(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == stub_supervisor.log.name and r.levelno >= logging.ERROR]


@pytest.mark.parametrize("route, fault, error", [
    (UNLOAD, cut_short, "IncompleteRead"),
    (LOAD, not_http, "BadStatusLine"),
    (INDEX, unnamed, "KeyError"),
])
def test_a_failed_reload_is_logged_and_tried_again(triton, server, repository, caplog, route, fault, error):
    with supervising(server, repository, triton, faults={route: [fault]}) as supervisor:
        restarts = reloaded_or_ended(supervisor)
    assert restarts[0][1] == MODEL
    assert triton.routes().count(route) >= 2, "the request that failed was not made again"
    logged = [r.getMessage() for r in errors(caplog)]
    assert logged and f"reload model {MODEL}" in logged[0] and error in logged[0], logged


def test_a_health_answer_that_is_not_http_reads_as_not_serving(triton, server, repository, caplog):
    with supervising(server, repository, triton, faults={HEALTH: [not_http] * 3}) as supervisor:
        reloaded_or_ended(supervisor)
    assert triton.routes().count(HEALTH) >= 4
    assert not errors(caplog), "a server going away is no failure to reload"


def test_an_unforeseen_failure_is_logged_with_its_traceback_and_backs_off(triton, server, repository, caplog):
    names = {INDEX: json.dumps([MODEL]).encode()}  # names, not entries: a TypeError in every reload
    with supervising(server, repository, triton, answers=names, interval=0.05) as supervisor:
        wait_until(lambda: len(triton.times(UNLOAD)) >= 4 or not supervisor.is_alive(), "four tries", timeout=5,
                   poll_s=0.01)
        assert supervisor.is_alive(), "the supervisor's thread ended"
    unloads = triton.times(UNLOAD)[:4]
    # waits of 0.1, 0.2 and 0.4 s between the tries; without the backoff, 0.05 s each
    assert unloads[-1] - unloads[0] >= 0.5, unloads
    logged = errors(caplog)
    assert logged and all(r.exc_info and r.exc_info[0] is TypeError for r in logged)
    assert f"reload model {MODEL}" in logged[0].getMessage()


def test_swapping_while_a_served_model_folder_is_gone(triton, server, repository):
    supervisor = StubSupervisor(server, repository, triton.url, "secret", interval=INTERVAL)
    shutil.rmtree(repository / MODEL)  # its worker goes on serving what it loaded
    with supervisor.swapping():  # on leaving, each worker's folder is looked through for a newer version
        pass


@pytest.mark.parametrize("fault", [cut_short, not_http])
def test_a_swap_that_loaded_is_not_failed_by_the_ready_models_unanswered_after_it(triton, server, repository,
                                                                                 caplog, fault):
    supervisor = StubSupervisor(server, repository, triton.url, "secret", interval=INTERVAL)
    triton.faults[INDEX] = [fault]
    with supervisor.swapping():
        pass
    assert supervisor._ready == {MODEL}
    assert any("could not read the ready models after a swap" in r.getMessage() for r in caplog.records)


def test_a_failed_swaps_error_is_the_one_raised_when_the_ready_models_go_unanswered(triton, server, repository):
    supervisor = StubSupervisor(server, repository, triton.url, "secret", interval=INTERVAL)
    triton.faults[INDEX] = [not_http]
    with pytest.raises(RuntimeError, match="the new models did not load"):
        with supervisor.swapping():
            raise RuntimeError("the new models did not load")


def test_the_wait_between_checks_stays_bounded(triton, server, repository):
    supervisor = StubSupervisor(server, repository, triton.url, "secret", interval=0.5)
    assert [supervisor._backoff(failures) for failures in (0, 3, 6, 5000)] == [0.5, 4.0, 30.0, 30.0]


def not_ready(handler, body: bytes) -> None:
    handler.send_response(503)
    handler.send_header("Content-Length", "0")
    handler.end_headers()


def test_a_reload_that_failed_is_tried_again_though_the_server_is_not_ready(triton, server, repository):
    """Triton is not ready while a model is unavailable (its failed load): the next reload must not wait for it."""
    with supervising(server, repository, triton, faults={LOAD: [not_http], READY: [not_ready] * 1000}) as supervisor:
        restarts = reloaded_or_ended(supervisor)
    assert restarts[0][1] == MODEL and triton.routes().count(LOAD) >= 2


def test_a_check_that_finds_every_worker_ends_the_backoff(triton, server, repository):
    supervisor = StubSupervisor(server, repository, triton.url, "secret", interval=INTERVAL)
    assert supervisor._check(failures=5) == 0  # else every later check would come 16 times later


def test_a_worker_that_dies_during_a_swap_of_other_models_is_reloaded_after_it(triton, server, repository):
    supervisor = StubSupervisor(server, repository, triton.url, "secret", interval=INTERVAL)
    with supervisor.swapping(["another_model"]):  # the supervisor checks nothing meanwhile
        os.kill(workers(server)[0].pid, signal.SIGKILL)
    assert supervisor._expected == {MODEL: 1}
    with supervisor.swapping([MODEL]):  # a model swapped in: its workers are the new ones, as many as run now
        pass
    assert supervisor._expected == {MODEL: 0}
    supervisor._expected = {MODEL: 1}
    supervisor.start()
    try:
        assert reloaded_or_ended(supervisor)[0][1] == MODEL
    finally:
        supervisor.stop()


def test_a_reloaded_model_is_expected_to_have_the_workers_its_load_started(triton, server, repository):
    """The stand-in's load starts no worker, as a re-export with fewer instances starts fewer: once reloaded, the
    model has what its configuration asks, and reloading it again and again would take it down each time."""
    supervisor = StubSupervisor(server, repository, triton.url, "secret", interval=INTERVAL)
    checks, check = [], supervisor._check
    supervisor._check = lambda failures: checks.append(failures) or check(failures)
    supervisor.start()
    try:
        os.kill(workers(server)[0].pid, signal.SIGKILL)
        reloaded_or_ended(supervisor)
        seen = len(checks)
        wait_until(lambda: len(checks) >= seen + 10, "ten more checks", timeout=5, poll_s=0.01)
    finally:
        supervisor.stop()
    assert [model for _, model in supervisor.restarts] == [MODEL]
    assert supervisor._expected == {MODEL: 0}
