"""nexus-sli exporter: BERT-family checkpoints to a Triton model repository.

The names of the encoder-support spec are importable from here; each lives in
the module of the step it belongs to.  Those modules need torch, so the names
load on first use (a module ``__getattr__``): ``import nexus_sli.exporter``, or
a light part of it (``nexus_sli.exporter.errors``, the server launcher), imports
neither torch nor transformers nor onnx.
"""

from importlib import import_module

from .errors import NexusError

#: public name -> the module that defines it
_HOMES = {
    "ArchitectureRegistry": ".export.handler",
    "BERTFamilyHandler": ".export.handler",
    "get_registry": ".export.handler",
    "LayerCache": ".export.layer_cache",
    "get_int8_config": ".export.quantize",
}

__all__ = ["NexusError", *_HOMES]


def __getattr__(name: str):
    """Import a spec name's home module on first use (PEP 562); later lookups find it cached here."""
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_HOMES[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    # the lazy names are not in globals() until used; list them so completion and help() see them
    return sorted(set(globals()) | set(__all__))
