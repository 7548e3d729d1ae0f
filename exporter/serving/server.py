"""Start the real Triton server on a model repository, and keep its workers alive.

Uses ``tritonserver`` from PATH when there is one (an NGC container, with its
native backends); otherwise the binary shipped in the ``nvidia-pytriton``
wheel, with a backend directory prepared here: the python backend with the
stub for the running Python, and our Python-based ``onnxruntime`` and
``openvino`` backends.
The installed package is never modified; files are copied into a folder of ours.

Every python-backend model instance runs in its own ``triton_python_backend_stub``
process, and this Triton does not restart one that dies: the model then fails
every request.  A :class:`StubSupervisor` thread watches those processes and
reloads a model whose process is gone.  Reloading needs Triton's
model-repository API, so the server runs in explicit model-control mode with
that API (and the shared-memory, trace and logging APIs, which our clients never
use) restricted to requests carrying a header whose value is a random secret
known only to this process, never printed or logged: for users, model control
stays off.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from google.protobuf.text_format import ParseError

from nexus_sli.exporter.errors import NexusError
from nexus_sli.exporter.triton.config import read as read_config

from .gpu_on_cpu import servable

log = logging.getLogger(__name__)

#: Header that the restricted APIs require (HTTP, and gRPC as
#: ``triton-grpc-protocol-<name>``); its value is random per server start.
ADMIN_HEADER = "nexus-sli-admin"
#: Triton APIs that need the header: model control (only the supervisor reloads
#: models), and what the client never uses but could harm a server (shared-memory
#: registration, trace and log settings).
RESTRICTED_APIS = ("model-repository", "shared-memory", "trace", "logging")
STUB_EXECUTABLE = "triton_python_backend_stub"
#: How long a stopping server waits for in-flight requests and open connections (Triton's default: 30 s).
EXIT_TIMEOUT_S = 5


class ServerError(NexusError):
    """The Triton server could not be found, started, or did not become ready."""


@dataclass
class ServerCommand:
    argv: list[str]
    env: dict[str, str]
    backend_dir: Path | None
    #: the backend folder is a temporary one made for this command (removed when the server stops)
    temporary_backend_dir: bool = False


def _pytriton_root() -> Path:
    try:
        import pytriton
    except ImportError as exc:
        raise ServerError("no tritonserver on PATH and nvidia-pytriton is not installed "
                          "(pip install 'nexus-sli[serve]')") from exc
    return Path(pytriton.__file__).parent / "tritonserver"


#: Python-based stand-ins for the native backends the PyPI Triton build lacks.
SHIM_BACKENDS = ("onnxruntime", "openvino")


def prepare_backends(target: Path) -> Path:
    """python backend + stub for this Python, and the encoder backend shims, under ``target``."""
    root = _pytriton_root()
    python_dir = target / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        shutil.copy2(root / "backends" / "python" / name, python_dir / name)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / STUB_EXECUTABLE
    if not stub.is_file():
        raise ServerError(f"nvidia-pytriton ships no python backend stub for Python {version}")
    shutil.copy2(stub, python_dir / STUB_EXECUTABLE)
    package = resources.files("nexus_sli.exporter.serving.backends")
    error_codes = resources.files("nexus_sli.client").joinpath("error_codes.py").read_text()
    for backend in SHIM_BACKENDS:
        shim = target / backend
        shim.mkdir(exist_ok=True)
        (shim / "model.py").write_text(package.joinpath(f"{backend}_backend.py").read_text())
        for helper in ("encoder_backend.py", "batching.py", "openvino_properties.py", "onnxruntime_providers.py"):
            (shim / helper).write_text(package.joinpath(helper).read_text())
        (shim / "error_codes.py").write_text(error_codes)
    return target


def _access(admin_key: str | None, reload_models: bool) -> list[str]:
    """Model control off (or explicit, for reloading), and the APIs our clients never use
    usable only with the secret header (none restricted without an ``admin_key``)."""
    if reload_models and admin_key is None:
        raise ValueError("reloading models needs an admin key: the repository API would be open to anyone")
    mode = ["--model-control-mode=explicit", "--load-model=*"] if reload_models else ["--model-control-mode=none"]
    if admin_key is None:
        return mode
    restricted = f"{','.join(RESTRICTED_APIS)}:{ADMIN_HEADER}={admin_key}"
    return [*mode, f"--http-restricted-api={restricted}", f"--grpc-restricted-protocol={restricted}"]


#: Prefixes of the object stores Triton reads a repository from itself (it copies
#: each model to a local temporary folder when loading it).
REMOTE_PREFIXES = ("s3://", "gs://", "as://")


def is_remote(repository) -> bool:
    """Whether ``repository`` names an object store (``s3://HOST:PORT/bucket/prefix``, ...), not a folder."""
    return str(repository).startswith(REMOTE_PREFIXES)


def server_args(repository, http_port: int, grpc_port: int, metrics_port: int, host: str = "127.0.0.1",
                admin_key: str | None = None, reload_models: bool = False) -> list[str]:
    """tritonserver's flags, the one source for ``nexus-sli serve`` and the Kubernetes
    Deployment (deploy/k8s, where ``admin_key`` is ``$(NEXUS_SLI_ADMIN_KEY)``, a Secret's value)."""
    return [f"--model-repository={repository}", f"--http-port={http_port}", f"--grpc-port={grpc_port}",
            f"--metrics-port={metrics_port}", f"--http-address={host}", f"--grpc-address={host}",
            f"--metrics-address={host}", "--allow-sagemaker=false", "--allow-vertex-ai=false",
            *_access(admin_key, reload_models), "--exit-on-error=true", "--log-verbose=0",
            # A model whose worker was killed never finishes unloading, and an idle
            # HTTP keep-alive connection holds the server open: stopping waits this long.
            f"--exit-timeout-secs={EXIT_TIMEOUT_S}"]


def server_command(repository: Path | str, http_port: int, grpc_port: int, metrics_port: int,
                   host: str = "127.0.0.1", backend_dir: Path | None = None,
                   admin_key: str | None = None, reload_models: bool = False) -> ServerCommand:
    args = server_args(repository, http_port, grpc_port, metrics_port, host, admin_key, reload_models)
    env = dict(os.environ)
    system = shutil.which("tritonserver")
    if system:
        return ServerCommand([system, *args], env, None)
    root = _pytriton_root()
    temporary = backend_dir is None
    backend_dir = prepare_backends(backend_dir or Path(tempfile.mkdtemp(prefix="nexus-sli-backends-")))
    libs = root.parent.parent / "nvidia_pytriton.libs"
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(libs), env.get("LD_LIBRARY_PATH")]))
    # The stub embeds the system libpython in isolated mode: it ignores PYTHONPATH and
    # takes its prefix from the first `python3` on PATH.  Put this interpreter's folder
    # first, so the stub sees this environment's packages (a venv's, through its
    # pyvenv.cfg) whether or not the venv is activated.  PYTHONPATH is for stubs
    # built otherwise.
    env["PATH"] = os.pathsep.join(filter(None, [str(Path(sys.executable).parent), env.get("PATH")]))
    paths = sysconfig.get_paths()
    site = list(dict.fromkeys([paths["purelib"], paths["platlib"]]))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*site, env.get("PYTHONPATH")]))
    log.info("python backend stub: python3 from %s, packages from %s", Path(sys.executable).parent, site[0])
    argv = [str(root / "bin" / "tritonserver"), *args, f"--backend-directory={backend_dir}"]
    return ServerCommand(argv, env, backend_dir, temporary)


