"""The client's exceptions: one hierarchy, messages that say what to do."""


class ClientError(Exception):
    """Base class of every error the nexus-sli client raises."""


class RetryableError(ClientError):
    """The request may succeed if sent again later, with the same client object."""


class ServerUnavailableError(RetryableError, ConnectionError):
    """The server could not be reached. Retryable: the same client works once it is back."""


class DeadlineExceededError(ServerUnavailableError):
    """The call's own deadline (the client's ``timeout_s``) passed before the server answered: the
    server is up but slow or overloaded, or hangs.  Also raised when a step's queue dropped the request
    because that deadline passed (the client sends it as Triton's per-request queue timeout).

    Never sent again by the client, to any replica: the first copy may still be queued or running,
    and a second would only lengthen an overloaded server's queue.  A :class:`ServerUnavailableError`,
    so that handlers of an outage (and the gateway's 503) still catch it; a caller that tells the two
    apart may retry later, with a longer ``timeout_s`` or fewer calls at once."""


class ServerBusyError(RetryableError):
    """The server refused the request because its queue was full, or dropped it from its queue when
    the queue's timeout passed (the model's queue policy): the request was not run.  Retryable, best
    after a pause: the server is overloaded, not down."""


class ModelUnavailableError(RetryableError):
    """The model exists but cannot serve right now: one of its workers died and is
    being restarted, or it is being loaded again. Retryable."""


class ReplicasFailedError(RetryableError):
    """Every replica given to the client failed the request with a retryable error.

    ``attempts`` holds (url, error) for each try, in order; the message lists them."""

    def __init__(self, attempts: list[tuple[str, "RetryableError"]]):
        self.attempts = list(attempts)
        tried = "; ".join(f"{url}: {type(error).__name__}: {error}" for url, error in self.attempts)
        super().__init__(f"all {len(self.attempts)} attempts failed on the replicas; retry later. Attempts: {tried}")


class ModelNotFoundError(ClientError):
    """The server has no model of that name."""


class NoModelError(ClientError, ValueError):
    """A call named no model, and the client has no default model."""


class WrongTaskError(ClientError):
    """The model serves another task than the method called."""


class InvalidInputError(ClientError, ValueError):
    """An input item is unusable; the message names the item and why."""


class InferenceError(ClientError):
    """The server failed the request; its message is attached."""


class UnknownPromptError(InvalidInputError):
    """A ``prompt_name`` the model does not have; ``known`` lists the ones it has."""

    def __init__(self, prompt_name, model: str, known: list[str]):
        self.prompt_name, self.model, self.known = prompt_name, model, list(known)
        listed = ", ".join(repr(n) for n in self.known) or "none (this model has no prompts)"
        super().__init__(f"unknown prompt_name {prompt_name!r} for model {model!r}; its prompts: {listed}")


class UnknownInputTypeError(InvalidInputError):
    """An ``input_type`` a late-interaction model does not read; ``known`` lists the ones it does."""

    def __init__(self, input_type, model: str, known: list[str]):
        self.input_type, self.model, self.known = input_type, model, list(known)
        super().__init__(f"unknown input_type {input_type!r} for model {model!r}; it reads "
                         f"{', '.join(repr(k) for k in self.known)}")


class DimensionsError(InvalidInputError):
    """A ``dimensions`` that is not an integer from 1 to the model's ``size``; ``trained`` lists the
    sizes the model was trained for (Matryoshka), where its card names them."""

    def __init__(self, dimensions, size: int, model: str, trained: list[int]):
        self.dimensions, self.size, self.model, self.trained = dimensions, size, model, list(trained)
        super().__init__(f"dimensions must be an integer from 1 to the model's {size}, got {dimensions!r}")
