"""The layer walk: rebuild a model from its checkpoint one layer at a time.

For each distinct set of layer weights the handler gives the checkpoint
prefix; the layer is created with ``create_layer``, loaded *strictly* from
exactly the tensors under that prefix, and placed into the task model.  The
remaining tensors (embeddings, pooler, task head) are loaded into the rest of
the model.  Every checkpoint tensor ends up consumed or explicitly accounted
for (a buffer the model recomputes, a pre-training head the task does not
use); anything else is an error that names it.

With a :class:`~.layer_cache.LayerCache`, a layer whose checkpoint tensors are
unchanged since it was cached is rebuilt from the cache and its tensors are not
read.  "Unchanged" is judged without reading tensor data, from the safetensors
header and the file's stat (see :meth:`Checkpoint.tensor_source`): rewriting
a file makes every layer stored in it miss, layers in other shards still hit.
Pickle checkpoints are never cached: they have no header to key on, and keying
on their bytes would read everything the cache is meant to skip.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from .checkpoint import Checkpoint
from nexus_sli.exporter.errors import CheckpointError
from .handler import BERTFamilyHandler
from .layer_cache import LayerCache
from nexus_sli.tasks import TaskSpec

log = logging.getLogger(__name__)


# Part of every cache key: bump it when the walk changes what a layer's weights
# are for the same checkpoint tensors (convert_layer_tensors, dtype handling).
# The source of the walk and of the family's classes is in the key too
# (:func:`_conversion_digest`), so a change there is a miss even without a bump.
_CACHE_KEY_VERSION = 1


def _conversion_digest(family: Any) -> str:
    """SHA-256 of the code that turns a checkpoint's tensors into a layer's weights: this module and the
    modules of the family's class and of every class it derives from (``convert_layer_tensors``)."""
    files = {Path(__file__)} | {Path(inspect.getsourcefile(kind)) for kind in type(family).__mro__
                                if kind is not object and inspect.getsourcefile(kind)}
    return hashlib.sha256(b"".join(file.read_bytes() for file in sorted(files))).hexdigest()


@dataclass
class WalkReport:
    #: distinct layers put into the model, wherever their weights came from
    layers_loaded: int = 0
    #: of those, layers rebuilt from the layer cache without reading the checkpoint
    layers_from_cache: int = 0
    #: tensors put into the model (a cached layer's count as loaded)
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


def open_layer_cache(cache_dir: str | os.PathLike | None = None) -> LayerCache | None:
    """The LayerCache at ``cache_dir`` (None: its default), or None with a warning when
    the directory cannot be used: a read-only home must not stop an export."""
    try:
        return LayerCache(cache_dir)
    except OSError as exc:
        log.warning("layer cache disabled, cannot use %s (%s); pass --cache-dir DIR or --no-cache",
                    cache_dir or "the default cache directory", exc)
        return None


