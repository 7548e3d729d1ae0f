"""Imports run downward only: the folder layout is the data flow, and no step reaches up.

    cli -> bench -> exporter | gateway -> client -> tasks

and inside the exporter

    export entry points (pipeline, revalidate, build_plan) -> targets -> export steps
        -> serving -> triton -> errors

``targets`` builds on the export steps (padding trim, quantize, optimize), so
those steps sit below it and only the entry points that drive a whole export
sit above.  ``serving`` reads the configs ``triton`` writes (a GPU repository
served on the CPU rewrites them), so it sits above ``triton``; ``triton``
never imports ``serving``.
The exporter package root only re-exports the spec's names for readers
outside it; modules inside import from the home module instead.

Every import counts, including those inside functions, with relative imports
resolved; a failure names the file, the line and the import that goes up.
Inside a layer, no two modules import each other, directly or around a longer
loop: an import inside a function is no way out of a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: folder -> import name, as pyproject.toml's package-dir maps them
PACKAGES = {"cli": "nexus_sli.cli", "bench": "nexus_sli.bench", "exporter": "nexus_sli.exporter",
            "tasks": "nexus_sli.tasks", "client": "nexus_sli.client", "gateway": "nexus_sli.gateway"}
#: module prefix -> layer; the longest matching prefix decides
LAYERS = {
    "nexus_sli.cli": "cli",
    "nexus_sli.bench": "bench",
    "nexus_sli.exporter": "exporter root",
    "nexus_sli.exporter.export.pipeline": "export entry",
    "nexus_sli.exporter.export.revalidate": "export entry",
    "nexus_sli.exporter.export.build_plan": "export entry",
    "nexus_sli.exporter.targets": "targets",
    "nexus_sli.exporter.export": "export steps",
    "nexus_sli.exporter.triton": "triton",
    "nexus_sli.exporter.serving": "serving",
    "nexus_sli.exporter.errors": "errors",
    "nexus_sli.gateway": "gateway",
    "nexus_sli.client": "client",
    "nexus_sli.tasks": "tasks",
}
_BELOW_EXPORTER = {"client", "tasks"}
_EXPORTER_BASE = {"errors"} | _BELOW_EXPORTER
#: layer -> the other layers it may import (a layer may always import itself)
MAY_IMPORT = {
    "cli": set(LAYERS.values()) - {"cli"},
    "bench": set(LAYERS.values()) - {"cli", "bench"},
    "exporter root": {"export steps"} | _EXPORTER_BASE,
    "export entry": {"targets", "export steps", "triton", "serving"} | _EXPORTER_BASE,
    "targets": {"export steps", "triton", "serving"} | _EXPORTER_BASE,
    "export steps": {"triton", "serving"} | _EXPORTER_BASE,
    "triton": _EXPORTER_BASE,
    "serving": {"triton"} | _EXPORTER_BASE,
    "errors": _BELOW_EXPORTER,
    # the HTTP gateway speaks to Triton only through the client, beside the exporter, never through it
    "gateway": _BELOW_EXPORTER,
    "client": {"tasks"},
    "tasks": set(),
}


def layer_of(module: str) -> str | None:
    prefix = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len, default=None)
    return LAYERS.get(prefix)


def module_path(module: str) -> Path | None:
    """The file defining ``module`` (a package's ``__init__.py``), or None if it is not a module."""
    top = next((folder for folder, name in PACKAGES.items()
                if module == name or module.startswith(name + ".")), None)
    if top is None:
        return None
    base = ROOT.joinpath(top, *module[len(PACKAGES[top]):].split(".")[1:])
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


def module_name(path: Path) -> tuple[str, bool]:
    """(dotted import name, whether it is a package's ``__init__``) of a file in the tree."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    is_package = parts[-1] == "__init__"
    return ".".join([PACKAGES[parts[0]], *parts[1:-1], *([] if is_package else parts[-1:])]), is_package


def _from_target(node: ast.ImportFrom, package: str) -> str:
    """The absolute module a ``from ... import`` reads from, its leading dots resolved against ``package``."""
    if not node.level:
        return node.module
    parts = package.split(".")
    base = parts[: len(parts) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports_in(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module) of every nexus_sli import in ``source``, at any depth.

    ``from package import name`` counts as importing ``package.name`` when that
    is a module, so ``from nexus_sli.exporter import errors`` is not mistaken
    for a use of the package root.
    """
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _from_target(node, package)
            found += [(node.lineno, f"{target}.{alias.name}" if module_path(f"{target}.{alias.name}") else target)
                      for alias in node.names]
    return [(line, name) for line, name in found if name == "nexus_sli" or name.startswith("nexus_sli.")]


def upward_imports_in(source: str, module: str, is_package: bool, where: str) -> list[str]:
    own = layer_of(module)
    problems = []
    for line, imported in imports_in(source, module, is_package):
        other = layer_of(imported)
        if other is not None and other != own and other not in MAY_IMPORT[own]:
            problems.append(f"{where}:{line} ({own}) imports {imported} ({other})")
    return problems


def package_files() -> list[Path]:
    """Every importable .py file; generated folders (``bench/.repo``, Triton's ``1/``) are not modules."""
    return [path for folder in PACKAGES for path in sorted((ROOT / folder).rglob("*.py"))
            if all(part.isidentifier() for part in path.relative_to(ROOT).with_suffix("").parts)]


def upward_imports() -> list[str]:
    problems = []
    for path in package_files():
        module, is_package = module_name(path)
        problems += upward_imports_in(path.read_text(), module, is_package, str(path.relative_to(ROOT)))
    return problems


def test_no_module_imports_a_layer_above_or_beside_its_own():
    problems = upward_imports()
    assert not problems, "imports that go up or sideways:\n" + "\n".join(problems)


def test_the_rules_themselves_run_one_way():
    # a cycle in MAY_IMPORT would let two layers lean on each other, which is no layering at all
    def reaches(start: str, goal: str, seen: frozenset = frozenset()) -> bool:
        return any(nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt}))
                   for nxt in MAY_IMPORT[start])

    assert set(MAY_IMPORT) == set(LAYERS.values())
    assert [layer for layer in MAY_IMPORT if reaches(layer, layer)] == []


