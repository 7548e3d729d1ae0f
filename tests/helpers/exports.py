"""Exports made once per test run and copied into the repositories tests serve.

An export of the packaged MiniLM costs far more than a copy of it; a dozen modules serve one.
Each export is made the first time a test asks for it, into a repository of its
own (so a copy takes exactly that model's folders), and copied from there under
the name the test serves it by: the copy renames the folders and the names in
their ``config.pbtxt`` (the model's own, its ensembles' steps, and the parameters
that link an ensemble to its token ensemble), which is all that carries the name.
The store's folder is shared by every process of the run (pytest-xdist's workers):
a lock per export lets one process make it while the others wait for it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from filelock import FileLock

from nexus_sli.exporter.export import export_report
from nexus_sli.exporter.export.export_report import ExportReport
from nexus_sli.exporter.export.pipeline import ExportOptions, run_export
from nexus_sli.exporter.triton import config as triton_config

#: The packaged all-MiniLM-L6-v2's default export name (what ``make export`` writes).
MINILM = "all_minilm_l6_v2"

#: the file that says an export in the store is whole (made by a process that finished it)
MADE = ".made"

#: name -> the options of each shared export of the packaged model, as the modules that serve it ask
PACKAGED: dict[str, dict] = {
    MINILM: {},
    "minilm_int8": {"precision": "int8"},
    # the earlier layout, tokenizer -> encoder -> python post-processing, refusing texts past the limit
    "minilm_strict": {"truncate": False, "pool_in_graph": False},
    # bf16 where the CPU has it, else fp32 (the exporter falls back and says so)
    "minilm_openvino": {"backend": "openvino", "precision": "bf16"},
    # NNCF's int8 IR, written even where it misses the bar on this CPU: its first variant only (a quarter of the
    # export's time; the tests serve an int8 IR and compare it with its own validation, not a choice of variants)
    "minilm_openvino_int8": {"backend": "openvino", "precision": "int8", "allow_degraded": True, "search": False},
    # the GPU target (fp16 for TensorRT), validated here on ONNX Runtime's CPU provider
    "minilm_gpu": {"device": "gpu", "backend": "auto", "precision": "auto"},
}


class ExportStore:
    """Shared exports by name: :meth:`copy` exports on first use, then copies."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def export(self, name: str, model: str | None = None, **options) -> ExportReport:
        """The record of the export ``name`` (of ``model``, else of the packaged model with
        :data:`PACKAGED`'s options), made by whichever process asked first."""
        folder = self.root / name
        options = options if model is not None else {**PACKAGED[name], **options}
        asked = json.dumps({"model": model, "options": options}, sort_keys=True, default=str)
        with FileLock(str(self.root / f"{name}.lock")):
            if not (folder / MADE).is_file():
                shutil.rmtree(folder, ignore_errors=True)  # what an export that failed or was killed left
                run_export(ExportOptions(model=model, name=name, out=folder, **options))
                (folder / MADE).write_text(asked)
        made = (folder / MADE).read_text()
        assert made == asked, f"the shared export {name!r} was made as {made}, not as {asked}: give it another name"
        return export_report.read(folder / f"{name}_encoder")

    def copy(self, name: str, repository: Path, as_name: str | None = None, **export) -> Path:
        """Export ``name`` if not yet done, and copy its models into ``repository`` as ``as_name``."""
        self.export(name, **export)
        copy_models(self.root / name, name, repository, as_name or name)
        return repository


def copy_models(source: Path, name: str, repository: Path, as_name: str) -> None:
    """Every model folder of ``source`` (one export's repository) into ``repository``, ``name`` renamed."""
    repository.mkdir(parents=True, exist_ok=True)
    for folder in sorted(p for p in source.iterdir() if p.is_dir()):
        assert folder.name == name or folder.name.startswith(f"{name}_"), f"{folder} is no model of {name!r}"
        target = repository / (as_name + folder.name[len(name):])
        shutil.copytree(folder, target)
        if as_name != name:
            _rename(target / "config.pbtxt", name, as_name)
    readme = source / "README.md"
    if readme.is_file() and not (repository / "README.md").exists():
        shutil.copyfile(readme, repository / "README.md")


def _rename(path: Path, name: str, as_name: str) -> None:
    def renamed(text: str) -> str:
        return as_name + text[len(name):] if text == name or text.startswith(name + "_") else text

    config = triton_config.read(path)
    config.name = renamed(config.name)
    for step in config.ensemble_scheduling.step:
        step.model_name = renamed(step.model_name)
    for parameter in config.parameters.values():
        parameter.string_value = renamed(parameter.string_value)
    triton_config.write(config, path.parent)
