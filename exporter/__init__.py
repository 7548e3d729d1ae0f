"""nexus-sli exporter: BERT-family checkpoints to a Triton model repository.

The names of the encoder-support spec are importable from here; each lives
in the module of the step it belongs to.
"""

from .errors import NexusError
from .export.handler import ArchitectureRegistry, BERTFamilyHandler, get_registry
from .export.layer_cache import LayerCache
from .export.quantize import get_int8_config

__all__ = ["ArchitectureRegistry", "BERTFamilyHandler", "LayerCache", "NexusError", "get_int8_config",
           "get_registry"]
