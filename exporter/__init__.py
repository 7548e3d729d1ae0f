"""nexus-sli exporter: BERT-family checkpoints to a Triton model repository.

The names of the encoder-support spec are importable from here; each lives in
the module of the step it belongs to.  They load on first use, so importing a
light part of the package (``nexus_sli.exporter.errors``, the server launcher)
does not import torch.
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
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_HOMES[name], __name__), name)
