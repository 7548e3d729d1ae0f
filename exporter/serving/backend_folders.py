"""The backend folder the wheel's ``tritonserver`` starts with (``--backend-directory``).

The ``nvidia-pytriton`` wheel's Triton has the python backend but neither an
``onnxruntime`` nor an ``openvino`` backend, and the exporter writes encoders
for those two.  So the folder holds the python backend, copied from the wheel,
and one Python-based backend per missing native one: a folder whose
``model.py`` Triton runs on the python backend for every model that names that
backend or platform.  Files are copied into a folder of ours; the installed
package is never modified.

Each shim imports its helpers as top-level modules from its own folder, so
each gets a copy of every helper: on a Triton server nexus-sli is not
installed.
"""

from __future__ import annotations

import shutil
import sys
from importlib import resources
from pathlib import Path

from nexus_sli.exporter.triton.models import SHARED_FILES

from .binary import ServerError, pytriton_root

#: The process each python-model instance runs in (it loads that model's ``model.py``).  Built for one
#: Python version: the wheel ships one per version, and only the running Python's can import this
#: environment's packages (tokenizers, onnxruntime, openvino).
STUB_EXECUTABLE = "triton_python_backend_stub"

#: ``python/``, from the wheel's own python backend, beside the stub.
PYTHON_BACKEND_FILES = (
    "libtriton_python.so",            # the python backend: runs the tokenizer, post-processing and the shims
    "triton_python_backend_utils.py",  # pb_utils, the module every python model imports
)

#: Python-based stand-ins for the native backends the PyPI Triton build lacks:
#: ``<name>/model.py`` is ``backends/<name>_backend.py`` of this package.
SHIM_BACKENDS = ("onnxruntime", "openvino")

#: Beside each shim's ``model.py``, from ``backends/``.
SHIM_HELPERS = (
    "encoder_backend.py",        # what both shims share: Triton's requests into batches and back into responses
    "batching.py",               # which rows of an execution run together, and at what length
    "openvino_properties.py",    # OpenVINO's compile properties, the same the exporter validated with
    "onnxruntime_providers.py",  # ONNX Runtime's execution providers from the config's instance kind
)


def prepare_backends(target: Path) -> Path:
    """The python backend with the stub for this Python, and the encoder shims, under ``target``."""
    _python_backend(pytriton_root(), target / "python")
    for backend in SHIM_BACKENDS:
        _shim(backend, target / backend)
    return target


def _python_backend(root: Path, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in PYTHON_BACKEND_FILES:
        shutil.copy2(root / "backends" / "python" / name, folder / name)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / STUB_EXECUTABLE
    if not stub.is_file():
        raise ServerError(f"nvidia-pytriton ships no python backend stub for Python {version}")
    shutil.copy2(stub, folder / STUB_EXECUTABLE)


def _shim(backend: str, folder: Path) -> None:
    package = resources.files("nexus_sli.exporter.serving.backends")
    folder.mkdir(exist_ok=True)
    (folder / "model.py").write_text(package.joinpath(f"{backend}_backend.py").read_text())
    for helper in SHIM_HELPERS:
        (folder / helper).write_text(package.joinpath(helper).read_text())
    # also beside each shim, as beside the python steps: the error codes the shims mark their errors with,
    # which the client maps to its exceptions, and the parameters' keys (the OpenVINO backend's)
    for shared, file in SHARED_FILES:
        (folder / file).write_text(resources.files(shared).joinpath(file).read_text())
