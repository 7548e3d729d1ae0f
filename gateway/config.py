"""The gateway's settings: where Triton is, where to listen, and the request limits."""

from __future__ import annotations

from dataclasses import dataclass

#: Environment variable read for the API key when ``--api-key`` is not given.
API_KEY_ENV = "NEXUS_SLI_API_KEY"
#: Inference requests one gateway admits at once by default: about where single-text throughput stops
#: growing with concurrency on a CPU, while an admitted batch's wait stays well under a client's
#: timeout (bench/data/tried.md, "The gateway's concurrency limit").
MAX_CONCURRENT_REQUESTS = 32


@dataclass(frozen=True)
class GatewayConfig:
    """Every setting of one gateway.  The defaults bind loopback only and take what
    OpenAI's own API takes (2048 inputs per request)."""

    #: Triton's gRPC address, or ``dns:///NAME:PORT`` for every address of a name (a headless Service)
    triton: str = "127.0.0.1:8001"
    host: str = "127.0.0.1"
    port: int = 8080
    #: the model TEI's routes use when a request names none and it serves the route's task
    #: (TEI serves one model; without this, the one model of that task, else a 400 asking for one)
    tei_model: str | None = None
    #: when set, every route but ``/health`` needs ``Authorization: Bearer <api_key>``
    api_key: str | None = None
    #: texts per request (OpenAI's limit is 2048; LangChain sends up to 1000 at once)
    max_inputs: int = 2048
    #: characters per text; the model truncates to its token limit anyway, this bounds the work
    max_input_chars: int = 100_000
    #: bytes of one request body
    max_body_bytes: int = 16 * 1024 * 1024
    #: vectors one ``/embed_all`` or ``/embed_multi_vector`` answer may hold, each text counted at its model's
    #: ``max_length``: every value of such an answer costs the gateway memory and time on its event loop
    #: (bench/data/tried.md), and 2048 texts of 256 tokens would cost gigabytes.  TEI's ``--max-batch-tokens``
    #: default, and what its defaults let one request ask (32 texts of 512 tokens).
    max_token_vectors: int = 16384
    #: how long the list of served models is trusted before it is read again
    discovery_ttl_s: float = 10.0
    #: the ``Retry-After`` seconds sent with a 503, and with a 429 for Triton's full queue
    retry_after_s: int = 5
    #: inference requests in flight at once (TEI's ``--max-concurrent-requests``); past it a request
    #: is refused at once with a 429 (:mod:`.admission`); 0: no bound.  Sized in docs/gateway.md.
    max_concurrent_requests: int = MAX_CONCURRENT_REQUESTS
    #: seconds any call to Triton may take (inference, discovery, readiness); past it the answer
    #: is a 503, as for a Triton that is down.  A batch of 2048 texts on a CPU takes tens of seconds.
    triton_timeout_s: float = 60.0
    #: how long one request keeps retrying Triton's retryable failures (a worker restarting, a model
    #: reloading, a replica gone) before its answer is a 503: a short fault costs latency, not an error
    triton_retry_s: float = 5.0

    def __post_init__(self):
        check_triton(self.triton)
        limit = self.max_concurrent_requests
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"max_concurrent_requests must be an integer >= 0 (0: no bound), got {limit!r}")
        if not self.triton_timeout_s > 0:
            raise ValueError(f"triton_timeout_s must be positive, got {self.triton_timeout_s!r}")
        if not self.triton_retry_s >= 0:
            raise ValueError(f"triton_retry_s must be >= 0, got {self.triton_retry_s!r}")


def check_triton(address: str) -> str:
    """``address`` if it is one Triton gRPC address, or ``dns:///NAME:PORT``: every address of
    ``NAME`` (a Kubernetes headless Service), requests spread over them (docs/deployment.md)."""
    if "," in address:
        raise ValueError(f"--triton takes one Triton gRPC address, got {address!r}; for several replicas give "
                         "one name that resolves to all of them, dns:///NAME:PORT (docs/gateway.md)")
    if not address.strip():
        raise ValueError("--triton is empty: give Triton's gRPC address, HOST:PORT")
    return address
