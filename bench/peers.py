"""The embedding libraries and servers users pick instead, measured in the same bench run.

fastembed (in-process, ONNX Runtime) and the infinity-emb server (its torch engine, and
its optimum engine on ONNX Runtime) each get a venv of their own,
``bench/.peers/<peer>/venv``, made with the system ``python3 -m venv`` and filled by that
venv's pip from the package registry, so their pins (transformers<4.58, numpy<2, ...)
never touch the product's environment.  A venv is reused while its marker file says it
holds what the peer asks for.

They run the packaged checkpoint, never a hub download: infinity's torch engine loads the
checkpoint folder itself; fastembed and infinity's optimum engine load a plain fp32 ONNX
export of it (what their users download from the hub), made here once with
``torch.onnx`` and cached under ``bench/.peers/models``.

fastembed runs in its venv's python (``peer_worker.py``), which times each call itself:
the bench gets seconds, latencies and embeddings back, and the pipe is never on the
clock.  infinity-emb runs as its own server on a free loopback port; the bench is its
client through the official ``openai`` SDK (infinity speaks OpenAI's ``/embeddings``), as
the gateway rows are measured.  Every peer runs with its library's defaults (threads,
batching), which the results record.  A peer that cannot be installed or started becomes
a skip entry with the reason, and the bench goes on without it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import warnings
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from nexus_sli.exporter.errors import NexusError
from nexus_sli.exporter.serving.parent_death import dies_with_parent

from .measure import BATCH32, CONCURRENT16, LATENCY1, Measurement, Sample
from .peer_worker import read_message, write_message
from .served import GatewayEmbedder, free_ports

log = logging.getLogger("nexus_sli.bench.peers")

#: where the venvs, the peers' model folder and their caches live (git-ignored)
PEERS_DIR = Path(__file__).resolve().parent / ".peers"
WORKER = Path(__file__).resolve().with_name("peer_worker.py")
#: The CPU build the Makefile installs for the product; left unpinned, pip takes a multi-GB CUDA build.
TORCH = "torch==2.13.0"
START_TIMEOUT_S = 300
#: fastembed's ``embed()`` batch size in the batch rows: the bench's client batches of 32
BATCH_SIZE = 32


class PeerError(NexusError):
    """A peer could not be installed, started or asked: the bench records why and goes on."""


@dataclass(frozen=True)
class PeerSpec:
    """One peer: its row name, its venv folder, what its venv installs, how it runs."""

    path: str                       # the rows' ``path``
    folder: str                     # bench/.peers/<folder>
    requirements: tuple[str, ...]   # pip's arguments
    versions_of: tuple[str, ...]    # distributions whose versions the results record
    peer: str                       # "in-process" or "server" (Measurement.peer)
    engine: str | None = None       # infinity-emb's --engine


FASTEMBED = PeerSpec("fastembed", "fastembed", ("fastembed==0.9.1",),
                     ("fastembed", "onnxruntime", "tokenizers", "numpy"), "in-process")
INFINITY_TORCH = PeerSpec("infinity-emb torch", "infinity-torch", ("infinity-emb[server,torch]==0.0.78", TORCH),
                          ("infinity-emb", "torch", "sentence-transformers", "transformers"), "server", "torch")
INFINITY_OPTIMUM = PeerSpec("infinity-emb optimum", "infinity-optimum", ("infinity-emb[server,optimum]==0.0.78", TORCH),
                            ("infinity-emb", "optimum", "optimum-onnx", "onnxruntime", "transformers", "torch"),
                            "server", "optimum")
PEERS = (FASTEMBED, INFINITY_TORCH, INFINITY_OPTIMUM)


# --- venvs -------------------------------------------------------------------------------------

class PeerVenv:
    """``<root>/<folder>/venv``: made and installed once, reused while ``installed.json`` matches."""

    def __init__(self, spec: PeerSpec, root: Path = PEERS_DIR, python: str = "python3"):
        self.spec, self.system_python = spec, python
        self.folder = Path(root) / spec.folder
        self.venv = self.folder / "venv"
        self.marker = self.folder / "installed.json"
        self.install_log = self.folder / "install.log"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def bin(self, name: str) -> Path:
        return self.venv / "bin" / name

    def installed(self) -> dict | None:
        """The marker, when the venv holds what the spec asks for now."""
        if not (self.marker.is_file() and self.python.exists()):
            return None
        found = json.loads(self.marker.read_text())
        return found if found.get("requirements") == list(self.spec.requirements) else None

    def ensure(self) -> dict[str, str]:
        """The venv, made and installed unless it already is; the recorded versions.  Two bench
        runs at once (a shared machine) take turns: the second reuses what the first installed."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with _locked(self.folder / ".lock"):
            return self._ensure()

    def _ensure(self) -> dict[str, str]:
        found = self.installed()
        if found is not None:
            log.info("peer %s: reusing %s", self.spec.path, self.venv)
            return found["versions"]
        started = time.perf_counter()
        log.info("peer %s: creating %s and installing %s (a minute or more the first time; log: %s)",
                 self.spec.path, self.venv, " ".join(self.spec.requirements), self.install_log)
        self.marker.unlink(missing_ok=True)
        self.install_log.write_text("")
        self._run([self.system_python, "-m", "venv", "--clear", str(self.venv)], "creating the venv")
        self._run([str(self.python), "-m", "pip", "install", "--disable-pip-version-check", *self.spec.requirements],
                  "pip install " + " ".join(self.spec.requirements))
        versions = self.versions()
        self.marker.write_text(json.dumps({
            "requirements": list(self.spec.requirements), "versions": versions,
            "installed": datetime.now(timezone.utc).isoformat(timespec="seconds")}, indent=2) + "\n")
        log.info("peer %s: installed in %.0f s: %s", self.spec.path, time.perf_counter() - started, versions)
        return versions

    def _run(self, command: list[str], what: str) -> None:
        """Run an install step; its output goes to the install log, pip's progress lines to the bench log."""
        with open(self.install_log, "a") as out:
            out.write(f"$ {shlex.join(command)}\n")
            out.flush()
            lines: list[str] = []
            try:
                process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            except OSError as exc:
                raise PeerError(f"{what}: {exc}") from exc
            for line in process.stdout:
                out.write(line)
                lines.append(line.rstrip())
                if line.startswith(("Collecting ", "Installing collected", "Successfully installed")):
                    log.info("peer %s: %s", self.spec.path, line.strip()[:160])
            code = process.wait()
        if code:
            raise PeerError(f"{what} failed (exit code {code}): {_reason(lines)} (log: {self.install_log})")

    def versions(self) -> dict[str, str]:
        """The installed versions of the spec's distributions, read by the venv's own python."""
        code = ("import json, importlib.metadata as m\nfound = {}\n"
                f"for name in {list(self.spec.versions_of)!r}:\n"
                "    try: found[name] = m.version(name)\n"
                "    except m.PackageNotFoundError: pass\nprint(json.dumps(found))")
        done = subprocess.run([str(self.python), "-c", code], capture_output=True, text=True, timeout=120)
        if done.returncode:
            raise PeerError(f"reading the installed versions failed: {_reason(done.stderr.splitlines())}")
        return json.loads(done.stdout)


