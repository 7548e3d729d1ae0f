"""Start the real Triton server on a model repository.

Uses ``tritonserver`` from PATH when there is one (an NGC container, with its
native backends); otherwise the binary shipped in the ``nvidia-pytriton``
wheel, with a backend directory prepared here: the python backend with the
stub for the running Python, and our Python-based ``onnxruntime`` backend.
The installed package is never modified; files are copied into a folder of ours.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from .errors import NexusError

log = logging.getLogger(__name__)


class ServerError(NexusError):
    """The Triton server could not be found, started, or did not become ready."""


@dataclass
class ServerCommand:
    argv: list[str]
    env: dict[str, str]
    backend_dir: Path | None


def _pytriton_root() -> Path:
    try:
        import pytriton
    except ImportError as exc:
        raise ServerError("no tritonserver on PATH and nvidia-pytriton is not installed "
                          "(pip install 'nexus-sli[serve]')") from exc
    return Path(pytriton.__file__).parent / "tritonserver"


def prepare_backends(target: Path) -> Path:
    """python backend + stub for this Python, and the onnxruntime shim, under ``target``."""
    root = _pytriton_root()
    python_dir = target / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        shutil.copy2(root / "backends" / "python" / name, python_dir / name)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise ServerError(f"nvidia-pytriton ships no python backend stub for Python {version}")
    shutil.copy2(stub, python_dir / "triton_python_backend_stub")
    shim = target / "onnxruntime"
    shim.mkdir(exist_ok=True)
    source = resources.files("nexus_sli.exporter.python_models").joinpath("onnxruntime_backend.py")
    (shim / "model.py").write_text(source.read_text())
    return target


def server_command(repository: Path, http_port: int, grpc_port: int, metrics_port: int,
                   host: str = "127.0.0.1", backend_dir: Path | None = None) -> ServerCommand:
    args = [f"--model-repository={repository}", f"--http-port={http_port}", f"--grpc-port={grpc_port}",
            f"--metrics-port={metrics_port}", f"--http-address={host}", f"--grpc-address={host}",
            "--model-control-mode=none", "--exit-on-error=true", "--log-verbose=0"]
    env = dict(os.environ)
    system = shutil.which("tritonserver")
    if system:
        return ServerCommand([system, *args], env, None)
    root = _pytriton_root()
    backend_dir = prepare_backends(backend_dir or Path(tempfile.mkdtemp(prefix="nexus-sli-backends-")))
    libs = root.parent.parent / "nvidia_pytriton.libs"
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(libs), env.get("LD_LIBRARY_PATH")]))
    # The stub embeds the system libpython; give it this environment's packages.
    paths = sysconfig.get_paths()
    site = list(dict.fromkeys([paths["purelib"], paths["platlib"]]))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*site, env.get("PYTHONPATH")]))
    log.info("python backend stub path: %s", env["PYTHONPATH"])
    argv = [str(root / "bin" / "tritonserver"), *args, f"--backend-directory={backend_dir}"]
    return ServerCommand(argv, env, backend_dir)


def wait_ready(http_port: int, process: subprocess.Popen, timeout: float = 180.0, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    url = f"http://{host}:{http_port}/v2/health/ready"
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


def start(repository: Path, http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002,
          host: str = "127.0.0.1", timeout: float = 180.0, **popen) -> subprocess.Popen:
    """Start the server and return once it reports ready."""
    repository = Path(repository).resolve()
    if not any(p.joinpath("config.pbtxt").is_file() for p in repository.glob("*")):
        raise ServerError(f"{repository} holds no model (run 'make export' first)")
    command = server_command(repository, http_port, grpc_port, metrics_port, host)
    process = subprocess.Popen(command.argv, env=command.env, **popen)
    try:
        wait_ready(http_port, process, timeout, host)
    except BaseException:
        stop(process)
        raise
    return process


def stop(process: subprocess.Popen, grace: float = 15.0) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def serve_forever(repository: Path, http_port: int, grpc_port: int, metrics_port: int, host: str) -> int:
    """The ``serve`` command: start, print the URLs, stop cleanly on Ctrl-C / SIGTERM."""
    process = start(repository, http_port, grpc_port, metrics_port, host)
    print(f"Triton is ready: HTTP http://{host}:{http_port}  gRPC {host}:{grpc_port}  "
          f"metrics http://{host}:{metrics_port}/metrics", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        return process.wait()
    except KeyboardInterrupt:
        print("stopping Triton ...", flush=True)
        stop(process)
        return 0
