"""A model's name in a repository: one Triton can serve (:func:`check_name`), whose folders no other model uses.

An export of ``NAME`` writes ``NAME`` (its ensemble) and its steps, ``NAME_tokenizer``,
``NAME_encoder``, ``NAME_postprocess``, and its token ensemble ``NAME_tokens``,
replacing whatever folders have those names.  Names are free-form, so another
model's folder can have one of them: a model named ``tiny_encoder`` would replace the
encoder of the model ``tiny``, and a model ``tiny`` would replace a model exported as
``tiny_tokens``.  :func:`check_free` refuses such a name before any work: a
repository's ensembles say which folders each model uses.  Torch-free: ``nexus-sli validate``
checks names on hosts without PyTorch.
"""

from __future__ import annotations

import re
from pathlib import Path

from google.protobuf.text_format import ParseError

from nexus_sli.exporter.errors import NexusError
from nexus_sli.tasks.spec import TOKEN_MODEL_SUFFIX

from . import config as tc

_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]{0,99}$")
#: The steps' folders of a model, by the suffix they add to its name (``models.write_models``).
STEP_SUFFIXES = ("_tokenizer", "_encoder", "_postprocess")


def check_name(name: str) -> str:
    """Reject names that could escape the repository or that Triton cannot serve."""
    if not _SAFE_NAME.fullmatch(name):  # fullmatch: `$` alone would let a trailing newline through
        raise NexusError(
            f"invalid model name {name!r}: use 1-100 letters, digits, '_' or '-', not starting with '-'"
        )
    return name


def newest_version(model_dir: Path) -> int:
    """The newest version folder of a model (the number), 0 where it has none.  An export writes version 1;
    ``nexus-sli serve``'s swap moves its search's winner in at the next version."""
    return max((int(p.name) for p in Path(model_dir).iterdir() if p.is_dir() and p.name.isdigit()), default=0)


def written_by(name: str) -> set[str]:
    """Every folder an export of ``name`` may write or replace."""
    return {name, name + TOKEN_MODEL_SUFFIX, *(name + suffix for suffix in STEP_SUFFIXES)}


def _ensembles(out: Path) -> dict[str, tc.pb.ModelConfig]:
    """The repository's ensembles, by name (folders whose config.pbtxt is one; unreadable configs are skipped:
    Triton would not serve them either)."""
    found = {}
    for config in sorted(out.glob("*/config.pbtxt")) if out.is_dir() else []:
        try:
            parsed = tc.read(config)
        except (ParseError, OSError, UnicodeDecodeError):
            continue
        if parsed.platform == "ensemble":
            found[config.parent.name] = parsed
    return found


def _steps(config: tc.pb.ModelConfig) -> set[str]:
    return {step.model_name for step in config.ensemble_scheduling.step}


def _owns(name: str, ensemble: str, config: tc.pb.ModelConfig) -> bool:
    """Whether ``ensemble`` is the model ``name`` itself or its token ensemble (``NAME_tokens``): either calls only
    ``name``'s steps (a model's token ensemble named like another model calls its own model's)."""
    return ensemble in (name, name + TOKEN_MODEL_SUFFIX) and _steps(config) <= written_by(name)


def check_free(out: Path, name: str) -> None:
    """Refuse ``name`` where exporting it into ``out`` would replace a folder another model serves: another
    ensemble, or a step another ensemble calls."""
    mine = written_by(name)
    for ensemble, config in _ensembles(Path(out)).items():
        if _owns(name, ensemble, config):
            continue
        used = {ensemble} | _steps(config)
        clash = sorted(mine & used)
        if clash:
            raise NexusError(f"an export named {name!r} would replace {', '.join(clash)} in {out}, which the model "
                             f"{ensemble!r} serves; choose another --name (an export writes {name} and "
                             f"{', '.join(sorted(mine - {name}))})")
