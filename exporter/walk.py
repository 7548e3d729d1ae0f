"""The layer walk: rebuild a model from its checkpoint one layer at a time.

For each distinct set of layer weights the handler gives the checkpoint
prefix; the layer is created with ``create_layer``, loaded *strictly* from
exactly the tensors under that prefix, and placed into the task model.  The
remaining tensors (embeddings, pooler, task head) are loaded into the rest of
the model.  Every checkpoint tensor ends up consumed or explicitly accounted
for (a buffer the model recomputes, a pre-training head the task does not
use); anything else is an error that names it.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from .checkpoint import Checkpoint
from .errors import CheckpointError
from .handler import BERTFamilyHandler
from .tasks import Task

log = logging.getLogger(__name__)


@dataclass
class WalkReport:
    layers_loaded: int = 0
    tensors_loaded: int = 0
    #: reason -> checkpoint keys that were deliberately not loaded
    skipped: dict[str, list[str]] = field(default_factory=dict)
    #: model parameters the checkpoint lacks but the task never uses
    absent_optional: list[str] = field(default_factory=list)

    def skip(self, reason: str, key: str) -> None:
        self.skipped.setdefault(reason, []).append(key)


def prepare_config(config: Any) -> Any:
    """A private copy that exports cleanly: eager attention (the ORT optimizer
    fuses its pattern; sdpa exports without fusable attention), no dropout."""
    config = copy.deepcopy(config)
    config._attn_implementation = "eager"
    return config


def _buffer_names(module: nn.Module) -> set[str]:
    return {name for name, _ in module.named_buffers()}


def _load_exactly(module: nn.Module, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Load ``tensors`` into ``module``; any missing, unexpected or misshapen tensor is an error."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    misshapen = [
        f"{where}{k}: checkpoint {tuple(tensors[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in sorted(set(tensors) & set(expected))
        if tensors[k].shape != expected[k].shape
    ]
    problems = []
    if missing:
        problems.append("missing " + ", ".join(where + k for k in missing))
    if unexpected:
        problems.append("unexpected " + ", ".join(where + k for k in unexpected))
    if misshapen:
        problems.append("wrong shape " + "; ".join(misshapen))
    if problems:
        raise CheckpointError(f"checkpoint does not fit the model at '{where}': " + "; ".join(problems))
    module.load_state_dict(tensors, strict=True)


def _replace(root: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    old = getattr(parent, name)
    if type(old) is not type(new):
        raise CheckpointError(f"create_layer built {type(new).__name__} but the model has {type(old).__name__} at {path}")
    setattr(parent, name, new)


def walk(config: Any, checkpoint: Checkpoint, task: Task, handler: BERTFamilyHandler | None = None):
    """Build ``task``'s model for ``config`` from ``checkpoint``; return (model, handler, report)."""
    config = prepare_config(config)
    handler = (handler or BERTFamilyHandler()).bind(config, checkpoint.keys())
    family = handler.family
    with torch.device("cpu"):
        model = family.build_model(task, config)
    model.eval()
    base = model.base_model
    target_base = "" if base is model else model.base_model_prefix + "."
    report = WalkReport()
    consumed: set[str] = set()
    keys = checkpoint.keys()
    slots = list(family.weight_slots(config))
    for idx, relative in tqdm(slots, desc=f"walk {family.model_type} layers", unit="layer", disable=None):
        prefix = handler.prefix + relative
        layer = handler.create_layer(config, idx)
        layer_keys = [k for k in keys if k.startswith(prefix)]
        buffers = _buffer_names(layer)
        tensors = {}
        for key in layer_keys:
            if key[len(prefix):] in buffers and key[len(prefix):] not in layer.state_dict():
                report.skip("buffer the model recomputes", key)
            else:
                tensors[key[len(prefix):]] = checkpoint.get(key)
        _load_exactly(layer, family.convert_layer_tensors(tensors), prefix)
        _replace(base, family.module_path(config, idx), layer.eval())
        consumed.update(layer_keys)
        report.layers_loaded += 1
        report.tensors_loaded += len(tensors)
    module_paths = [family.module_path(config, idx) + "." for idx, _ in slots]
    _load_rest(model, checkpoint, handler, target_base, module_paths, consumed, report)
    return model, handler, report


def _load_rest(model, checkpoint, handler, target_base, layer_paths, consumed, report) -> None:
    family = handler.family
    layer_targets = tuple(target_base + rel for rel in layer_paths)
    wanted = {k: v for k, v in model.state_dict().items() if not k.startswith(layer_targets)}
    buffers = _buffer_names(model)
    loaded: dict[str, torch.Tensor] = {}
    unconsumed = []
    for key in checkpoint.keys():
        if key in consumed:
            continue
        inside_base = key.startswith(handler.prefix)
        relative = family.convert_key(key[len(handler.prefix):]) if inside_base else key
        target = target_base + relative if inside_base else key
        if target in wanted:
            loaded[target] = checkpoint.get(key)
        elif target in buffers:
            report.skip("buffer the model recomputes", key)
        elif relative.startswith(family.pretraining_head_prefixes) or key.startswith(family.pretraining_head_prefixes):
            report.skip("pre-training head the task does not use", key)
        else:
            unconsumed.append(key)
    if unconsumed:
        raise CheckpointError(
            f"{len(unconsumed)} checkpoint tensor(s) match nothing in the {family.model_type} model "
            f"for this task: {', '.join(sorted(unconsumed)[:12])}"
            + (" ..." if len(unconsumed) > 12 else "")
        )
    optional = tuple(target_base + p for p in family.optional_prefixes)
    missing = sorted(k for k in wanted if k not in loaded and k not in buffers)
    required = [k for k in missing if not k.startswith(optional)]
    if required:
        raise CheckpointError(f"checkpoint lacks tensor(s) the model needs: {', '.join(required[:12])}")
    report.absent_optional = [k for k in missing if k.startswith(optional)]
    for key, tensor in loaded.items():
        if tensor.shape != wanted[key].shape:
            raise CheckpointError(
                f"tensor {key!r} has shape {tuple(tensor.shape)}, the model expects {tuple(wanted[key].shape)}"
            )
    model.load_state_dict(loaded, strict=False)
    report.tensors_loaded += len(loaded)
    if report.absent_optional:
        log.warning("not in the checkpoint and unused by this task: %s", ", ".join(report.absent_optional))
