"""sentence-transformers' Dense modules: read from the model's folder, and applied as the reference applies them.

A ``Dense`` module (``sentence_transformers.models.Dense``) is a linear layer,
an activation (a ``torch.nn`` class, named by its dotted path in the module's
``config.json``) and, with ``use_residual``, its input added back (through a
bias-free projection where the sizes differ).  It reads and overwrites one
entry of sentence-transformers' features: ``sentence_embedding`` (after the
pooling, as in LaBSE) or ``token_embeddings`` (the token states, before it).
The export reads them from the folder (:func:`st_folder.read_dense`) and
reproduces them in ``modules.json`` order: in the graph (:mod:`pooling`) and in
numpy here, which validation applies to PyTorch's token states.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nexus_sli.exporter.errors import NexusError

from .export_report import DenseRecord

#: The features a Dense module may read: the pooled vector, or the token states before the pooling.
SENTENCE, TOKENS = "sentence_embedding", "token_embeddings"
#: The activations reproduced, by ``torch.nn`` class name: (the ONNX op, None for none; numpy's function).
ACTIVATIONS: dict[str, tuple[str | None, Callable[[np.ndarray], np.ndarray]]] = {
    "Identity": (None, lambda x: x),
    "Tanh": ("Tanh", np.tanh),
    "ReLU": ("Relu", lambda x: np.maximum(x, 0.0)),
    "Sigmoid": ("Sigmoid", lambda x: 1.0 / (1.0 + np.exp(-x))),
}
#: What sentence-transformers' Dense applies where its config names no activation.
DEFAULT_ACTIVATION = "torch.nn.modules.activation.Tanh"


@dataclass(frozen=True)
class Dense:
    """One Dense module: ``activation(x @ weight.T + bias)``, plus ``x`` (or ``x @ residual.T``) where
    ``use_residual``.  Weights in fp32, as the module keeps them."""

    #: ``[out_features, in_features]``, and the bias ``[out_features]`` (None: the module has none)
    weight: np.ndarray
    bias: np.ndarray | None
    #: the ``torch.nn`` class name, a key of :data:`ACTIVATIONS`
    activation: str
    #: the feature it reads and overwrites: :data:`SENTENCE` or :data:`TOKENS`
    input: str = SENTENCE
    use_residual: bool = False
    #: the residual's projection where ``in_features != out_features`` (None: the input itself)
    residual: np.ndarray | None = None

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """The module on ``x`` (``[..., in_features]``), in float64 then back (the reference's own arithmetic)."""
        wide = x.astype(np.float64)
        out = wide @ self.weight.T.astype(np.float64)
        if self.bias is not None:
            out = out + self.bias
        out = ACTIVATIONS[self.activation][1](out)
        if self.use_residual:
            out = out + (wide if self.residual is None else wide @ self.residual.T.astype(np.float64))
        return out.astype(np.float32)

    def record(self) -> DenseRecord:
        """What validation.json keeps of it (:meth:`from_record` reads it back): weights as nested lists."""
        return DenseRecord(weight=_listed(self.weight), bias=_listed(self.bias), activation=self.activation,
                           input=self.input, use_residual=self.use_residual, residual=_listed(self.residual))

    @classmethod
    def from_record(cls, record: DenseRecord) -> Dense:
        return cls(_array(record.weight), _array(record.bias), record.activation, record.input, record.use_residual,
                   _array(record.residual))


def _listed(array: np.ndarray | None) -> list | None:
    return None if array is None else array.tolist()


def _array(values: list | None) -> np.ndarray | None:
    return None if values is None else np.asarray(values, np.float32)


def activation_name(dotted: str, where: Path) -> str:
    """The class name of the ``torch.nn`` activation named by its dotted path (``torch.nn.Tanh``,
    ``torch.nn.modules.activation.Tanh``), where the export reproduces it.  Only paths inside ``torch.nn``
    are imported: a config names no code of its own to run."""
    import importlib

    import torch

    module, _, name = dotted.rpartition(".")
    found = None
    if module == "torch.nn" or module.startswith("torch.nn."):
        try:
            found = getattr(importlib.import_module(module), name, None)
        except ImportError:
            found = None
    if not (isinstance(found, type) and issubclass(found, torch.nn.Module)):
        raise NexusError(f"{where}: activation_function {dotted!r} is not a torch.nn module class; the export "
                         "resolves only torch.nn activations")
    if found.__name__ not in ACTIVATIONS:
        raise NexusError(f"{where}: activation_function {dotted!r} is not reproduced by the export; "
                         f"known: {', '.join('torch.nn.' + n for n in ACTIVATIONS)}")
    return found.__name__


def chained_size(modules: list[Dense], hidden_size: int, where: Path) -> int:
    """The size of the vectors after ``modules`` (in order) from the encoder's ``hidden_size``; an error
    where one module does not take what the one before gives."""
    size = hidden_size
    for module in modules:
        if module.in_features != size:
            raise NexusError(f"{where}: a Dense module takes {module.in_features} values where the pipeline "
                             f"gives it {size}")
        size = module.out_features
    return size
