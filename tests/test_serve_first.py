"""``nexus-sli serve`` on a folder with no model: the first export answers, the search's winner is swapped in
under load with no failed call, and a search stopped or failed leaves the first export served and nothing
half written, a re-export made while the search runs is never swapped out, and a first export stopped stops its
export process (exporter/serving/search.py, swap.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import openai
import psutil
import pytest

from nexus_sli.cli.main import main
from nexus_sli.client import EncoderClient
from nexus_sli.exporter.export.pipeline import ExportOptions, run_export
from nexus_sli.exporter.export.source import resolve_model
from nexus_sli.exporter.serving.search import BackgroundSearch, ModelChoice

from helpers.servers import end_serve, free_ports, running
from helpers.waiting import wait_for_line, wait_until

GATEWAY_READY = "gateway is ready"


#: serve started as a script's `&` starts it (a shell without job control): with SIGINT ignored, which it inherits
IGNORING_SIGINT = ["bash", "-c", 'trap "" INT; exec "$@"', "serve"]


def _serve(repository: Path, model: Path, log: Path, *options: str,
           prefix: tuple[str, ...] = ()) -> tuple[subprocess.Popen, dict]:
    http, grpc, metrics, gateway = free_ports(4)
    with open(log, "w") as out:
        process = subprocess.Popen([*prefix, sys.executable, "-m", "nexus_sli.cli.main", "serve",
                                    "--model-repository", str(repository), "--model", str(model), "--name", "tiny",
                                    "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
                                    "--gateway-port", str(gateway), *options], stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # a group of its own: a failed test ends it all
    return process, {"grpc": f"127.0.0.1:{grpc}", "gateway": f"http://127.0.0.1:{gateway}/v1"}


def _encoder(repository: Path) -> dict:
    return json.loads((repository / "tiny_encoder" / "validation.json").read_text())


def _left_beside(repository: Path) -> list[str]:
    """What a search or an export left beside the repository (its folders are hidden ones there)."""
    return sorted(p.name for p in repository.parent.iterdir() if p.name.startswith("."))


def test_the_search_winner_is_swapped_in_under_load_with_no_failed_call(tiny_checkpoint, tmp_path):
    repository = tmp_path / "repo"
    log = tmp_path / "serve.log"
    # the search asks for one configuration (OpenVINO fp32), so that it differs from the first export and wins
    process, urls = _serve(repository, tiny_checkpoint("bert"), log, "--backend", "openvino", "--precision", "fp32")
    stop, failures, answered = threading.Event(), [], {"openai": 0, "grpc": 0}

    def through_openai():
        client = openai.OpenAI(base_url=urls["gateway"], api_key="unused", max_retries=0, timeout=60)
        while not stop.is_set():
            try:
                client.embeddings.create(model="tiny", input=["a text", "another text"])
                answered["openai"] += 1
            except Exception as exc:  # noqa: BLE001 - every failure is counted and shown
                failures.append(f"openai: {exc!r}")

    def through_grpc():
        with EncoderClient(urls["grpc"], model="tiny") as client:
            while not stop.is_set():
                try:
                    client.embed(["a text", "another text"])
                    answered["grpc"] += 1
                except Exception as exc:  # noqa: BLE001
                    failures.append(f"grpc: {exc!r}")

    try:
        wait_for_line(process, log, GATEWAY_READY, timeout=180)
        served_first = _encoder(repository)
        assert (served_first["backend"], served_first["precision"], served_first["graph"]) == (
            "onnxruntime", "fp32", "plain")
        assert [row["graph"] for row in served_first["measured"]] == ["plain"]  # the one graph, nothing searched
        watcher = EncoderClient(urls["grpc"], model="tiny")  # its description cached before the swap
        assert watcher.info("tiny").backend == "onnxruntime"
        clients = [threading.Thread(target=f) for f in (through_openai, through_grpc) * 2]
        for client in clients:
            client.start()
        wait_until(lambda: min(answered.values()) > 0, "both APIs answering", timeout=60)
        wait_for_line(process, log, "now serving openvino fp32", timeout=240)
        before = answered["grpc"]
        wait_until(lambda: answered["grpc"] > before + 20, "calls after the swap", timeout=60)
        watcher.embed("an answer from the new version")  # which says the description changed
        assert watcher.info("tiny").backend == "openvino"
        watcher.close()
        stop.set()
        for client in clients:
            client.join(60)
        assert failures == [], failures[:5]
        assert min(answered.values()) > 20, answered
        assert _encoder(repository)["backend"] == "openvino"
        assert sorted(p.name for p in (repository / "tiny_encoder").iterdir() if p.is_dir()) == ["2"]
        # the gateway reads its catalog again within its discovery interval
        models = openai.OpenAI(base_url=urls["gateway"], api_key="unused", max_retries=0)
        wait_until(lambda: models.models.list().data[0].model_extra["backend"] == "openvino",
                   "the gateway to describe the new backend", timeout=30)
        process.send_signal(signal.SIGINT)
        assert process.wait(60) == 0
    finally:
        stop.set()
        end_serve(process)
    assert _left_beside(repository) == []


def test_a_stopped_or_failed_search_leaves_the_first_export_served_and_nothing_half_written(tiny_checkpoint, tmp_path):
    repository = tmp_path / "repo"
    log = tmp_path / "serve.log"
    # auto: a search of every configuration; started with SIGINT ignored, which serve must not keep (Ctrl-C below)
    process, urls = _serve(repository, tiny_checkpoint("bert"), log, prefix=IGNORING_SIGINT)
    try:
        # the search's export under way (the first export says the same, unprefixed, before the server is up)
        wait_for_line(process, log, "search: nexus-sli: onnxruntime fp32: making the candidate graphs", timeout=180)
        with EncoderClient(urls["grpc"], model="tiny") as client:
            hidden = json.loads((tiny_checkpoint("bert") / "config.json").read_text())["hidden_size"]
            assert client.embed("served meanwhile").shape == (hidden,)
        process.send_signal(signal.SIGINT)  # Ctrl-C
        assert process.wait(90) == 0
    finally:
        end_serve(process)
    report = _encoder(repository)
    assert (report["backend"], report["precision"], report["graph"]) == ("onnxruntime", "fp32", "plain")
    assert sorted(p.name for p in (repository / "tiny_encoder").iterdir() if p.is_dir()) == ["1"]
    assert _left_beside(repository) == []
    assert "swapping in" not in log.read_text()

    # a search that fails (ONNX Runtime serves no bf16: its export exits at once) leaves it as it was too
    before = {p.relative_to(repository): p.stat().st_mtime_ns for p in repository.rglob("*")}
    search = BackgroundSearch(ModelChoice(model=str(tiny_checkpoint("bert")), name="tiny", backend="onnxruntime",
                                          precision="bf16"), repository, "tiny", server=None)
    search.run()
    assert search.outcome == "failed"
    assert {p.relative_to(repository): p.stat().st_mtime_ns for p in repository.rglob("*")} == before
    assert _left_beside(repository) == []


def test_serve_killed_during_its_search_leaves_nothing_running_and_the_next_serve_clears_its_folders(
        tiny_checkpoint, tmp_path):
    repository = tmp_path / "repo"
    log = tmp_path / "serve.log"
    process, _ = _serve(repository, tiny_checkpoint("bert"), log, "--backend", "openvino", "--precision", "fp32")
    try:
        wait_for_line(process, log, "search: nexus-sli:", timeout=180)  # the search's export under way
        started = psutil.Process(process.pid).children(recursive=True)  # Triton, its workers, the gateway, the export
        exporting = [p for p in started if "export" in p.cmdline()]
        assert exporting, [p.cmdline() for p in started]
        process.kill()  # kill -9: serve runs no clean-up of its own
        process.wait()
        wait_until(lambda: not any(running(p) for p in started), "what serve started to end with it", timeout=90)
    finally:
        end_serve(process)
    # the search's own folder stays until the next serve (and its export's staging folder, where the export was
    # stopped before it could remove it: its SIGINT's clean-up is its own)
    left = _left_beside(repository)
    searches = [name for name in left if ".staging-" not in name]
    assert len(searches) == 1 and searches[0].startswith(".repo-search-"), left
    # which removes them though it searches for nothing (the repository holds a model now); this one stops at
    # once, on a port in use
    grpc, metrics = free_ports(2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main(["serve", "--model-repository", str(repository), "--http-port", str(taken.getsockname()[1]),
                     "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--gateway-port", "0"]) == 2
    assert _left_beside(repository) == []


def test_a_re_export_made_while_the_search_runs_is_kept_not_swapped_out(tiny_checkpoint, tmp_path):
    repository = tmp_path / "repo"
    log = tmp_path / "serve.log"
    # the user's re-export of the model: made beforehand, and published into the served repository while the
    # search runs the way an export's last step publishes, each staged folder renamed into place
    staged = tmp_path / "staged"
    run_export(ExportOptions(model=str(tiny_checkpoint("bert")), name="tiny", out=staged, search=False))
    user = {p.name: p.stat().st_ino for p in staged.iterdir() if (p / "config.pbtxt").is_file()}
    user_report = (staged / "tiny_encoder" / "validation.json").read_bytes()
    process, urls = _serve(repository, tiny_checkpoint("bert"), log, "--backend", "openvino", "--precision", "fp32")
    try:
        wait_for_line(process, log, "search: nexus-sli:", timeout=180)  # the search's export under way
        for name in user:
            os.rename(repository / name, tmp_path / f"replaced-{name}")
            os.rename(staged / name, repository / name)
        ended = wait_until(lambda: next((line for line in log.read_text().splitlines()
                                         if "not swapping in" in line or "now serving openvino" in line), None),
                           "the search to end", timeout=240)
        assert "not swapping in the search's winner (openvino fp32 plain)" in ended, ended
        assert "tiny, tiny_encoder, tiny_tokenizer, tiny_tokens changed in" in ended
        with EncoderClient(urls["grpc"], model="tiny") as client:  # the server serves what it loaded
            assert client.info("tiny").backend == "onnxruntime"
            client.embed("still served")
        process.send_signal(signal.SIGINT)
        assert process.wait(60) == 0
    finally:
        end_serve(process)
    assert {name: (repository / name).stat().st_ino for name in user} == user  # the user's folders, untouched
    assert (repository / "tiny_encoder" / "validation.json").read_bytes() == user_report
    assert "nexus-sli: swapping in" not in log.read_text()
    assert _left_beside(repository) == []


#: export_first in a process of its own, with serve's SIGINT handler (serve makes SIGTERM a KeyboardInterrupt too)
FIRST_EXPORT = """
import signal, sys
from pathlib import Path
signal.signal(signal.SIGINT, signal.default_int_handler)
from nexus_sli.exporter.serving.search import ModelChoice, export_first
export_first(ModelChoice(model=sys.argv[1], name="tiny"), Path(sys.argv[2]))
"""


def _children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _ended(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie not yet reaped by whoever adopted it has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_first_export_stopped_stops_its_export_process_which_cleans_up(tmp_path):
    repository = tmp_path / "repo"
    # the packaged model: its export runs for seconds after its staging folder appears, past the second serve
    # gives a terminal's Ctrl-C to reach it (a tiny model's export may be over by then, its model written)
    model = str(resolve_model(None).path)
    with open(tmp_path / "first.log", "w") as out:
        process = subprocess.Popen([sys.executable, "-c", FIRST_EXPORT, model, str(repository)],
                                   stdout=out, stderr=subprocess.STDOUT)
    export = None
    try:
        wait_until(lambda: _left_beside(repository), "the export's staging folder", timeout=120)
        [export] = _children(process.pid)
        # the interrupt reaches serve alone (SIGTERM from a process manager, `kill -INT`), not its export
        process.send_signal(signal.SIGINT)
        assert process.wait(60) != 0
        wait_until(lambda: _ended(export), "the export process to end", timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
        if export is not None and not _ended(export):
            os.kill(export, signal.SIGKILL)
    log = (tmp_path / "first.log").read_text()
    # the export stopped as a Ctrl-C stops it: its staging folder gone, and the repository folder it created
    assert _left_beside(repository) == [] and not repository.exists(), log
    assert "KeyboardInterrupt" in log and "stopping the first export" in log


def test_an_export_process_that_does_not_end_on_its_interrupt_is_killed_after_the_grace(tmp_path):
    from nexus_sli.exporter.serving.search import _stop_export

    deaf = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                             "print('ready', flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    try:
        assert deaf.stdout.readline() == "ready\n"
        _stop_export(deaf, tmp_path / "repo", grace=0.5)
        assert deaf.returncode == -signal.SIGKILL
    finally:
        if deaf.poll() is None:
            deaf.kill()
        deaf.stdout.close()


def test_an_onnxruntime_fp32_export_with_a_search_picks_among_more_graphs_than_the_first(tiny_checkpoint, tmp_path):
    """Why the search runs for ``--backend onnxruntime --precision fp32``: it times the fused graph too."""
    result = run_export(ExportOptions(model=str(tiny_checkpoint("bert")), name="tiny", out=tmp_path / "repo"))
    assert [row.graph for row in result.report.measured] == ["plain", "fused"]


@pytest.mark.parametrize("first", [True, False])
def test_the_first_export_is_onnxruntime_fp32_without_a_search(first):
    command = ModelChoice(model="m", backend="openvino", precision="bf16").export_command(Path("out"), "tiny", first)
    at = {flag: command[command.index(flag) + 1] for flag in ("--backend", "--precision", "--name")}
    assert at == ({"--backend": "onnxruntime", "--precision": "fp32", "--name": "tiny"} if first else
                  {"--backend": "openvino", "--precision": "bf16", "--name": "tiny"})
    assert ("--no-search" in command) is first
    assert "--allow-pickle" not in command
    asked = ModelChoice(model="m", allow_pickle=True, no_truncate=True, no_cache=True,
                        max_batch_size=128).export_command(Path("out"), "tiny", first)
    # both exports get the options serve was given for them (BGE-M3's heads are pickles, for one)
    assert {"--allow-pickle", "--no-truncate", "--no-cache"} <= set(asked)
    assert asked[asked.index("--max-batch-size") + 1] == "128"


class _Answer:
    """An HTTP answer as tritonclient gives it: its JSON header."""

    def __init__(self, version: str):
        self.version = version

    def get_response(self) -> dict:
        return {"model_name": "tiny", "model_version": self.version}


def test_a_new_version_in_an_answer_drops_the_cached_description():
    from nexus_sli.client.protocol import note_version

    versions, info = {}, {"tiny": "described at version 1"}
    note_version(versions, info, "tiny", _Answer("1"))
    assert info == {"tiny": "described at version 1"}
    note_version(versions, info, "tiny", _Answer("2"))
    assert info == {} and versions == {"tiny": "2"}


#: A command whose run meets an interrupt where Python cannot raise it (a ``__del__``), then would go on
SWALLOWED = """
import argparse, sys, time
from nexus_sli.cli import main as cli

class Swallowed:
    def __del__(self):
        raise KeyboardInterrupt

def run(args):
    Swallowed()
    time.sleep(10)  # an export's work, going on
    print("ran on", flush=True)
    return 0

parser = argparse.ArgumentParser()
parser.set_defaults(run=run)
cli.build_parser = lambda: parser
sys.exit(cli.main([]))
"""


#: A busy machine: the main thread comes back late from starting a thread (here, the one that raises the interrupt
#: again, while the main thread is still in the hook that swallowed it)
SLOW_THREADS = """
import threading, time
start = threading.Thread.start
threading.Thread.start = lambda self: (start(self), time.sleep(0.05))[0]
"""


@pytest.mark.parametrize("machine", ["idle", "busy"])
def test_an_interrupt_python_would_swallow_still_stops_the_command(machine):
    """A SIGINT that lands in a weakref callback or a ``__del__`` (an import's module-lock callback, as the export
    serve stopped once met it) is only printed by Python, and the export ran on to write its model: the command
    line raises it again, once out of the hook (raised in it, Python would swallow it again)."""
    script = (SLOW_THREADS if machine == "busy" else "") + SWALLOWED
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (130, ""), (done.stdout, done.stderr)
    assert "nexus-sli: interrupted" in done.stderr
