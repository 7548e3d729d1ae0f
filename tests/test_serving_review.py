"""The local serving runtime's edges, with stand-ins for tritonserver (no real server starts here): the keeper
when a start fails, Ctrl-C reaching tritonserver too and Ctrl-C twice, who answers on the server's port, a search
stopped before its export starts, and the joined shadow a swap rewrites (exporter/serving/)."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from nexus_sli.exporter.serving import gpu_on_cpu
from nexus_sli.exporter.serving import server as serve
from nexus_sli.exporter.serving.binary import ServerError
from nexus_sli.exporter.serving.keeper import KeptServer
from nexus_sli.exporter.serving.launcher import ServerCommand, check_identity, stop, wait_exited
from nexus_sli.exporter.serving.search import BackgroundSearch, ModelChoice
from nexus_sli.exporter.triton import config as tc
from helpers.waiting import wait_until


class _Sleeper(subprocess.Popen):
    """A stand-in for tritonserver: a process that waits, without a supervisor."""

    supervisor = None

    def __init__(self):
        super().__init__(["sleep", "600"])


def test_starts_again_that_fail_with_any_error_are_tried_within_the_limit_then_leave_the_server_down():
    launched = []

    def launch():
        if launched:  # the repository read in the middle of an export, say: not a ServerError
            raise FileNotFoundError("tiny_encoder/config.pbtxt")
        launched.append(_Sleeper())
        return launched[-1]

    kept = KeptServer(launch, max_restarts=3, interval=0.05, retry_pause_s=0.05)
    try:
        launched[0].kill()  # dies by itself; starting it again fails
        assert kept.wait(10) == -signal.SIGKILL  # down for good, said: serve exits instead of waiting on it
        assert len(kept.failed_starts) == 3 and kept.restarts == []
    finally:
        kept.stop(grace=0)


def test_a_start_again_that_failed_once_is_tried_again_and_serves():
    launched, failures = [], [FileNotFoundError("tiny_encoder/config.pbtxt")]

    def launch():
        if launched and failures:
            raise failures.pop()
        launched.append(_Sleeper())
        return launched[-1]

    kept = KeptServer(launch, interval=0.05, retry_pause_s=0.05)
    try:
        launched[0].kill()
        wait_until(lambda: kept.restarts, "the second start again", 10)
        assert kept.process is launched[1] and kept.poll() is None and len(kept.failed_starts) == 1
        assert kept.restarts[0][1] == "exited by itself (signal 9)"
    finally:
        kept.stop(grace=0)


def test_a_server_the_keeper_started_again_is_not_signalled_when_the_keeper_stops_keeping():
    """serve arms each server to end with the thread that started it (parent_death): a server started again
    comes from the keeper's thread, which must outlive it, or it would be stopped before the gateway is."""
    from nexus_sli.exporter.serving.parent_death import dies_with_parent

    launched = []

    def launch():
        launched.append(subprocess.Popen(["sleep", "600"], preexec_fn=dies_with_parent()))
        launched[-1].supervisor = None
        return launched[-1]

    kept = KeptServer(launch, interval=0.05)
    try:
        launched[0].kill()
        wait_until(lambda: len(launched) == 2 and kept.process is launched[1], "a start again", 10)
        kept.stop_keeping()
        time.sleep(0.5)  # ten of the keeper's intervals: its thread, were it to end now, would have
        assert launched[1].poll() is None, "the server started again was stopped with the keeper's thread"
    finally:
        kept.stop(grace=0)
    assert launched[1].poll() is not None


@pytest.fixture
def launched(monkeypatch):
    """The stand-ins :func:`serve.serve_forever` starts, in order (stopped after the test); serve's SIGTERM
    handler is put back after it too."""
    started = []
    monkeypatch.setattr(serve, "start", lambda *_, **__: started.append(_Sleeper()) or started[-1])
    previous = signal.getsignal(signal.SIGTERM)
    yield started
    signal.signal(signal.SIGTERM, previous)
    for process in started:
        stop(process, grace=0)


def test_a_ctrl_c_that_reaches_tritonserver_too_does_not_start_it_again(launched):
    """A terminal's Ctrl-C reaches serve's whole process group: tritonserver ends by itself while serve still
    stops the search and the gateway, and the keeper must not take that for a crash."""

    class Interrupted:
        """The background search, started as the Ctrl-C arrives, and stopped after tritonserver has ended."""

        def __init__(self, kept):
            self.kept = kept

        def start(self):
            raise KeyboardInterrupt

        def stop(self):
            launched[0].send_signal(signal.SIGINT)  # the terminal's, to tritonserver
            launched[0].wait()
            self.kept.wait(5)  # the keeper's watch ends (or, wrongly, starts it again meanwhile)

    assert serve.serve_forever(Path("repo"), 1, 2, 3, "127.0.0.1", background=Interrupted) == 0
    assert len(launched) == 1, "tritonserver was started again while serve stopped"


