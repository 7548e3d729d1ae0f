"""The client's exceptions: one hierarchy, messages that say what to do."""


class ClientError(Exception):
    """Base class of every error the nexus-sli client raises."""


class ServerUnavailableError(ClientError, ConnectionError):
    """The server could not be reached. Retryable: the same client works once it is back."""


class ModelNotFoundError(ClientError):
    """The model is not in the repository, or not ready yet."""


class WrongTaskError(ClientError):
    """The model serves another task than the method called."""


class InvalidInputError(ClientError, ValueError):
    """An input item is unusable; the message names the item and why."""


class InferenceError(ClientError):
    """The server failed the request; its message is attached."""
