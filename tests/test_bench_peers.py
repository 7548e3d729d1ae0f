"""The bench's peers (bench/peers.py, bench/peer_worker.py): what runs without their venvs.

``make test`` never creates the peers' venvs (minutes, and downloads): the wire format,
the worker's error path and the skip path run here; the one test that needs fastembed's
venv runs only where the bench already made it, and says so when it skips.
"""

from __future__ import annotations

import io
import shutil
import sys

import numpy as np
import pytest

from helpers.waiting import wait_until
from nexus_sli.bench.peer_worker import read_message, write_message
from nexus_sli.bench.peers import FASTEMBED, FastembedWorker, PeerError, Peers, PeerSpec, PeerVenv, onnx_model_dir


def test_wire_format_round_trips_a_header_and_an_array():
    stream = io.BytesIO()
    vectors = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    write_message(stream, {"seconds": 0.25, "latencies_ms": [1.5, 2.5]}, vectors)
    write_message(stream, {"op": "quit"})
    stream.seek(0)
    header, array = read_message(stream)
    assert header == {"seconds": 0.25, "latencies_ms": [1.5, 2.5], "shape": [3, 5]}
    assert array.dtype == np.float32 and np.array_equal(array, vectors)
    assert read_message(stream) == ({"op": "quit"}, None)
    with pytest.raises(EOFError):
        read_message(stream)


def test_a_frame_cut_short_is_an_eof_not_a_wrong_array():
    stream = io.BytesIO()
    write_message(stream, {"seconds": 1.0}, np.ones((4, 8), dtype=np.float32))
    cut = io.BytesIO(stream.getvalue()[:-7])
    with pytest.raises(EOFError, match="bytes into a 128-byte frame"):
        read_message(cut)


def _worker(tmp_path, python=sys.executable) -> FastembedWorker:
    return FastembedWorker(python, tmp_path / "worker.log", tmp_path, "sentence-transformers/all-MiniLM-L6-v2",
                           "mean", True, 384)


def test_a_worker_that_cannot_load_fastembed_says_why(tmp_path):
    # the product's own python has no fastembed: the real worker process reports the import error over the pipe
    try:
        import fastembed  # noqa: F401
        pytest.skip("fastembed is installed in the product's environment: this test needs a python without it")
    except ImportError:
        pass
    with pytest.raises(PeerError, match="fastembed could not load the model: ModuleNotFoundError.*fastembed"):
        _worker(tmp_path).__enter__()


def test_a_worker_that_dies_before_it_is_ready_or_cannot_start_is_a_peer_error(tmp_path):
    with pytest.raises(PeerError, match="exited before it was ready"):
        _worker(tmp_path, python=shutil.which("false")).__enter__()
    with pytest.raises(PeerError, match="could not start.*no-python"):
        _worker(tmp_path, python=tmp_path / "no-python").__enter__()


def _facts():
    from types import SimpleNamespace

    return SimpleNamespace(name="tiny", max_length=128, pooling="mean", normalize=True)


def test_a_peer_that_cannot_be_installed_is_skipped_with_pips_reason(tmp_path):
    spec = PeerSpec("no-such-peer", "no-such-peer", ("nexus-sli-no-such-peer-package==0.0.1",), (), "server", "torch")
    skipped: list[dict] = []
    with Peers("some/model", tmp_path, _facts(), skipped, root=tmp_path / "peers", specs=(spec,)) as peers:
        assert peers.running == [] and peers.measurements({}, 1.0) == []
    assert len(skipped) == 1 and skipped[0]["path"] == "no-such-peer" and skipped[0]["mode"] == "all"
    reason = skipped[0]["reason"]
    assert reason.startswith("pip install nexus-sli-no-such-peer-package==0.0.1 failed (exit code 1):")
    assert "No matching distribution found for nexus-sli-no-such-peer-package==0.0.1" in reason
    assert peers.info["no-such-peer"]["skipped"] == reason
    assert not (tmp_path / "peers" / "no-such-peer" / "installed.json").exists()  # not reused as installed