def client_host(host: str) -> str:
    """Where a local client reaches a server bound to ``host`` (a wildcard address is not one)."""
    return {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)


def _url(host: str, port: int, path: str) -> str:
    host = client_host(host)
    return f"http://{f'[{host}]' if ':' in host else host}:{port}{path}"


def wait_ready(http_port: int, process: subprocess.Popen, timeout: float = 180.0, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    url = _url(host, http_port, "/v2/health/ready")
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerError(f"tritonserver exited with code {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise ServerError(f"tritonserver was not ready within {timeout:.0f} s")


class TritonServer(subprocess.Popen):
    """The ``tritonserver`` process (a :class:`subprocess.Popen`: ``pid``, ``poll()``,
    ``wait()``), plus the :class:`StubSupervisor` that :func:`start` attaches to it.

    Its ``args`` are redacted: the model-control secret is never shown."""

    supervisor: "StubSupervisor | None" = None

    def __init__(self, command: ServerCommand, admin_key: str | None, **popen):
        super().__init__(command.argv, env=command.env, **popen)
        self.args = [a.replace(admin_key, "<secret>") if admin_key else a for a in command.argv]
        self._temporary_dirs = [command.backend_dir] if command.temporary_backend_dir else []

    def remove_temporary_files(self) -> None:
        """The folders made for this server (backends, a shadow repository), once it has stopped."""
        if self.poll() is not None:
            for folder in self._temporary_dirs:
                shutil.rmtree(folder, ignore_errors=True)
            self._temporary_dirs = []


class StubSupervisor(threading.Thread):
    """Reloads a model whose python-backend process has died.

    Every ``interval`` seconds it counts the server's live stub processes per
    model (the model is the folder of the file a stub runs:
    ``<repository>/<model>/<version>/model.py`` or ``.../model.onnx``); when a
    model has fewer than it had, it unloads and loads that model through the
    restricted repository API, then loads again whatever else was ready
    before (the ensemble that uses it).  Until then the model answers with an
    error ("Stub process ... is not healthy"), which the client reports as
    retryable :class:`~nexus_sli.client.ModelUnavailableError`.
    """

    def __init__(self, server: TritonServer, repository: Path | str, http_port: int, host: str, admin_key: str,
                 interval: float = 0.5):
        super().__init__(name="nexus-sli-stub-supervisor", daemon=True)
        self.server, self.interval = server, interval
        self.repository = repository if is_remote(repository) else Path(repository).resolve()
        self._base = _url(host, http_port, "")
        self._key = admin_key
        self._stopping = threading.Event()
        self.restarts: list[tuple[float, str]] = []  # (time.time(), model), for tests and operators
        self._expected = self.stub_counts()
        self._ready = set(self._ready_models())
        self._ensembles: set[str] | None = None

    def stub_processes(self) -> dict[str, list]:
        """Live stub processes (``psutil.Process``) of this server, per model name."""
        import psutil

        found: dict[str, list] = {}
        try:
            children = psutil.Process(self.server.pid).children()
        except psutil.Error:
            return found
        for child in children:
            try:
                if child.status() == psutil.STATUS_ZOMBIE:
                    continue
                argv = child.cmdline()
            except psutil.Error:
                continue
            if len(argv) < 2 or Path(argv[0]).name != STUB_EXECUTABLE:
                continue
            model = self._model_of(Path(argv[1]).parent.parent)
            if model is not None:
                found.setdefault(model, []).append(child)
        return found

    def _model_of(self, model_dir: Path) -> str | None:
        """The model a stub serves, from the folder it runs in: ``<repository>/<model>`` for a
        folder; for an object store, Triton's local copy (a random ``/tmp/folderXXXXXX``) of the
        model folder, named by the ``name`` in the config.pbtxt copied with it."""
        if not isinstance(self.repository, str):
            return model_dir.name if model_dir.parent == self.repository else None
        try:
            return read_config(model_dir / "config.pbtxt").name or None
        except (OSError, ParseError):  # not a model copy (or gone: unloaded meanwhile)
            return None

    def stub_counts(self) -> dict[str, int]:
        return {model: len(processes) for model, processes in self.stub_processes().items()}

    def _post(self, path: str, body: dict | None = None) -> bytes:
        request = urllib.request.Request(self._base + path, data=json.dumps(body or {}).encode(), method="POST",
                                         headers={ADMIN_HEADER: self._key, "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.read()

    def _ready_models(self) -> list[str]:
        index = json.loads(self._post("/v2/repository/index", {"ready": True}) or b"[]")
        return [entry["name"] for entry in index]

    def _serving(self) -> bool:
        """Ready and not shutting down (Triton closes its endpoints when asked to stop)."""
        if self._stopping.is_set() or self.server.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(self._base + "/v2/health/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def _is_ensemble(self, model: str) -> bool:
        with urllib.request.urlopen(self._base + f"/v2/models/{model}/config", timeout=30) as response:
            return json.loads(response.read()).get("platform") == "ensemble"

    def reload(self, model: str) -> None:
        """Unload and load ``model``, then load whatever else was ready before and is not now.

        From an object store, every model that was ready is loaded again, the ensembles last: a
        load reads the model's config from the store, where a publish may have pinned newer step
        versions since this server started; reloading one step alone would leave the ensemble
        pinning a version that step no longer serves.  The replica then serves the store's
        current set (docs/deployment.md)."""
        log.warning("the python backend process of model %s exited; reloading the model", model)
        remote = isinstance(self.repository, str)
        if remote and self._ensembles is None:  # asked once, while every model is still loaded
            self._ensembles = {m for m in self._ready if self._is_ensemble(m)}
        ensembles = self._ensembles or set()
        self._post(f"/v2/repository/models/{model}/unload")
        self._post(f"/v2/repository/models/{model}/load")
        others = self._ready if remote else self._ready - set(self._ready_models())
        for other in sorted(others - {model}, key=lambda m: (m in ensembles, m)):
            self._post(f"/v2/repository/models/{other}/load")
        if remote:  # the store's versions may differ from the ones loaded at start
            self._expected = self.stub_counts()
        self.restarts.append((time.time(), model))
        log.warning("model %s reloaded", model)

    def run(self) -> None:
        failures = 0
        while not self._stopping.wait(min(self.interval * 2 ** failures, 30.0)):
            if self.server.poll() is not None:
                return
            counts = self.stub_counts()
            lost = [m for m, n in self._expected.items() if counts.get(m, 0) < n]
            if not lost or not self._serving():
                continue
            try:
                for model in lost:
                    self.reload(model)
                failures = 0
            except (OSError, ValueError) as exc:  # tried again, later and later
                failures += 1
                log.error("could not reload model %s (%s); trying again", model, exc)

    def stop(self) -> None:
        self._stopping.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join(timeout=30)


def _check_identity(host: str, http_port: int, admin_key: str) -> None:
    """The server that answered is ours (it knows our secret), not another one on the same port."""
    request = urllib.request.Request(_url(host, http_port, "/v2/logging"), headers={ADMIN_HEADER: admin_key})
    try:
        urllib.request.urlopen(request, timeout=10).close()
    except urllib.error.HTTPError as exc:
        if exc.code == 403:
            raise ServerError(f"another server answers on port {http_port} (is one running there already?); "
                              "this tritonserver could not take the port") from None
        raise


def start(repository: Path | str, http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002,
          host: str = "127.0.0.1", timeout: float = 180.0, supervise: bool = True, gpu_on_cpu: bool = False,
          **popen) -> TritonServer:
    """Start the server and return once it reports ready; with ``supervise`` (the
    default) a model whose python-backend process dies is reloaded.  ``gpu_on_cpu``:
    serve GPU models on the CPU where there is no GPU (:mod:`gpu_on_cpu`).

    ``repository`` may be an object store (``s3://HOST:PORT/bucket/prefix``, credentials
    from the standard AWS environment): Triton reads it itself, so the local checks and
    the GPU-on-CPU shadow (a local rewrite of configs) do not apply there."""
    shadow = None
    if is_remote(repository):
        if gpu_on_cpu:
            raise ServerError("--gpu-models-on-cpu rewrites configs in a local shadow folder and cannot apply to "
                              f"{repository}; publish a CPU export there, or serve a local copy")
    else:
        repository = Path(repository).resolve()
        if not any(p.joinpath("config.pbtxt").is_file() for p in repository.glob("*")):
            raise ServerError(f"{repository} holds no model (run 'make export' first)")
        shadow = servable(repository, gpu_on_cpu)
        repository = shadow or repository
    admin_key = secrets.token_urlsafe(32)
    command = server_command(repository, http_port, grpc_port, metrics_port, host, admin_key=admin_key,
                             reload_models=supervise)
    process = TritonServer(command, admin_key, **popen)
    process._temporary_dirs += [shadow] if shadow else []
    try:
        wait_ready(http_port, process, timeout, host)
        _check_identity(host, http_port, admin_key)
        if supervise:
            process.supervisor = StubSupervisor(process, repository, http_port, host, admin_key)
            process.supervisor.start()
    except BaseException:
        stop(process)
        raise
    return process


def stop(process: subprocess.Popen, grace: float = 15.0) -> None:
    supervisor = getattr(process, "supervisor", None)
    if supervisor is not None:
        supervisor.stop()
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    if isinstance(process, TritonServer):
        process.remove_temporary_files()


def _wait_any(processes: list[subprocess.Popen]) -> int:
    """The exit code of the first of ``processes`` to end."""
    if len(processes) == 1:
        return processes[0].wait()
    while True:
        for process in processes:
            if process.poll() is not None:
                return process.returncode
        time.sleep(0.2)


def _stop_beside(process: subprocess.Popen, grace: float = 10.0) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def serve_forever(repository: Path, http_port: int, grpc_port: int, metrics_port: int, host: str,
                  gpu_on_cpu: bool = False, beside: list[str] | None = None) -> int:
    """The ``serve`` command: start, print the URLs, stop cleanly on Ctrl-C / SIGTERM (exit code 0).

    ``beside``: the command of a process started once Triton is ready (the HTTP
    gateway); whichever of the two ends first, the other is stopped too, and the
    exit code is the one that ended first's: its own, or 128 + the signal that
    killed it (the shell's convention; a negative code would become 256 - n)."""
    process = start(repository, http_port, grpc_port, metrics_port, host, gpu_on_cpu=gpu_on_cpu)
    print(f"Triton is ready: HTTP http://{host}:{http_port}  gRPC {host}:{grpc_port}  "
          f"metrics http://{host}:{metrics_port}/metrics", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    companion = None
    try:
        companion = subprocess.Popen(beside) if beside else None
        code = _wait_any([process, *([companion] if companion else [])])
        code = 128 - code if code < 0 else code  # Popen's -N (killed by signal N) as the shell says it
        if companion is not None and companion.poll() is not None:
            print(f"the process beside Triton exited (code {code}); stopping Triton ...", flush=True)
    except KeyboardInterrupt:
        print("stopping Triton ...", flush=True)
        code = 0
    finally:
        if companion is not None:
            _stop_beside(companion)
        stop(process)  # also when the server ended by itself: the supervisor and temporary files go too
    return code