def test_a_second_ctrl_c_while_serve_stops_still_stops_tritonserver(launched):

    class Impatient:
        """The background search: Ctrl-C as it starts, and again while it is being stopped."""

        def __init__(self, _):
            pass

        def start(self):
            raise KeyboardInterrupt

        def stop(self):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        serve.serve_forever(Path("repo"), 1, 2, 3, "127.0.0.1", background=Impatient)
    assert launched[0].poll() is not None, "tritonserver outlived serve"


@contextlib.contextmanager
def _answering(status):
    """An HTTP server on a free loopback port that answers every GET with ``status(headers)``; its port."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(status(self.headers))
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *_):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd.server_address[1]
    finally:
        httpd.shutdown()
        httpd.server_close()


KEY = "our-secret"
OURS = lambda headers: 200 if headers.get(serve.ADMIN_HEADER) == KEY else 403  # noqa: E731


@pytest.mark.parametrize("status, ours", [
    (OURS, True),
    (lambda _: 200, False),  # a plain tritonserver (nothing restricted) already on the port
    (lambda _: 403, False),  # one restricted with its own secret
])
def test_the_server_on_the_port_is_ours_only_if_it_refuses_its_apis_without_our_secret(status, ours):
    with _answering(status) as port:
        if ours:
            check_identity("127.0.0.1", port, KEY)
        else:
            with pytest.raises(ServerError, match=f"another server answers on port {port}"):
                check_identity("127.0.0.1", port, KEY)


def _repository(path: Path, encoder_kind=tc.pb.ModelInstanceGroup.KIND_CPU) -> Path:
    """A repository a batched ensemble of which serve joins: a python tokenizer, an ONNX encoder, the ensemble."""
    tokenizer = tc.pb.ModelConfig(name="tiny_tokenizer", backend="python", max_batch_size=8)
    tokenizer.dynamic_batching.max_queue_delay_microseconds = 100
    encoder = tc.pb.ModelConfig(name="tiny_encoder", platform="onnxruntime_onnx", max_batch_size=8)
    encoder.instance_group.add(kind=encoder_kind, count=1)
    ensemble = tc.pb.ModelConfig(name="tiny", platform="ensemble", max_batch_size=8)
    for step in (tokenizer, encoder):
        ensemble.ensemble_scheduling.step.add(model_name=step.name, model_version=-1)
    for config in (tokenizer, encoder, ensemble):
        (path / config.name / "1").mkdir(parents=True)
        tc.write(config, path / config.name)
    return path


@pytest.mark.parametrize("gpu_models", [False, True])
def test_the_joined_shadow_a_swap_rewrites_is_recorded_with_gpu_models_on_cpu_asked(gpu_models, tmp_path,
                                                                                      monkeypatch):
    """A swap (the search's) rewrites the joined shadow's entries from the repository: where the flag made no
    shadow of its own (a CPU export), the joined one must be known, or the swapped models load from stale links;
    over the GPU models' shadow it must not be rewritten from the repository's KIND_GPU configs."""
    kind = tc.pb.ModelInstanceGroup.KIND_GPU if gpu_models else tc.pb.ModelInstanceGroup.KIND_CPU
    repository = _repository(tmp_path / "repo", kind)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # this test's folders alone
    monkeypatch.setattr(gpu_on_cpu, "gpu_visible", lambda: False)
    monkeypatch.setattr(serve, "system_binary", lambda: None)
    served = []
    monkeypatch.setattr(serve, "server_command", lambda repository, *_, **__: served.append(repository) or
                        ServerCommand(["sleep", "600"], dict(os.environ), None))
    monkeypatch.setattr(serve, "wait_ready", lambda *_: None)
    monkeypatch.setattr(serve, "check_identity", lambda *_: None)
    process = serve.start(repository, gpu_on_cpu=True, supervise=False)
    try:
        assert served[0] != repository.resolve()  # served from a shadow
        if gpu_models:
            assert process.joined is None
        else:
            shadow, _ = process.joined
            assert shadow == served[0] and tc.read(shadow / "tiny" / "config.pbtxt").backend == "python"
    finally:
        stop(process, grace=0)
    assert [p.name for p in tmp_path.iterdir()] == ["repo"]  # the shadows and backend folder went with it


def test_a_search_stopped_before_its_export_starts_starts_none(tmp_path):
    """serve stopped (Ctrl-C) between the search's start and its export's: no export is left to run on."""
    repository = tmp_path / "repo"
    (repository / "tiny_encoder").mkdir(parents=True)
    (repository / "tiny_encoder" / "config.pbtxt").write_text('name: "tiny_encoder"\n')
    (repository / "tiny_encoder" / "validation.json").write_text(
        json.dumps({"backend": "onnxruntime", "precision": "fp32", "graph": "plain"}))
    started = tmp_path / "export-started"

    class Marking(ModelChoice):
        def export_command(self, out, name="", first=False):
            return [sys.executable, "-c", f"open({str(started)!r}, 'w')"]

    search = BackgroundSearch(Marking(), repository, "tiny", server=None)
    search.stop(grace=5)  # serve stopped ...
    search.run()  # ... before the search's thread reached its export
    assert search.outcome == "stopped" and not started.exists()


#: A stand-in for tritonserver after a crash, seen from its workers: a parent that never reaps its child
PARENT = ("import subprocess, sys, time\n"
          "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
          "print(child.pid, flush=True)\ntime.sleep(60)\n")
#: A process whose main thread has ended while another runs: its leader shows as a zombie
LEADER_GONE = ("import ctypes, threading, time\n"
               "threading.Thread(target=time.sleep, args=(60,)).start()\n"
               "ctypes.CDLL(None).pthread_exit(None)\n")


def test_a_killed_worker_counts_as_exited_while_a_zombie_and_a_live_one_is_waited_for_until_the_timeout():
    """A crashed server's workers, once killed, are zombies until PID 1 reaps them (a second or two on some
    machines): they hold no socket by then, so a restart does not wait for the reaping.  A process whose main
    thread alone has ended also shows as a zombie, and is waited for."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    leader_gone = subprocess.Popen([sys.executable, "-c", LEADER_GONE])
    try:
        worker = psutil.Process(int(parent.stdout.readline()))
        worker.kill()  # a zombie for as long as its parent lives: nobody reaps it
        started = time.monotonic()
        wait_exited([worker], timeout=10)
        assert time.monotonic() - started < 1 and worker.status() == psutil.STATUS_ZOMBIE
        threads = psutil.Process(leader_gone.pid)
        wait_until(lambda: threads.status() == psutil.STATUS_ZOMBIE, "the main thread to end", 10)
        for still_running in (psutil.Process(live.pid), threads):
            started = time.monotonic()
            wait_exited([worker, still_running], timeout=0.5)
            assert 0.5 <= time.monotonic() - started < 5 and still_running.is_running()
    finally:
        for process in (parent, live, leader_gone):
            process.kill()
            process.wait()
        parent.stdout.close()