def test_a_venv_that_cannot_be_created_is_skipped_and_the_bench_goes_on(tmp_path):
    spec = PeerSpec("no-venv", "no-venv", ("anything",), (), "in-process")
    skipped: list[dict] = []
    with Peers("some/model", tmp_path, _facts(), skipped, root=tmp_path / "peers", specs=(spec,),
               python=str(tmp_path / "no-python3")) as peers:
        assert peers.running == []
    assert skipped[0]["reason"].startswith("creating the venv: ") and "no-python3" in skipped[0]["reason"]


def test_an_installed_venv_is_reused_only_while_it_holds_what_the_spec_asks(tmp_path):
    venv = PeerVenv(FASTEMBED, tmp_path)
    venv.python.parent.mkdir(parents=True)
    venv.python.write_text("")
    venv.marker.write_text('{"requirements": ["fastembed==0.9.1"], "versions": {"fastembed": "0.9.1"}}')
    assert venv.installed() is not None and venv.ensure() == {"fastembed": "0.9.1"}
    venv.marker.write_text('{"requirements": ["fastembed==0.8.0"], "versions": {"fastembed": "0.8.0"}}')
    assert venv.installed() is None


@pytest.fixture(scope="module")
def fastembed_venv() -> PeerVenv:
    venv = PeerVenv(FASTEMBED)
    if venv.installed() is None:
        pytest.skip("fastembed's venv (bench/.peers/fastembed) is not installed: the full bench makes it "
                    "(make bench, or python -m nexus_sli.bench.peers_only); make test never does")
    return venv


def test_fastembed_in_its_venv_gives_sentence_transformers_vectors(fastembed_venv, tmp_path):
    from nexus_sli.bench.runners import SentenceTransformersEncoder
    from nexus_sli.bench.measure import cosines
    from nexus_sli.exporter.export.source import resolve_model

    source = resolve_model(None)
    model = onnx_model_dir(source.path, "all_minilm_l6_v2", 256)
    texts = ["a short query", "Triton serves the encoder behind one ensemble.", "word " * 300]
    with FastembedWorker(fastembed_venv.python, tmp_path / "worker.log", model, source.model_id, "mean", True,
                         384) as worker:
        assert worker.settings["listed_by_fastembed"] is True
        batch = worker.batches(texts)
        single = worker.sequential(texts[:2], budget_s=None)
    reference = SentenceTransformersEncoder(SentenceTransformersEncoder.load(source.path))(texts)
    assert batch.embeddings.shape == (3, 384) and batch.seconds > 0 and batch.latencies_ms == []
    assert len(single.latencies_ms) == 2 and single.embeddings.shape == (2, 384)
    assert cosines(batch.embeddings, reference).min() > 0.9999   # the 300-word text: both truncate at 256 tokens
    assert cosines(single.embeddings, reference[:2]).min() > 0.9999


def test_a_peer_server_does_not_outlive_a_killed_bench(tmp_path):
    # a stand-in bench process starts a long-lived child the way InfinityServer does, then is SIGKILLed
    import signal
    import subprocess

    pid_file = tmp_path / "child.pid"
    bench = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "from nexus_sli.exporter.serving.parent_death import dies_with_parent\n"
        f"child = subprocess.Popen(['sleep', '120'], start_new_session=True, preexec_fn=dies_with_parent())\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(120)\n")])
    wait_until(lambda: pid_file.is_file() and pid_file.read_text(), "the stand-in to start its child")
    child = int(pid_file.read_text())
    bench.send_signal(signal.SIGKILL)
    bench.wait()
    wait_until(lambda: not _alive(child), "the child to die with the killed bench", timeout=10)


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for init to reap it counts as gone)."""
    from pathlib import Path

    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