class _CachedLayers:
    """The walk's use of a LayerCache for one checkpoint.

    Entries are stored exact (``quantization_mode="none"``, fp32): the walked
    model is the fp32 reference every exported graph is validated against, so
    a lossy (int8 / fp16) cached layer would shift the reference itself and
    validation could not notice.
    """

    def __init__(self, cache: LayerCache, checkpoint: Checkpoint, model_type: str, code: str = ""):
        self.cache = cache
        self.checkpoint = checkpoint
        self.model_type = model_type
        #: :func:`_conversion_digest` of the family walked
        self.code = code
        self.model_id = str(checkpoint.directory.resolve())
        self.store_failed = False

    def source_key(self, layer: nn.Module, keys: list[str]) -> str | None:
        """A digest of where the layer's tensors are and what the layer expects; None if uncacheable."""
        sources = [self.checkpoint.tensor_source(key) for key in keys]
        if not keys or any(source is None for source in sources):
            return None
        layer_type = type(layer)
        payload = {
            "version": _CACHE_KEY_VERSION,
            "code": self.code,
            "family": self.model_type,
            "layer": f"{layer_type.__module__}.{layer_type.__qualname__}",
            "expects": {name: [str(t.dtype), list(t.shape)] for name, t in layer.state_dict().items()},
            "tensors": dict(zip(keys, sources)),
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def fill(self, layer: nn.Module, idx: int, source_key: str) -> bool:
        """Put the cached weights into ``layer``; False on a miss (``layer`` untouched)."""
        hit = self.cache.get_layer(self.model_id, idx, lambda: layer, source_hash=source_key,
                                   quantization_mode="none")
        return hit is not None

    def store(self, layer: nn.Module, idx: int, source_key: str) -> None:
        if self.store_failed:
            return
        try:
            self.cache.cache_layer(self.model_id, idx, layer, quantization_mode="none", source_hash=source_key)
        except OSError as exc:  # a full or read-only disk costs the next export time, not this one
            log.warning("layer cache: could not store layer %d in %s (%s); going on without storing",
                        idx, self.cache.cache_dir, exc)
            self.store_failed = True


def _split_layer_keys(layer: nn.Module, prefix: str, layer_keys: list[str]) -> tuple[list[str], list[str]]:
    """(keys to load into the layer, keys of buffers the layer recomputes instead)."""
    state, buffers = layer.state_dict(), _buffer_names(layer)
    recomputed = [k for k in layer_keys if k[len(prefix):] in buffers and k[len(prefix):] not in state]
    return [k for k in layer_keys if k not in recomputed], recomputed


def _fill_layer(layer, idx, prefix, keys, checkpoint, family, cached: _CachedLayers | None) -> bool:
    """Load ``layer``'s weights, from the cache when it holds them unchanged; True if it did."""
    source_key = cached.source_key(layer, keys) if cached else None
    if source_key and cached.fill(layer, idx, source_key):
        return True
    tensors = {key[len(prefix):]: checkpoint.get(key) for key in keys}
    _load_exactly(layer, family.convert_layer_tensors(tensors), prefix)
    if source_key:
        cached.store(layer, idx, source_key)
    return False


def walk(config: Any, checkpoint: Checkpoint, task: TaskSpec, handler: BERTFamilyHandler | None = None,
         cache: LayerCache | None = None):
    """Build ``task``'s model for ``config`` from ``checkpoint``; return (model, handler, report).

    With ``cache``, layers are taken from it where the checkpoint tensors they
    came from are unchanged, and stored in it otherwise.
    """
    config = prepare_config(config)
    handler = (handler or BERTFamilyHandler()).bind(config, checkpoint.keys())
    family = handler.family
    family.adapt_config(config)
    with torch.device("cpu"):
        model = family.build_model(task, config)
    model.eval()
    target_base = "" if model.base_model is model else model.base_model_prefix + "."
    report = WalkReport()
    cached = _CachedLayers(cache, checkpoint, family.model_type, _conversion_digest(family)) if cache is not None \
        else None
    slots = list(family.weight_slots(config))
    consumed = _walk_layers(model.base_model, config, checkpoint, handler, slots, cached, report)
    layer_paths = [family.module_path(config, idx) + "." for idx, _ in slots]
    _load_rest(model, checkpoint, handler, target_base, layer_paths, consumed | set(task.head_tensors), report)
    for key in task.head_tensors:
        if key in checkpoint:
            report.skip("read by the task's head, outside the encoder", key)
    return model, handler, report


def _walk_layers(base, config, checkpoint, handler, slots, cached, report) -> set[str]:
    """Create, load and place each distinct layer in ``base``; return the checkpoint keys they consumed."""
    family = handler.family
    keys = checkpoint.keys()
    consumed: set[str] = set()
    for idx, relative in tqdm(slots, desc=f"walk {family.model_type} layers", unit="layer", disable=None):
        prefix = handler.prefix + relative
        layer = handler.create_layer(config, idx)
        layer_keys = [k for k in keys if k.startswith(prefix)]
        to_load, recomputed = _split_layer_keys(layer, prefix, layer_keys)
        for key in recomputed:
            report.skip("buffer the model recomputes", key)
        report.layers_from_cache += _fill_layer(layer, idx, prefix, to_load, checkpoint, family, cached)
        _replace(base, family.module_path(config, idx), layer.eval())
        consumed.update(layer_keys)
        report.layers_loaded += 1
        report.tensors_loaded += len(to_load)
    return consumed


def _load_rest(model, checkpoint, handler, target_base, layer_paths, consumed, report) -> None:
    """Everything outside the walked layers (embeddings, pooler, task head), checked and loaded strictly."""
    layer_targets = tuple(target_base + rel for rel in layer_paths)
    wanted = {k: v for k, v in model.state_dict().items() if not k.startswith(layer_targets)}
    buffers = _buffer_names(model)
    loaded = _collect_rest(checkpoint, handler, target_base, consumed, wanted, buffers, report)
    _check_missing(handler.family, target_base, wanted, _with_tied(model, loaded), buffers, report)
    _check_shapes(wanted, loaded)
    model.load_state_dict(loaded, strict=False)
    report.tensors_loaded += len(loaded)
    if report.absent_optional:
        log.warning("not in the checkpoint and unused by this task: %s", ", ".join(report.absent_optional))


def _collect_rest(checkpoint, handler, target_base, consumed, wanted, buffers, report) -> dict[str, torch.Tensor]:
    """The checkpoint's remaining tensors by model key; a tensor nothing consumes is an error naming it."""
    family = handler.family
    loaded: dict[str, torch.Tensor] = {}
    unconsumed = []
    for key in (k for k in checkpoint.keys() if k not in consumed):
        inside_base = key.startswith(handler.prefix)
        relative = family.convert_key(key[len(handler.prefix):]) if inside_base else key
        target = target_base + relative if inside_base else key
        if target in wanted:
            loaded[target] = checkpoint.get(key)
        elif target in buffers:
            report.skip("buffer the model recomputes", key)
        elif relative.startswith(family.pretraining_head_prefixes) or key.startswith(family.pretraining_head_prefixes):
            report.skip("pre-training head the task does not use", key)
        elif inside_base and relative.startswith(family.optional_prefixes):  # a masked-LM model has no pooler
            report.skip("base-model tensor the task's model does not have", key)
        else:
            unconsumed.append(key)
    if unconsumed:
        raise CheckpointError(
            f"{len(unconsumed)} checkpoint tensor(s) match nothing in the {family.model_type} model "
            f"for this task: {', '.join(sorted(unconsumed)[:12])}" + (" ..." if len(unconsumed) > 12 else ""))
    return loaded


def _with_tied(model: nn.Module, loaded: dict[str, torch.Tensor]) -> set[str]:
    """The model keys ``loaded`` fills: its own, and every key of a parameter tied to one of them (a
    masked-LM decoder shares the word embeddings; checkpoints save a tied tensor once, under one name)."""
    names_of: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(parameter), []).append(name)
    filled = set(loaded)
    for names in names_of.values():
        if filled & set(names):
            filled.update(names)
    return filled


def _check_missing(family, target_base, wanted, loaded, buffers, report) -> None:
    """Every tensor the model needs is there; optional ones may be absent (recorded in the report)."""
    optional = tuple(target_base + p for p in family.optional_prefixes)
    missing = sorted(k for k in wanted if k not in loaded and k not in buffers)
    required = [k for k in missing if not k.startswith(optional)]
    if required:
        raise CheckpointError(f"checkpoint lacks tensor(s) the model needs: {', '.join(required[:12])}")
    report.absent_optional = [k for k in missing if k.startswith(optional)]


def _check_shapes(wanted, loaded) -> None:
    for key, tensor in loaded.items():
        if tensor.shape != wanted[key].shape:
            raise CheckpointError(
                f"tensor {key!r} has shape {tuple(tensor.shape)}, the model expects {tuple(wanted[key].shape)}")
