"""An on-disk cache of encoder layers, optionally quantized, bounded in size.

Each entry is one safetensors file holding one layer's state dict, encoded as
``int8`` (per-output-channel symmetric weights plus fp32 scales, settings from
:func:`~.quantize.get_int8_config`), ``fp16`` or ``none`` (fp32).  The
safetensors metadata carries the entry's key, its encoding manifest and a
checksum of the stored tensors, so a damaged entry is detected, deleted and
reported as a miss instead of being returned.

Keys are ``(model_id, layer_index, source_hash)``: the caller hashes the
checkpoint tensors the layer came from (:func:`tensor_digest`), so weights
that changed on disk never come back stale.  Entries are written atomically and
evicted least recently used first (:mod:`cache_files`, which the candidate cache
shares), so a killed process leaves either the old entry, the new one, or
nothing, and recency survives a new :class:`LayerCache` over the same directory.

Concurrency: there are no locks.  Every file operation tolerates the file
vanishing under it (another thread or process evicted it) and readers load an
entry's bytes in one read, so threads and processes sharing a directory never
see a partial entry; two writers of one key both write complete files and the
last ``os.replace`` wins.  The size bound is enforced per writer, so processes
writing at the same moment can overshoot it briefly by their in-flight entries.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import os
import re
import struct
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import nn

from nexus_sli.exporter.errors import LayerCacheError, LayerIndexError
from . import cache_files
from .cache_files import default_cache_dir
from .cache_files import touch as _touch
from .cache_files import unlink as _unlink
from .quantize import get_int8_config

log = logging.getLogger(__name__)

#: The encodings ``cache_layer`` accepts, most compact first.
QUANTIZATION_MODES = ("int8", "fp16", "none")

_FORMAT = "nexus-sli-layer-cache/1"
_ENTRY_SUFFIX = ".safetensors"
# ':' never occurs in a torch state-dict key written by nn.Module attribute
# names, so scale tensors cannot collide with the layer's own tensors.
_SCALE_SUFFIX = ":scale"
_GIB = 1024**3
_FP16_MAX = torch.finfo(torch.float16).max
#: how the cache's files are named in the log (:mod:`cache_files`)
_WHAT = "layer cache"


# --------------------------------------------------------------------------- hashing


def tensor_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 (hex) over every tensor's name, dtype, shape and raw bytes, in name order.

    The bytes are hashed in place (no copy for contiguous CPU tensors); the
    hash's cost grows with the layer's bytes, as reading them does.
    """
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach()
        header = json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode()
        digest.update(struct.pack("<Q", len(header)) + header)
        digest.update(_raw_bytes(tensor))
    return digest.hexdigest()


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    # Viewing as uint8 works for every dtype numpy lacks (bfloat16, float8 ...);
    # reshape first because a 0-d tensor cannot change its element size.
    flat = tensor.cpu().contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())


# --------------------------------------------------------------------------- encoding


def _int8_settings() -> dict:
    """The parts of the project's one int8 config that apply to stored weights."""
    config = get_int8_config()
    if config.weight_type != "QInt8":
        # Signed int8 is what makes the scheme symmetric (ORT quantizes QInt8
        # weights symmetrically); an unsigned type would need zero points.
        raise LayerCacheError(
            f"the layer cache stores signed symmetric int8 weights; get_int8_config() asks for {config.weight_type!r}"
        )
    # reduce_range means 7-bit weights in ONNX Runtime; keep the same numbers here.
    return {"per_channel": bool(config.per_channel), "qmax": 63 if config.reduce_range else 127}


