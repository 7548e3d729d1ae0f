"""Imports run downward only: the folder layout is the data flow, and no step reaches up.

    cli -> bench -> exporter.export.pipeline | revalidate -> exporter.targets -> exporter.export (steps)
        -> exporter.serving -> exporter.triton -> exporter.errors -> client -> tasks

Modules on one rank in different layers are siblings and may not import each
other.  Every import counts, including those inside functions.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: folder -> import name, as pyproject.toml's package-dir maps them
PACKAGES = {"cli": "nexus_sli.cli", "bench": "nexus_sli.bench", "exporter": "nexus_sli.exporter",
            "tasks": "nexus_sli.tasks", "client": "nexus_sli.client"}
#: (module prefix, layer, rank): the longest matching prefix decides; a higher rank is further down
LAYERS = [
    ("nexus_sli.cli", "cli", 0),
    ("nexus_sli.bench", "bench", 1),
    ("nexus_sli.exporter.export.pipeline", "pipeline", 2),
    ("nexus_sli.exporter.export.revalidate", "pipeline", 2),
    ("nexus_sli.exporter.targets", "targets", 3),
    ("nexus_sli.exporter.export", "export steps", 4),
    ("nexus_sli.exporter.serving", "serving", 5),
    ("nexus_sli.exporter.triton", "triton", 6),
    ("nexus_sli.exporter.errors", "exporter errors", 7),
    ("nexus_sli.client", "client", 8),
    ("nexus_sli.tasks", "tasks", 9),
]
#: the exporter package's root only re-exports the spec's names (see its docstring)
FACADE = "nexus_sli.exporter"


def layer_of(module: str) -> tuple[str, int] | None:
    matches = [(len(prefix), name, rank) for prefix, name, rank in LAYERS
               if module == prefix or module.startswith(prefix + ".")]
    return max(matches)[1:] if matches else None


def module_name(path: Path) -> tuple[str, bool]:
    parts = path.relative_to(ROOT).with_suffix("").parts
    is_package = parts[-1] == "__init__"
    dotted = ".".join([PACKAGES[parts[0]], *parts[1:-1], *([] if is_package else parts[-1:])])
    return dotted, is_package


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every nexus_sli import in ``path``, relative ones resolved."""
    module, is_package = module_name(path)
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join([*base, *([node.module] if node.module else [])])
            found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
    return [(line, name) for line, name in found if name.startswith("nexus_sli")]


def upward_imports() -> list[str]:
    problems = []
    for folder in PACKAGES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            importer, _ = module_name(path)
            if importer == FACADE:
                continue
            own = layer_of(importer)
            for line, imported in imports(path):
                other = layer_of(imported) if imported.rpartition(".")[0] != FACADE else ("exporter facade", 0)
                if own and other and other[0] != own[0] and other[1] <= own[1]:
                    problems.append(f"{path.relative_to(ROOT)}:{line} ({own[0]}) imports {imported} ({other[0]})")
    return problems


def test_no_module_imports_a_layer_above_or_beside_its_own():
    assert upward_imports() == []


def test_the_checker_sees_upward_imports():
    assert layer_of("nexus_sli.exporter.export.walk") == ("export steps", 4)
    assert layer_of("nexus_sli.exporter.export.pipeline") == ("pipeline", 2)
    assert layer_of("nexus_sli.exporter.triton.python_models.encoding")[1] > layer_of("nexus_sli.exporter.targets")[1]
    assert layer_of("nexus_sli.cli.main")[1] < layer_of("nexus_sli.bench.harness")[1]