def test_the_checker_resolves_relative_and_nested_imports():
    source = "from . import config\nfrom ..errors import NexusError\ndef f():\n    from .models import write_models\n"
    assert imports_in(source, "nexus_sli.exporter.triton.staging", False) == [
        (1, "nexus_sli.exporter.triton.config"), (2, "nexus_sli.exporter.errors"),
        (4, "nexus_sli.exporter.triton.models")]
    assert imports_in("from .. import errors", "nexus_sli.exporter.triton", True) == [
        (1, "nexus_sli.exporter.errors")]


def test_the_checker_sees_upward_and_sideways_imports():
    def problems(source: str, module: str) -> list[str]:
        return upward_imports_in(source, module, False, "x.py")

    assert problems("def f():\n    from nexus_sli.exporter.export import pipeline\n", "nexus_sli.exporter.targets.base") \
        == ["x.py:2 (targets) imports nexus_sli.exporter.export.pipeline (export entry)"]
    assert problems("from ..serving import server", "nexus_sli.exporter.triton.staging") != []
    assert problems("from ..triton import config", "nexus_sli.exporter.serving.gpu_on_cpu") == []
    assert problems("from nexus_sli.exporter import NexusError", "nexus_sli.exporter.triton.staging") != []
    assert problems("import nexus_sli.cli.main", "nexus_sli.bench.harness") != []
    assert problems("from nexus_sli.client import EncoderClient", "nexus_sli.tasks.spec") != []
    assert problems("from nexus_sli.exporter.serving import server", "nexus_sli.gateway.app") != []
    assert problems("from nexus_sli.client import AsyncEncoderClient", "nexus_sli.gateway.backend") == []
    assert problems("from nexus_sli.exporter.export.padding_trim import x", "nexus_sli.exporter.targets.base") == []
    assert problems("from nexus_sli.exporter.triton.python_models.encoding import encode",
                    "nexus_sli.exporter.export.validate") == []