def _quantize(weight: torch.Tensor, per_channel: bool, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 of ``weight`` (row = output channel, as in ``nn.Linear``); returns (q, scale)."""
    rows = weight.reshape(weight.shape[0], -1).float()
    amax = rows.abs().amax(dim=1) if per_channel else rows.abs().amax().reshape(1)
    scale = amax / qmax
    # An all-zero row gets scale 0: it quantizes to zeros and dequantizes exactly.
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(rows / divisor.unsqueeze(1)).clamp_(-qmax, qmax).to(torch.int8)
    return q.reshape(weight.shape).contiguous(), scale.contiguous()


def _codec(tensor: torch.Tensor, mode: str) -> str:
    """How one tensor is stored: int8 only for float matrices, 1-D floats stay fp32."""
    if not tensor.is_floating_point():
        return "raw"
    if mode == "int8" and tensor.dim() >= 2 and tensor.numel() > 0:
        return "int8"
    # A value beyond fp16's range would come back as inf: keep such a tensor fp32.
    if mode == "fp16" and (tensor.numel() == 0 or tensor.abs().max().item() <= _FP16_MAX):
        return "fp16"
    return "fp32"


def _encode(state: Mapping[str, torch.Tensor], mode: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Stored tensors and the manifest (state-dict name -> codec) for ``state``."""
    settings = _int8_settings() if mode == "int8" else None
    stored: dict[str, torch.Tensor] = {}
    manifest: dict[str, str] = {}
    for name, tensor in state.items():
        if name.endswith(_SCALE_SUFFIX):
            raise LayerCacheError(f"state-dict key {name!r} ends with the cache's reserved suffix {_SCALE_SUFFIX!r}")
        tensor = tensor.detach().cpu()
        manifest[name] = codec = _codec(tensor, mode)
        if codec == "int8":
            stored[name], stored[name + _SCALE_SUFFIX] = _quantize(tensor, settings["per_channel"], settings["qmax"])
        elif codec == "raw":
            stored[name] = tensor.clone().contiguous()
        else:
            # copy=True: tensors sharing storage (tied weights) cannot be saved by safetensors.
            dtype = torch.float16 if codec == "fp16" else torch.float32
            stored[name] = tensor.to(dtype, copy=True).contiguous()
    return stored, manifest


def _decode(stored: Mapping[str, torch.Tensor], manifest: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """The fp32 state dict an entry encodes (integer and bool tensors as stored)."""
    state = {}
    for name, codec in manifest.items():
        tensor = stored[name]
        if codec == "int8":
            scale = stored[name + _SCALE_SUFFIX]
            state[name] = tensor.float() * scale.reshape(-1, *([1] * (tensor.dim() - 1)))
        elif codec == "raw":
            state[name] = tensor
        else:
            state[name] = tensor.float()
    return state


# --------------------------------------------------------------------------- files


def _read_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors byte string (8-byte length, then a JSON header)."""
    (length,) = struct.unpack("<Q", data[:8])
    if length > len(data) - 8:
        raise ValueError(f"header claims {length} bytes, the file has {len(data) - 8}")
    return json.loads(data[8 : 8 + length])["__metadata__"]


# --------------------------------------------------------------------------- the cache


def _budget_bytes(max_cache_size_gb: float) -> float:
    try:
        size = float(max_cache_size_gb)
    except (TypeError, ValueError):
        raise LayerCacheError(f"max_cache_size_gb must be a number, got {max_cache_size_gb!r}") from None
    if math.isnan(size) or size < 0:
        raise LayerCacheError(f"max_cache_size_gb must be >= 0, got {max_cache_size_gb!r}")
    return size * _GIB


def _check_key(model_id: str, layer_index: int, source_hash: str | None) -> None:
    if not isinstance(model_id, str) or not model_id:
        raise LayerCacheError(f"model_id must be a non-empty string, got {model_id!r}")
    if isinstance(layer_index, bool) or not isinstance(layer_index, int):
        raise LayerCacheError(f"layer_index must be an int, got {layer_index!r}")
    if layer_index < 0:
        raise LayerIndexError(f"layer_index must be >= 0, got {layer_index}")
    if source_hash is not None and not isinstance(source_hash, str):
        raise LayerCacheError(f"source_hash must be a string (see tensor_digest) or None, got {source_hash!r}")


def _check_mode(mode: str | None, allow_none: bool = False) -> None:
    if mode is None and allow_none:
        return
    if mode not in QUANTIZATION_MODES:
        raise LayerCacheError(
            f"unknown quantization_mode {mode!r}; valid modes: {', '.join(map(repr, QUANTIZATION_MODES))}"
        )


def _skeleton(layer: nn.Module) -> nn.Module:
    """A weightless copy of ``layer``: its tensors on the meta device, everything else copied.

    Buffers the state dict does not carry (rotary tables, ...) are copied for
    real because the cache cannot restore them.
    """
    memo = {}
    for tensor in layer.state_dict(keep_vars=True).values():
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    return copy.deepcopy(layer, memo)


class LayerCache:
    """Quantized, size-bounded, crash-safe on-disk cache of encoder layers.

    ``cache_dir`` defaults to ``$NEXUS_SLI_CACHE_DIR`` when set, else
    ``$XDG_CACHE_HOME/nexus-sli/layers`` (``~/.cache`` without it).  ``max_cache_size_gb`` (GiB, floats welcome) bounds the total
    size of the entries; the least recently used go first.
    """

    def __init__(self, cache_dir: str | os.PathLike | None = None, max_cache_size_gb: float = 10.0):
        self.max_bytes = _budget_bytes(max_cache_size_gb)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        #: (model_id, layer_index, source_hash) -> weightless layer copy, for get_layer without a factory
        self._skeletons: dict[tuple[str, int, str | None], nn.Module] = {}
        self._remove_dead_temps()

    # ----------------------------------------------------------------- public API

    def cache_layer(
        self,
        model_id: str,
        layer_index: int,
        layer: nn.Module,
        quantization_mode: str = "int8",
        source_hash: str | None = None,
    ) -> Path | None:
        """Store ``layer``'s state dict under ``(model_id, layer_index, source_hash)``.

        Replaces any entry of the same key (whatever its mode).  Pass
        ``source_hash=tensor_digest(checkpoint_tensors)`` so that a changed
        checkpoint misses; with None the caller vouches the weights never
        change.  Returns the entry's path, or None when the encoded layer alone
        exceeds the size bound (it is then not stored, and a warning is logged).
        """
        _check_key(model_id, layer_index, source_hash)
        _check_mode(quantization_mode)
        if not isinstance(layer, nn.Module):
            raise LayerCacheError(f"layer must be a torch.nn.Module, got {type(layer).__name__}")
        data = self._serialize(model_id, layer_index, layer, quantization_mode, source_hash)
        path = self.entry_path(model_id, layer_index, source_hash)
        if len(data) > self.max_bytes:
            log.warning("layer %s[%d] (%d bytes as %s) exceeds the cache bound of %d bytes; not cached",
                        model_id, layer_index, len(data), quantization_mode, self.max_bytes)
            # the entry it was to replace goes too: a later get_layer must miss, not return the older layer
            path.unlink(missing_ok=True)
            self._skeletons.pop((model_id, layer_index, source_hash), None)
            return None
        cache_files.make_room(self.cache_dir, _ENTRY_SUFFIX, len(data), self.max_bytes, path, _WHAT)
        cache_files.write_atomic(path, lambda handle: handle.write(data))
        _touch(path)
        self._skeletons[(model_id, layer_index, source_hash)] = _skeleton(layer)
        return path

    def get_layer(
        self,
        model_id: str,
        layer_index: int,
        factory: Callable[[], nn.Module] | None = None,
        *,
        source_hash: str | None = None,
        quantization_mode: str | None = None,
    ) -> nn.Module | None:
        """The cached layer rebuilt with dequantized fp32 weights (eval mode, CPU), or None on a miss.

        ``factory()`` must return a fresh layer of the cached structure, e.g.
        ``lambda: handler.create_layer(config, idx)``; its weights are replaced
        by the cached ones (strictly: a key mismatch raises LayerCacheError).
        Without a factory the layer is rebuilt from a weightless copy this
        instance kept when it cached that ``(model_id, layer_index)``, which
        serves the ``cache_layer(...)`` then ``get_layer(model_id, idx)``
        pattern within one process.  Otherwise it raises LayerCacheError, hit
        or miss alike (so the outcome does not depend on what is cached): pass
        ``factory`` or use :meth:`get_state_dict`.  ``quantization_mode``, when
        given, makes an entry stored in another mode a miss.
        """
        build = self._resolve_factory(model_id, layer_index, source_hash, factory)
        state = self.get_state_dict(model_id, layer_index, source_hash=source_hash,
                                    quantization_mode=quantization_mode)
        if state is None:
            return None
        layer = build()
        if not isinstance(layer, nn.Module):
            raise LayerCacheError(f"the layer factory returned {type(layer).__name__}, not a torch.nn.Module")
        _load_strictly(layer, state, f"{model_id}[{layer_index}]")
        return layer.eval()

    def get_state_dict(
        self,
        model_id: str,
        layer_index: int,
        *,
        source_hash: str | None = None,
        quantization_mode: str | None = None,
    ) -> dict[str, torch.Tensor] | None:
        """The cached layer's dequantized state dict (floats as fp32), or None on a miss.

        An int8 entry made under int8 settings other than the current
        ``get_int8_config()`` is a miss too.  A hit marks the entry recently used.
        """
        _check_key(model_id, layer_index, source_hash)
        _check_mode(quantization_mode, allow_none=True)
        path = self.entry_path(model_id, layer_index, source_hash)
        loaded = self._load(path, model_id, layer_index, source_hash)
        if loaded is None:
            return None
        metadata, stored = loaded
        if not self._wanted(metadata, quantization_mode):
            return None
        _touch(path)
        return _decode(stored, json.loads(metadata["manifest"]))

    def entry_path(self, model_id: str, layer_index: int, source_hash: str | None = None) -> Path:
        """Where the entry of this key lives (whether or not it exists)."""
        key = json.dumps([model_id, layer_index, source_hash]).encode()
        # A readable prefix for people looking at the directory; the hash makes it unique.
        readable = re.sub(r"[^A-Za-z0-9_-]+", "_", model_id)[-48:]
        return self.cache_dir / f"{readable}-L{layer_index}-{hashlib.sha256(key).hexdigest()[:32]}{_ENTRY_SUFFIX}"

    def size_bytes(self) -> int:
        """Total bytes of the entries now in the cache directory."""
        return sum(size for _, _, size in self._entries())

    def clear(self) -> None:
        """Delete every entry (and any temporary file a dead writer left)."""
        for _, path, _ in self._entries():
            _unlink(path)
        self._remove_dead_temps()

    # ----------------------------------------------------------------- internals

    def _serialize(self, model_id, layer_index, layer, mode, source_hash) -> bytes:
        stored, manifest = _encode(layer.state_dict(), mode)
        metadata = {
            "format": _FORMAT,
            "model_id": model_id,
            "layer_index": str(layer_index),
            "source_hash": source_hash or "",
            "quantization_mode": mode,
            "int8": json.dumps(_int8_settings()) if mode == "int8" else "",
            "manifest": json.dumps(manifest),
        }
        metadata["checksum"] = _checksum(stored, metadata)
        return save_safetensors(stored, metadata=metadata)

    def _load(self, path: Path, model_id: str, layer_index: int, source_hash: str | None):
        """(metadata, stored tensors) of a sound entry for this key; None if absent or damaged."""
        try:
            data = path.read_bytes()  # one read: a concurrent replace or unlink cannot tear it
        except FileNotFoundError:
            return None
        except OSError as exc:  # another user's entry, a failing disk: the checkpoint still has the layer
            log.warning("layer cache entry %s cannot be read (%s); a miss", path.name, exc)
            return None
        try:
            metadata = _read_metadata(data)
            stored = load_safetensors(data)
            problem = _entry_problem(metadata, stored, model_id, layer_index, source_hash)
        # safetensors and the header parse raise their own types for damaged bytes
        except Exception as exc:  # noqa: BLE001
            problem = f"unreadable ({type(exc).__name__}: {exc})"
        if problem:
            log.warning("layer cache entry %s is damaged: %s; deleting it", path.name, problem)
            cache_files.discard(path, _WHAT)
            return None
        return metadata, stored

    def _wanted(self, metadata: dict[str, str], quantization_mode: str | None) -> bool:
        mode = metadata["quantization_mode"]
        if quantization_mode is not None and mode != quantization_mode:
            log.debug("layer cache entry is %s, %s was asked for: miss", mode, quantization_mode)
            return False
        if mode == "int8" and json.loads(metadata["int8"]) != _int8_settings():
            log.info("layer cache entry was quantized with other int8 settings (%s): miss", metadata["int8"])
            return False
        return True

    def _resolve_factory(self, model_id, layer_index, source_hash, factory):
        if factory is not None:
            if not callable(factory):
                raise LayerCacheError(f"factory must be callable, got {type(factory).__name__}")
            return factory
        skeleton = self._skeletons.get((model_id, layer_index, source_hash))
        if skeleton is None:
            raise LayerCacheError(
                f"cannot rebuild layer {layer_index} of {model_id!r} without a factory: pass "
                "factory=lambda: handler.create_layer(config, idx), or use get_state_dict()"
            )
        return lambda: copy.deepcopy(skeleton)

    def _entries(self) -> list[tuple[int, Path, int]]:
        """(last use in ns, path, bytes) of every entry, least recently used first."""
        return cache_files.entries(self.cache_dir, _ENTRY_SUFFIX)

    def _remove_dead_temps(self) -> None:
        cache_files.remove_dead_temps(self.cache_dir, _ENTRY_SUFFIX, _WHAT)


def _entry_problem(metadata, stored, model_id, layer_index, source_hash) -> str | None:
    """Why an entry that parsed is not a sound entry for this key, or None if it is."""
    if metadata.get("format") != _FORMAT:
        return f"format {metadata.get('format')!r}, expected {_FORMAT!r}"
    found = (metadata["model_id"], metadata["layer_index"], metadata["source_hash"])
    if found != (model_id, str(layer_index), source_hash or ""):
        return f"it holds the key {found}"
    if _checksum(stored, metadata) != metadata["checksum"]:
        return "checksum mismatch"
    manifest = json.loads(metadata["manifest"])
    needed = [n + _SCALE_SUFFIX if codec == "int8" else n for n, codec in manifest.items()]
    missing = [n for n in list(manifest) + needed if n not in stored]
    return f"manifest names absent tensors {missing[:5]}" if missing else None


def _checksum(stored: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> str:
    """Over names, dtypes, shapes and bytes of the stored tensors and over the other metadata,
    so damage anywhere in an entry that still parses shows."""
    fields = json.dumps({k: v for k, v in sorted(metadata.items()) if k != "checksum"})
    return hashlib.sha256((tensor_digest(stored) + fields).encode()).hexdigest()


def _load_strictly(layer: nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """Put ``state`` into ``layer``; a key or shape mismatch names what differs."""
    expected = layer.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    misshapen = [k for k in set(expected) & set(state) if expected[k].shape != state[k].shape]
    if missing or unexpected or misshapen:
        raise LayerCacheError(
            f"the factory's layer does not fit the cached {where}: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}, wrong shape {sorted(misshapen)[:5]}"
        )
    # assign=True adopts the cached tensors instead of copying them into the
    # factory's freshly initialised ones (and works for a meta-device skeleton).
    layer.load_state_dict(state, strict=True, assign=True)
