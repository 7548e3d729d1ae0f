"""deploy/docker/Dockerfile, read with Docker's own parser (the ``dockerfile`` package): a pinned NGC
Triton image, and every package the repository's python models import, as the local server pins them.

Docker is not available on this project's machines, so the image is not built here
(docs/gpu.md says so); this checks what can be checked without building it.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
#: What the python models run beside inside the server: themselves, Triton's module, the copied error codes
#: and parameters' keys.
IN_SERVER = {"encoding", "heads", "sides", "error_codes", "model_parameters", "triton_python_backend_utils"}
#: import name -> the distribution that provides it
DISTRIBUTIONS = {"numpy": "numpy", "tokenizers": "tokenizers"}
tomllib = pytest.importorskip("tomllib")  # Python 3.11+


#: The parser is Docker's own Go code (a Go runtime in a C extension).  A full run once died of a
#: segfault, with no Python trace, right around this module's first parse; whether the Go runtime
#: beside torch's and gRPC's threads caused it was not established, but a crash in an interpreter of
#: its own fails one test instead of the whole run.
_PARSE = ("import dockerfile, json, sys; print(json.dumps([{'cmd': c.cmd, 'value': list(c.value), 'json': c.json} "
          "for c in dockerfile.parse_file(sys.argv[1])]))")


def _commands() -> list[SimpleNamespace]:
    """The Dockerfile's instructions (``cmd``, ``value`` as a tuple, ``json``), as Docker parses them."""
    out = subprocess.run([sys.executable, "-c", _PARSE, str(DOCKERFILE)], capture_output=True, text=True, check=True)
    return [SimpleNamespace(cmd=c["cmd"], value=tuple(c["value"]), json=c["json"]) for c in json.loads(out.stdout)]


def _installed() -> dict[str, Requirement]:
    """The requirements the Dockerfile's pip installs, by name."""
    found = {}
    for command in _commands():
        if command.cmd.upper() != "RUN":
            continue
        words = shlex.split(" ".join(command.value))
        if "pip" in words and "install" in words:
            start = words.index("install") + 1
            found.update({(r := Requirement(w)).name: r for w in words[start:] if not w.startswith("-")})
    return found


def _in_server(tree: ast.Module) -> list[ast.AST]:
    """The nodes of a python model's file that run in the server: all but the body of ``if __package__:``,
    which runs only where the file is imported from the nexus_sli package (validation, tests)."""
    branches = [node for node in ast.walk(tree)
                if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "__package__"]
    package_only = {id(node) for branch in branches for statement in branch.body for node in ast.walk(statement)}
    return [node for node in ast.walk(tree) if id(node) not in package_only]


def _third_party_imports() -> set[str]:
    """Top-level modules the python models import that neither Python nor the server provides."""
    names = set()
    for path in (ROOT / "exporter" / "triton" / "python_models").glob("*.py"):
        for node in _in_server(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in IN_SERVER and n != "__future__"}


def test_the_base_is_one_pinned_ngc_triton_release():
    (base,) = [c for c in _commands() if c.cmd.upper() == "FROM"]
    assert re.fullmatch(r"nvcr\.io/nvidia/tritonserver:\d{2}\.\d{2}-py3", base.value[0]), base.value


def test_it_installs_what_the_python_models_import():
    imports = _third_party_imports()
    assert imports == {"numpy", "tokenizers"}  # a new import must be added here and to the image
    assert {DISTRIBUTIONS[name] for name in imports} <= set(_installed())


def test_its_pins_are_the_local_servers():
    # numpy<2: the python backend stub of this Triton release crashed on string inputs with numpy 2
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    serve = {r.name: r for r in map(Requirement, project["optional-dependencies"]["serve"])}
    base = {r.name: r for r in map(Requirement, project["dependencies"])}
    installed = _installed()
    assert installed["numpy"].specifier == serve["numpy"].specifier
    assert installed["tokenizers"].specifier == base["tokenizers"].specifier


def test_it_serves_a_repository_mounted_at_models():
    (cmd,) = [c for c in _commands() if c.cmd.upper() == "CMD"]
    assert cmd.json and cmd.value == ("tritonserver", "--model-repository=/models")
    assert not [c for c in _commands() if c.cmd.upper() == "ENTRYPOINT"]  # NVIDIA's entrypoint stays