def _reason(lines: list[str]) -> str:
    """pip's ERROR lines (what it could not find or build), else the last line it printed."""
    errors = [line.strip() for line in lines if line.startswith("ERROR")]
    if errors:
        return " ".join(errors)[:600]
    rest = [line.strip() for line in lines if line.strip()]
    return rest[-1][:600] if rest else "no output"


# --- the model the peers load ------------------------------------------------------------------

MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
               "sentencepiece.bpe.model", "spiece.model", "merges.txt", "vocab.json", "modules.json",
               "sentence_bert_config.json", "config_sentence_transformers.json")


def _identity(model_dir: Path, max_length: int) -> dict:
    import torch

    weights = sorted(p for p in Path(model_dir).iterdir() if p.suffix in (".safetensors", ".bin"))
    return {"checkpoint": str(model_dir), "weights": {p.name: p.stat().st_size for p in weights},
            "max_length": max_length, "torch": torch.__version__}


def onnx_model_dir(model_dir: Path, name: str, max_length: int, root: Path = PEERS_DIR) -> Path:
    """``<root>/models/<name>``: the checkpoint as a plain fp32 ONNX graph (``model.onnx``, the
    token inputs in, ``last_hidden_state`` out, dynamic batch and length) with its tokenizer files
    beside it: the folder a user of fastembed or infinity's optimum engine downloads from the hub.
    Made once; made again when the checkpoint, the truncation or torch changed."""
    target = Path(root) / "models" / name
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{name}.lock"):
        return _onnx_model_dir(model_dir, target, max_length)