def _private(name: str) -> bool:
    """A name its module keeps to itself: a leading underscore, dunders (``__version__``) aside."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _ours(target: str, package: str) -> str | None:
    """The module of the tree ``target`` names: a nexus_sli one, or a sibling a copied file imports by its bare
    name (the python models' ``from encoding import ...``); None for any other."""
    if target == "nexus_sli" or target.startswith("nexus_sli."):
        return target
    sibling = f"{package}.{target}"
    return sibling if module_path(sibling) is not None else None


def private_imports_in(source: str, module: str, is_package: bool, where: str) -> list[str]:
    """Every use of another module's private name in ``source``: imported (``from .pooling import _node``,
    ``import nexus_sli.x._y``), or read off an imported module (``pooling._node``)."""
    package = module if is_package else module.rpartition(".")[0]
    tree = ast.parse(source)
    problems, modules = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _ours(_from_target(node, package), package)
            for alias in node.names if target else ():
                if _private(alias.name):
                    problems.append(f"{where}:{node.lineno} imports {target}.{alias.name}")
                elif module_path(f"{target}.{alias.name}") is not None:
                    modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                target = _ours(alias.name, package)
                if target and any(_private(part) for part in target.split(".")):
                    problems.append(f"{where}:{node.lineno} imports {target}")
                elif target and alias.asname:
                    modules.add(alias.asname)
    problems += [f"{where}:{node.lineno} reads {node.value.id}.{node.attr}" for node in ast.walk(tree)
                 if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                 and node.value.id in modules and _private(node.attr)]
    return problems


def test_no_module_uses_another_modules_private_names():
    problems = []
    for path in package_files():
        module, is_package = module_name(path)
        problems += private_imports_in(path.read_text(), module, is_package, str(path.relative_to(ROOT)))
    assert not problems, "private names used outside their module (make them public, or move the code):\n" + \
        "\n".join(problems)


def test_the_private_name_checker_sees_imports_and_reads():
    def problems(source: str, module: str = "nexus_sli.exporter.export.m3_heads") -> list[str]:
        return private_imports_in(source, module, False, "x.py")

    assert problems("from .pooling import MASK, _node") == ["x.py:1 imports nexus_sli.exporter.export.pooling._node"]
    assert problems("from . import pooling\nx = pooling._node") == ["x.py:2 reads pooling._node"]
    assert problems("import nexus_sli.exporter.export.pooling as p\np._pool()") == ["x.py:2 reads p._pool"]
    assert problems("from encoding import _load", "nexus_sli.exporter.triton.python_models.heads") == [
        "x.py:1 imports nexus_sli.exporter.triton.python_models.encoding._load"]
    assert problems("from numpy import _private\nfrom __future__ import annotations\nx = self._own") == []
    assert problems("from . import pooling\nx = pooling.__doc__") == []


def import_graph() -> dict[str, set[str]]:
    """module (a package's ``__init__`` included) -> the nexus_sli modules it imports, at any depth."""
    graph = {}
    for path in package_files():
        module, is_package = module_name(path)
        graph[module] = {name for _, name in imports_in(path.read_text(), module, is_package)
                         if module_path(name) is not None and name != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import cycle once, as the modules along it (a depth-first search's back edges)."""
    found, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for other in sorted(graph.get(module, ())):
            if state.get(other) == "open":
                found.append(path[path.index(other):] + [other])
            elif other not in state:
                visit(other, path + [other])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return found


def test_no_two_modules_import_each_other():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in found)


def test_the_cycle_finder_reports_each_cycle_once_and_no_false_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []
