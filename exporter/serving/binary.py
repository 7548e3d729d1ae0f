"""Which ``tritonserver`` runs, and the environment the wheel's one needs.

``tritonserver`` from PATH when there is one (an NGC container, with its native
backends); otherwise the binary shipped in the ``nvidia-pytriton`` wheel, which
needs its bundled libraries and a Python its python-backend stub can embed.
The installed package is never modified.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import sys
import sysconfig
from pathlib import Path

from nexus_sli.exporter.errors import NexusError

log = logging.getLogger(__name__)


class ServerError(NexusError):
    """The Triton server could not be found, started, or did not become ready."""


def system_binary() -> str | None:
    """``tritonserver`` on PATH, or None."""
    return shutil.which("tritonserver")


def pytriton_root() -> Path:
    """The folder of the Triton build inside the ``nvidia-pytriton`` wheel.  Found without importing
    ``pytriton``: its Python API (and that API's own dependencies) is not what runs the binary."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ServerError("no tritonserver on PATH and nvidia-pytriton is not installed "
                          "(pip install 'nexus-sli[serve]')")
    return Path(spec.submodule_search_locations[0]) / "tritonserver"


def wheel_binary() -> Path:
    return pytriton_root() / "bin" / "tritonserver"


def _prepend(env: dict[str, str], name: str, *paths: str) -> None:
    env[name] = os.pathsep.join(filter(None, [*paths, env.get(name)]))


def wheel_environment() -> dict[str, str]:
    """This process's environment, with what the wheel's binary and its python-backend stub need."""
    env = dict(os.environ)
    # the wheel's shared libraries sit beside the package, not on the system's library path
    _prepend(env, "LD_LIBRARY_PATH", str(pytriton_root().parent.parent / "nvidia_pytriton.libs"))
    # The stub embeds the system libpython in isolated mode: it ignores PYTHONPATH and
    # takes its prefix from the first `python3` on PATH.  Put this interpreter's folder
    # first, so the stub sees this environment's packages (a venv's, through its
    # pyvenv.cfg) whether or not the venv is activated.  PYTHONPATH is for stubs
    # built otherwise.
    _prepend(env, "PATH", str(Path(sys.executable).parent))
    paths = sysconfig.get_paths()
    site = list(dict.fromkeys([paths["purelib"], paths["platlib"]]))
    _prepend(env, "PYTHONPATH", *site)
    log.info("python backend stub: python3 from %s, packages from %s", Path(sys.executable).parent, site[0])
    return env
