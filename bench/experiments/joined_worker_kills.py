"""SIGKILLs of the joined model's worker under load: how many calls fail, and does tritonserver survive?

An experiment, not part of the product or of ``make bench``; its findings are in bench/data/tried.md,
"A killed joined worker under load".  ``nexus-sli serve`` of this checkout (its default: each batched CPU
ensemble's steps in one python-backend process) serves REPOSITORY with its gateway.  ``--grpc-clients``
threads with ``EncoderClient`` (its default retries) and ``--openai-clients`` threads with the ``openai`` SDK
(its default retries) through the gateway embed 8 short texts again and again.  ``--kills`` times: once every
client has been answered since the last kill, the joined model's worker (the python-backend stub whose model
folder is ``--model``) is SIGKILLed, and the experiment waits until the model has a live worker again and
every client has been answered after that.  Per kill it records whether tritonserver lived (the same
process), the seconds until a new worker ran and until every client was answered again, the dead workers
(zombies) tritonserver holds, its memory (RSS) and the shared memory it maps; at the end the calls and the
failed calls by error, and what the serve command said (an abort, the keeper starting tritonserver again).
``--server-kills`` then SIGABRTs tritonserver itself that many times, as the python backend's abort ends it::

    .venv/bin/python bench/experiments/joined_worker_kills.py REPOSITORY --kills 40 --server-kills 2
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import psutil

from nexus_sli.bench.cpu_classes import cpu_class
from nexus_sli.bench.machine import machine_info
from nexus_sli.bench.served import free_ports
from nexus_sli.client import EncoderClient

TEXTS = ["the cat sat on the mat", "a storm is coming", "water boils at 100 degrees", "hello world",
         "they found water in the cellar", "short", "numbers 1 2 3", "the end"]
STUB = "triton_python_backend_stub"
#: how long one kill may take to recover (a restarted tritonserver included) before the experiment gives up
RECOVERY_S = 300.0


class _Caller(threading.Thread):
    """Calls ``call`` again and again; keeps each call's end time and its error (None: answered)."""

    def __init__(self, call):
        super().__init__(daemon=True)
        self.call, self.stopping = call, threading.Event()
        self.results: list[tuple[float, str | None]] = []

    def run(self):
        while not self.stopping.is_set():
            try:
                self.call()
                self.results.append((time.monotonic(), None))
            except Exception as exc:  # noqa: BLE001 - counted, by kind
                self.results.append((time.monotonic(), f"{type(exc).__name__}: {str(exc)[:160]}"))
                time.sleep(0.05)

    def answered_since(self, moment: float) -> bool:
        return any(t > moment and error is None for t, error in self.results[-50:])


def _grpc_caller(url: str, model: str) -> _Caller:
    client = EncoderClient(url, model=model)
    return _Caller(lambda: client.embed(TEXTS))


def _openai_caller(url: str, model: str) -> _Caller:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)
    return _Caller(lambda: client.embeddings.create(model=model, input=TEXTS))


def _triton(serve: psutil.Process) -> psutil.Process | None:
    """The tritonserver process that ``nexus-sli serve`` runs now."""
    for child in serve.children():
        try:
            if child.name() == "tritonserver" and child.status() != psutil.STATUS_ZOMBIE:
                return child
        except psutil.Error:
            continue
    return None


def _workers(triton: psutil.Process, model: str) -> tuple[list[psutil.Process], int]:
    """(the live python-backend workers of ``model``, the dead workers tritonserver has not reaped)."""
    live, dead = [], 0
    for child in triton.children():
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                dead += child.name() == STUB[:15]  # /proc's name of a zombie: the first 15 characters
                continue
            argv = child.cmdline()
        except psutil.Error:
            continue
        if len(argv) > 1 and Path(argv[0]).name == STUB and Path(argv[1]).parent.parent.name == model:
            live.append(child)
    return live, dead


def _shared_memory_mb(triton: psutil.Process) -> float:
    """The shared memory regions tritonserver maps (its workers' and its dead workers'), in MiB."""
    regions = {m.path for m in triton.memory_maps() if m.path.startswith("/dev/shm/")}
    return sum(Path(r).stat().st_size for r in regions if Path(r).exists()) / 2**20


