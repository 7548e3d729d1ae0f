"""nexus-sli exporter: BERT-family checkpoints to a Triton model repository."""

from .errors import NexusError
from .export.handler import ArchitectureRegistry, BERTFamilyHandler, get_registry

__all__ = ["ArchitectureRegistry", "BERTFamilyHandler", "NexusError", "get_registry"]
