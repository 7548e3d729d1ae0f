"""nexus-sli client: typed calls to nexus-sli models served by Triton (gRPC or HTTP)."""

from .async_client import AsyncEncoderClient
from .client import EncoderClient
from .errors import (
    ClientError,
    DeadlineExceededError,
    InferenceError,
    InvalidInputError,
    ModelNotFoundError,
    ModelUnavailableError,
    NoModelError,
    ReplicasFailedError,
    RetryableError,
    ServerBusyError,
    ServerUnavailableError,
    WrongTaskError,
)
from .results import Answer, Entity, Label, M3Embedding, Ranked, SparseEmbedding

__all__ = ["AsyncEncoderClient", "EncoderClient", "ClientError", "DeadlineExceededError", "InferenceError",
           "InvalidInputError", "ModelNotFoundError", "ModelUnavailableError", "NoModelError", "ReplicasFailedError",
           "RetryableError", "ServerBusyError", "ServerUnavailableError", "WrongTaskError",
           "Answer", "Entity", "Label", "M3Embedding", "Ranked", "SparseEmbedding"]
