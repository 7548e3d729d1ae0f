"""Encoder families, keyed by model type.  Importing this package registers all of them."""

from . import native, remote_code  # noqa: F401  (registration side effect)
from .base import FAMILIES, EncoderFamily, config_value, family_for, normalize_model_type, supported_types

__all__ = ["FAMILIES", "EncoderFamily", "config_value", "family_for", "normalize_model_type", "supported_types"]
