"""One exception hierarchy for the exporter.

Every error a user can trigger (bad model id, unsupported family, checkpoint
that does not match its config, an export that fails validation) is a
subclass of :class:`NexusError`, so the CLI can print it as one clear line
and exit non-zero, while programming errors still surface as tracebacks.
"""


class NexusError(Exception):
    """Base class of every error nexus-sli raises on purpose."""


class UnsupportedModelError(NexusError, ValueError):
    """The config names a model type or architecture no family handles."""


class LayerIndexError(NexusError, IndexError):
    """A layer index outside ``[0, num_layers)``."""


class LayerTypeError(NexusError, ValueError):
    """A layer type other than ``"encoder"`` asked of an encoder-only family."""


class NotYetImplementedError(NexusError, NotImplementedError):
    """A registered family whose layer code has not been written yet."""


class ModelSourceError(NexusError):
    """The model could not be found: no such directory, hub unreachable, ..."""


class CheckpointError(NexusError):
    """The checkpoint's tensors do not fit the model its config describes."""


class UnsafeCheckpointError(CheckpointError):
    """Only a pickle checkpoint is present and pickle loading was not allowed."""


class LayerCacheError(NexusError, ValueError):
    """A bad argument to the layer cache, or a layer it cannot store or rebuild."""


class ExportError(NexusError):
    """The ONNX export or graph optimisation itself failed."""


class ValidationError(NexusError):
    """The exported graph does not match PyTorch within the thresholds.

    ``failures`` holds every typed failure (:mod:`nexus_sli.exporter.export.report`)
    of the graph closest to passing; ``report`` its validation report as written."""

    def __init__(self, message: str, report: dict | None = None, failures: list | None = None):
        super().__init__(message)
        self.report = report
        self.failures = list(failures or [])


class ExportReportError(NexusError, ValueError):
    """An encoder's ``validation.json`` is missing, not JSON, or lacks what an export report holds
    (:mod:`nexus_sli.exporter.export.export_report`)."""


class RepositoryError(NexusError):
    """The Triton model repository could not be written."""


class GPURuntimeUnavailableError(NexusError):
    """A GPU runtime (TensorRT's Python package, the CUDA runtime) is not available on this machine;
    the message says where to run the command instead."""


class PlanBuildError(NexusError):
    """TensorRT could not parse the exported graph or build an engine from it."""
