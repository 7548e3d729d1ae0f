"""Runtime targets: one registered module per runtime that can serve the encoder."""

from nexus_sli.exporter.triton.config import EncoderServing

from .base import Candidate, ExportedGraph, Target
from .registry import (
    AUTO,
    AUTO_CONFIGURATIONS,
    DEVICES,
    TARGETS,
    Configuration,
    configurations_for,
    get_target,
    precisions,
    register,
    serving_target,
)

__all__ = ["AUTO", "AUTO_CONFIGURATIONS", "DEVICES", "TARGETS", "Candidate", "Configuration", "EncoderServing", "ExportedGraph",
           "Target", "configurations_for", "get_target", "precisions", "register", "serving_target"]