def _wait(condition, what: str, timeout: float = RECOVERY_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError(f"gave up waiting for {what}")


def _kill_once(serve: psutil.Process, model: str, callers: list[_Caller], server: bool = False) -> dict:
    """SIGKILL to a worker of ``model``, or with ``server`` SIGABRT to tritonserver (as the python backend's
    abort ends it); the record once every client has been answered after the model was served again."""
    triton = _wait(lambda: _triton(serve), "tritonserver")
    victim = triton if server else _wait(lambda: (_workers(triton, model)[0] or [None])[0], f"a worker of {model}")
    _wait(lambda: all(c.answered_since(time.monotonic() - 5) for c in callers), "every client to be answered")
    killed = time.monotonic()
    victim.send_signal(signal.SIGABRT if server else signal.SIGKILL)
    # a new worker of the model, in the same tritonserver or in one started again; then every client answered
    _wait(lambda: (t := _triton(serve)) and (not server or t.pid != triton.pid)
          and any(w.pid != victim.pid for w in _workers(t, model)[0]), f"a new worker of {model}")
    served = time.monotonic() - killed
    _wait(lambda: all(c.answered_since(killed + served) for c in callers), "every client to be answered again")
    after = _triton(serve)
    live, dead = _workers(after, model)
    return {"killed": "tritonserver" if server else "worker", "triton_pid": triton.pid,
            "triton_survived": after.pid == triton.pid,
            "new_worker_s": round(served, 2), "recovered_s": round(time.monotonic() - killed, 2),
            "live_workers": len(live), "dead_workers": dead, "triton_rss_mb": round(after.memory_info().rss / 2**20, 1),
            "triton_shared_memory_mb": round(_shared_memory_mb(after), 1)}


def _serve(repository: Path, ports: list[int], log: Path) -> subprocess.Popen:
    checkout = Path(__file__).resolve().parents[2]
    http, grpc, metrics, gateway = ports
    with open(log, "ab") as out:
        return subprocess.Popen([str(checkout / ".venv" / "bin" / "nexus-sli"), "serve", "--model-repository",
                                 str(repository), "--http-port", str(http), "--grpc-port", str(grpc),
                                 "--metrics-port", str(metrics), "--gateway-port", str(gateway)],
                                stdout=out, stderr=subprocess.STDOUT)


def _wait_served(ports: list[int], model: str, serve: subprocess.Popen) -> None:
    def answers():
        if serve.poll() is not None:
            raise RuntimeError(f"nexus-sli serve exited with code {serve.returncode}")
        try:
            with EncoderClient(f"127.0.0.1:{ports[1]}", model=model, retry_s=0) as client:
                return client.embed(TEXTS) is not None
        except Exception:  # noqa: BLE001 - not up yet
            return False

    _wait(answers, "the server to answer")
    import urllib.request

    _wait(lambda: _ok(urllib.request, f"http://127.0.0.1:{ports[3]}/health"), "the gateway")


def _ok(request, url: str) -> bool:
    try:
        with request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("repository", type=Path)
    parser.add_argument("--model", default="all_minilm_l6_v2")
    parser.add_argument("--kills", type=int, default=20, help="SIGKILLs of the joined model's worker")
    parser.add_argument("--server-kills", type=int, default=0,
                        help="then SIGABRTs of tritonserver itself (nexus-sli serve starts it again)")
    parser.add_argument("--grpc-clients", type=int, default=8)
    parser.add_argument("--openai-clients", type=int, default=8)
    parser.add_argument("--out", type=Path, help="where the JSON record goes (default: printed only)")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="joined-kills-"))
    log, ports = work / "serve.log", free_ports(4)
    serve = _serve(args.repository, ports, log)
    callers: list[_Caller] = []
    kills, began = [], time.monotonic()
    try:
        _wait_served(ports, args.model, serve)
        callers = [_grpc_caller(f"127.0.0.1:{ports[1]}", args.model) for _ in range(args.grpc_clients)]
        callers += [_openai_caller(f"http://127.0.0.1:{ports[3]}", args.model) for _ in range(args.openai_clients)]
        for caller in callers:
            caller.start()
        for number in range(args.kills + args.server_kills):
            record = _kill_once(psutil.Process(serve.pid), args.model, callers, server=number >= args.kills)
            record["failed_calls_so_far"] = sum(error is not None for c in callers for _, error in c.results)
            kills.append(record)
            print(f"kill {number + 1}: {json.dumps(record)}", flush=True)
    finally:
        for caller in callers:
            caller.stopping.set()
        for caller in callers:
            caller.join(60)
        if serve.poll() is None:
            serve.send_signal(signal.SIGINT)
            serve.wait(60)
    errors = collections.Counter(error for c in callers for _, error in c.results if error is not None)
    output = log.read_text(errors="replace")
    summary = {
        "machine": {**machine_info(), "class": cpu_class(machine_info()["flags"])},
        "model": args.model, "grpc_clients": args.grpc_clients, "openai_clients": args.openai_clients,
        "worker_kills": sum(k["killed"] == "worker" for k in kills),
        # a tritonserver that is not the same after a worker's kill: aborted, or stopped for its dead workers
        "worker_kills_triton_replaced": sum(k["killed"] == "worker" and not k["triton_survived"] for k in kills),
        "server_kills": sum(k["killed"] == "tritonserver" for k in kills),
        "calls": sum(len(c.results) for c in callers), "failed_calls": sum(errors.values()),
        "errors": dict(errors.most_common(10)), "seconds": round(time.monotonic() - began, 1),
        # the keeper's words (exporter/serving/keeper.py): a server that died, and one stopped for its dead workers
        "server_died": sum("tritonserver exited by itself" in line for line in output.splitlines()),
        "server_recycled": sum("dead python-backend workers" in line for line in output.splitlines()),
        "server_log": [line for line in output.splitlines() if "terminate called" in line or "what():" in line
                       or "lock_exception" in line or "Signal (" in line or "tritonserver" in line][:40],
        "per_kill": kills,
    }
    # every tritonserver that ended by itself and was not SIGABRTed here was aborted by a worker's kill
    summary["worker_kills_aborted_triton"] = summary["server_died"] - summary["server_kills"]
    print(json.dumps({k: v for k, v in summary.items() if k not in ("per_kill", "machine")}, indent=2))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
        shutil.copy(log, args.out.with_suffix(".log"))
        shutil.rmtree(work, ignore_errors=True)
    print(f"serve output: {args.out.with_suffix('.log') if args.out else log}")


if __name__ == "__main__":
    main()