def _onnx_model_dir(model_dir: Path, target: Path, max_length: int) -> Path:
    marker, identity = target / "exported.json", _identity(model_dir, max_length)
    if marker.is_file() and json.loads(marker.read_text()) == identity:
        return target
    log.info("peers: exporting %s to a plain ONNX graph for fastembed and infinity's optimum engine", model_dir)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.staging-", dir=target.parent))
    try:
        _export_plain_onnx(model_dir, staging / "model.onnx")
        for file in MODEL_FILES:
            if (Path(model_dir) / file).is_file():
                shutil.copy2(Path(model_dir) / file, staging / file)
        _set_truncation(staging / "tokenizer_config.json", max_length)
        (staging / "exported.json").write_text(json.dumps(identity, indent=2) + "\n")
        staging.chmod(0o755)  # mkdtemp makes it private
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on ``path`` (created if missing) for the block: flock, released when the process dies."""
    import fcntl

    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _export_plain_onnx(model_dir: Path, path: Path) -> None:
    try:
        _torch_onnx_export(model_dir, path)
    except Exception as exc:  # transformers and torch raise many types; all mean "this checkpoint did not export"
        raise PeerError(f"the plain ONNX export for the peers failed: {type(exc).__name__}: {exc}") from exc


def _torch_onnx_export(model_dir: Path, path: Path) -> None:
    import torch
    from transformers import AutoModel

    from nexus_sli.exporter.export.onnx_export import model_input_names

    # eager attention: the classic MatMul/Softmax graph, which ORT's transformer optimizer recognises
    # (the sdpa export it does not fuse)
    model = AutoModel.from_pretrained(str(model_dir), attn_implementation="eager").eval()
    names = model_input_names(model, model.config)

    class LastHiddenState(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *inputs):  # keyword call: transformers 5 misbinds positional inputs
            return self.model(**dict(zip(names, inputs)), return_dict=True).last_hidden_state

    ids = torch.randint(5, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    example = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
    axes = {n: {0: "batch", 1: "sequence"} for n in [*names, "last_hidden_state"]}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer warnings about python control flow on shapes
        torch.onnx.export(LastHiddenState().eval(), tuple(example[n] for n in names), str(path),
                          input_names=names, output_names=["last_hidden_state"], dynamic_axes=axes,
                          opset_version=17, do_constant_folding=True, dynamo=False)


def _set_truncation(tokenizer_config: Path, max_length: int) -> None:
    """fastembed truncates at ``model_max_length``, which a checkpoint's file may set above the length
    the model was trained for and sentence-transformers truncates at (all-MiniLM-L6-v2: 512 in the
    file, 256 trained, and 256 in fastembed's own model list): the peers' copy says ``max_length``."""
    config = json.loads(tokenizer_config.read_text()) if tokenizer_config.is_file() else {}
    config["model_max_length"] = max_length
    tokenizer_config.write_text(json.dumps(config, indent=2) + "\n")


# --- fastembed: a worker process in its venv ---------------------------------------------------

class FastembedWorker:
    """``peer_worker.py`` in fastembed's venv, loaded and ready; each call's time is its own."""

    def __init__(self, python: Path, log: Path, model_dir: Path, model_id: str, pooling: str, normalize: bool,
                 dim: int):
        self.command = [str(python), str(WORKER), "--model-dir", str(model_dir), "--model-id", model_id,
                        "--pooling", pooling, "--dim", str(dim), *(["--normalize"] if normalize else [])]
        self.log = Path(log)
        self.process: subprocess.Popen | None = None
        self.settings: dict = {}

    def __enter__(self) -> "FastembedWorker":
        with open(self.log, "w") as err:
            try:
                self.process = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                stderr=err, start_new_session=True, preexec_fn=dies_with_parent())
            except OSError as exc:
                raise PeerError(f"the fastembed worker could not start: {exc}") from exc
        try:
            header, _ = read_message(self.process.stdout)
        except EOFError:
            self.close()
            raise PeerError(f"the fastembed worker exited before it was ready: {_tail(self.log)}") from None
        if "error" in header:
            self.close()
            raise PeerError(f"fastembed could not load the model: {header['error']}")
        self.settings = {k: v for k, v in header.items() if k != "ready"}
        return self

    def _ask(self, request: dict) -> Sample:
        try:
            write_message(self.process.stdin, request)
            header, vectors = read_message(self.process.stdout)
        except (EOFError, BrokenPipeError) as exc:
            raise PeerError(f"the fastembed worker died ({type(exc).__name__}): {_tail(self.log)}") from exc
        if "error" in header:
            raise PeerError(f"fastembed failed: {header['error']}")
        return Sample(header["seconds"], header["latencies_ms"], vectors)

    def batches(self, texts: list[str]) -> Sample:
        return self._ask({"op": "batches", "texts": list(texts), "batch_size": BATCH_SIZE})

    def sequential(self, texts: list[str], budget_s: float | None = None) -> Sample:
        return self._ask({"op": "sequential", "texts": list(texts), "budget_s": budget_s})

    def close(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(OSError, ValueError):
            write_message(self.process.stdin, {"op": "quit"})
            self.process.stdin.close()
        _stop(self.process)

    def __exit__(self, *exc) -> None:
        self.close()


# --- infinity-emb: a server in its venv --------------------------------------------------------

class InfinityServer:
    """``infinity_emb v2`` on a free loopback port, started from its venv and ready
    (``/health`` answers), stopped on exit: also on an error or Ctrl-C."""

    def __init__(self, venv: PeerVenv, spec: PeerSpec, model_dir: Path, name: str, pooling: str, root: Path):
        self.port = free_ports(1)[0]
        self.url, self.name = f"http://127.0.0.1:{self.port}", name
        self.cwd: Path | None = None
        model_id = str(model_dir)
        if spec.engine == "optimum":
            # That engine names the ONNX file by the path it globbed in the model folder and hands it to
            # optimum as a name inside that folder: right for a hub id, wrong for a folder given by its
            # path.  Started in the folder with --model-id ".", the path found is the name inside it.
            self.cwd, model_id = Path(model_dir), "."
        self.command = [str(venv.bin("infinity_emb")), "v2", "--model-id", model_id, "--served-model-name",
                        name, "--engine", spec.engine, "--device", "cpu", "--host", "127.0.0.1",
                        "--port", str(self.port)]
        if spec.engine == "optimum":
            # that engine reads no pooling config: "auto" means CLS there, so its users name the pooling
            self.command += ["--pooling-method", pooling]
        # COLUMNS: its log lines unwrapped, so the warnings it starts with can be read back
        self.env = {**os.environ, "DO_NOT_TRACK": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0",
                    "HF_HUB_OFFLINE": "1", "HF_HOME": str(Path(root) / "cache" / spec.folder), "COLUMNS": "1000"}
        self.log = venv.folder / "server.log"
        self.process: subprocess.Popen | None = None
        self.settings = {"command": shlex.join(self.command), "cwd": str(self.cwd or Path.cwd()),
                         "defaults": "infinity's own: --batch-size 32, its dynamic batching queue, its engine's "
                                     "threads; telemetry off (DO_NOT_TRACK=1)"}

    def __enter__(self) -> "InfinityServer":
        with open(self.log, "w") as out:
            try:
                self.process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                                cwd=self.cwd, start_new_session=True, preexec_fn=dies_with_parent())
            except OSError as exc:
                raise PeerError(f"infinity_emb could not start: {exc}") from exc
        try:
            self._wait_healthy()
        except BaseException:
            self.close()
            raise
        # e.g. its ONNX graph optimization failing and falling back to the plain graph: said where users read
        warnings_seen = [" ".join(line.split()) for line in self.log.read_text(errors="replace").splitlines()
                         if "WARNING" in line and "infinity_emb" in line]
        self.settings["startup_warnings"] = warnings_seen[:5]
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise PeerError(f"infinity_emb exited with code {self.process.returncode} while starting: "
                                f"{_tail(self.log)}")
            with contextlib.suppress(urllib.error.URLError, OSError):
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            time.sleep(0.5)
        raise PeerError(f"infinity_emb did not answer /health within {START_TIMEOUT_S} s: {_tail(self.log)}")

    def close(self) -> None:
        if self.process is not None:
            _stop(self.process)

    def __exit__(self, *exc) -> None:
        self.close()


def _stop(process: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM to the process's group (it was started in a session of its own), SIGKILL after ``grace_s``."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _tail(path: Path, lines: int = 6) -> str:
    text = path.read_text(errors="replace").strip().splitlines() if path.is_file() else []
    return " | ".join(line.strip() for line in text[-lines:]) or f"no output (log: {path})"


# --- all peers, as the harness uses them -------------------------------------------------------

class Peers:
    """``with Peers(...) as peers:`` every peer installed and started, or skipped with the reason
    (appended to ``skipped``, the bench's list); all stopped on exit.  ``info``: per peer its
    requirements, the versions installed and the settings it ran with (``results["peers"]``)."""

    def __init__(self, model_id: str, model_dir: Path, facts, skipped: list[dict], root: Path = PEERS_DIR,
                 specs: tuple[PeerSpec, ...] = PEERS, python: str = "python3"):
        self.model_id, self.model_dir, self.facts = model_id, Path(model_dir), facts
        self.skipped, self.root, self.specs, self.system_python = skipped, Path(root), specs, python
        self.running: list[tuple[PeerSpec, object]] = []
        self.info: dict[str, dict] = {}
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "Peers":
        try:
            for spec in self.specs:
                self._start(spec)
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _start(self, spec: PeerSpec) -> None:
        venv = PeerVenv(spec, self.root, self.system_python)
        record = {"kind": spec.peer, "requirements": list(spec.requirements), "venv": str(venv.venv)}
        self.info[spec.path] = record
        try:
            record["versions"] = venv.ensure()
            running = self._stack.enter_context(self._process(spec, venv))
        except (PeerError, OSError, subprocess.SubprocessError) as exc:
            reason = str(exc) if isinstance(exc, PeerError) else f"{type(exc).__name__}: {exc}"
            log.warning("peer %s is left out of the bench: %s", spec.path, reason)
            self.skipped.append({"path": spec.path, "mode": "all", "reason": reason})
            record["skipped"] = reason
            return
        record["settings"] = running.settings
        self.running.append((spec, running))
        log.info("peer %s is ready", spec.path)

    @functools.cached_property
    def onnx_dir(self) -> Path:
        return onnx_model_dir(self.model_dir, self.facts.name, self.facts.max_length, self.root)

    def _process(self, spec: PeerSpec, venv: PeerVenv):
        if spec.engine is None:
            return FastembedWorker(venv.python, venv.folder / "worker.log", self.onnx_dir, self.model_id,
                                   self.facts.pooling, self.facts.normalize, _hidden_size(self.model_dir))
        model = self.model_dir if spec.engine == "torch" else self.onnx_dir
        return InfinityServer(venv, spec, model, self.facts.name, self.facts.pooling, self.root)

    def measurements(self, groups: dict, budget_s: float) -> list[Measurement]:
        """The rows of every running peer: ``groups`` is the harness's texts per group of rows."""
        found = []
        for spec, running in self.running:
            common = dict(path=spec.path, precision="fp32", peer=spec.peer)
            if isinstance(running, FastembedWorker):
                common["protocol"] = "in-process"
                single = functools.partial(running.sequential, budget_s=budget_s)
                found += [Measurement(mode=BATCH32, run=running.batches, **groups["set"], **common),
                          Measurement(mode=LATENCY1, run=single, **groups["latency"], **common)]
                self.skipped.append({"path": spec.path, "mode": CONCURRENT16,
                                     "reason": "an in-process library: its users call it from their own process, "
                                               "there is no server for concurrent clients"})
                continue
            embedder = InfinityEmbedder(running.url, "http", running.name)
            self._stack.callback(embedder.close)
            common["protocol"] = "http"
            single = functools.partial(embedder.sequential, budget_s=budget_s)
            found += [Measurement(mode=BATCH32, run=embedder.batches, **groups["set"], **common),
                      Measurement(mode=CONCURRENT16, run=embedder.concurrent, **groups["set"], **common),
                      Measurement(mode=LATENCY1, run=single, **groups["latency"], **common)]
        return found


def _hidden_size(model_dir: Path) -> int:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(config.get("hidden_size") or config.get("dim") or config["d_model"])


class InfinityEmbedder(GatewayEmbedder):
    """A client of one infinity server in ``bench/served.py``'s three workloads: its OpenAI-style
    ``/embeddings`` (at the server's root, no ``/v1``) through the official ``openai`` SDK, one
    keep-alive connection per client, as the gateway rows are measured."""

    def connect(self):
        import openai

        client = openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0)
        client.models.list()  # connected, outside any timing
        return client


class NoPeers(contextlib.nullcontext):
    """What a run without peers enters instead of :class:`Peers`: no rows."""

    def __enter__(self) -> "NoPeers":
        return self

    def measurements(self, groups: dict, budget_s: float) -> list[Measurement]:
        return []