def test_a_zombie_of_this_process_is_reaped_once_waited_for():
    """Where ``nexus-sli serve`` is the workers' subreaper (a container's PID 1), it reaps them: none piles up."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    zombie = psutil.Process(child.pid)
    os.kill(child.pid, signal.SIGKILL)
    wait_until(lambda: zombie.status() == psutil.STATUS_ZOMBIE, "the child to die", 10)
    wait_exited([zombie], timeout=10)
    with pytest.raises(ChildProcessError):
        os.waitpid(child.pid, os.WNOHANG)  # reaped already
    child.returncode = -signal.SIGKILL  # Popen's own wait would look for it again


def test_a_tensorrt_plan_is_refused_on_the_cpu_though_gpu_models_on_cpu_is_asked(tmp_path, monkeypatch):
    """Triton has no TensorRT backend here: the shadow would make it fail to load the plan, and exit."""
    config = tc.pb.ModelConfig(name="m_encoder", platform="tensorrt_plan", max_batch_size=64)
    config.instance_group.add(kind=tc.pb.ModelInstanceGroup.KIND_GPU, count=1)
    tc.write(config, tmp_path / "m_encoder")
    monkeypatch.setattr(gpu_on_cpu, "gpu_visible", lambda: False)
    with pytest.raises(gpu_on_cpu.NexusError, match="m_encoder: a TensorRT plan runs on a GPU only"):
        gpu_on_cpu.servable(tmp_path, gpu_on_cpu=True)
