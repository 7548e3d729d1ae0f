"""``tritonserver``'s flags: the one source for ``nexus-sli serve`` and the Kubernetes Deployment.

Reloading a model whose python-backend process died needs Triton's
model-repository API, so a supervised server runs in explicit model-control
mode with that API (and the shared-memory, trace and logging APIs, which our
clients never use) restricted to requests carrying a header whose value is a
random secret known only to the process that started it, never printed or
logged: for users, model control stays off.
"""

from __future__ import annotations

#: Header that the restricted APIs require (HTTP, and gRPC as
#: ``triton-grpc-protocol-<name>``); its value is random per server start.
ADMIN_HEADER = "nexus-sli-admin"
#: Triton APIs that need the header: model control (only the supervisor reloads
#: models), and what the client never uses but could harm a server (shared-memory
#: registration, trace and log settings).
RESTRICTED_APIS = ("model-repository", "shared-memory", "trace", "logging")
#: How long a stopping server waits for in-flight requests and open connections (Triton's default: 30 s).
EXIT_TIMEOUT_S = 5
#: Prefixes of the object stores Triton reads a repository from itself (it copies
#: each model to a local temporary folder when loading it).
REMOTE_PREFIXES = ("s3://", "gs://", "as://")


def is_remote(repository) -> bool:
    """Whether ``repository`` names an object store (``s3://HOST:PORT/bucket/prefix``, ...), not a folder."""
    return str(repository).startswith(REMOTE_PREFIXES)


def _access(admin_key: str | None, reload_models: bool) -> list[str]:
    """Model control off (or explicit, for reloading), and the APIs our clients never use
    usable only with the secret header (none restricted without an ``admin_key``)."""
    if reload_models and admin_key is None:
        raise ValueError("reloading models needs an admin key: the repository API would be open to anyone")
    mode = ["--model-control-mode=explicit", "--load-model=*"] if reload_models else ["--model-control-mode=none"]
    if admin_key is None:
        return mode
    restricted = f"{','.join(RESTRICTED_APIS)}:{ADMIN_HEADER}={admin_key}"
    return [*mode, f"--http-restricted-api={restricted}", f"--grpc-restricted-protocol={restricted}"]


def server_args(repository, http_port: int, grpc_port: int, metrics_port: int, host: str = "127.0.0.1",
                admin_key: str | None = None, reload_models: bool = False) -> list[str]:
    """tritonserver's flags, the one source for ``nexus-sli serve`` and the Kubernetes
    Deployment (deploy/k8s, where ``admin_key`` is ``$(NEXUS_SLI_ADMIN_KEY)``, a Secret's value)."""
    return [f"--model-repository={repository}", f"--http-port={http_port}", f"--grpc-port={grpc_port}",
            f"--metrics-port={metrics_port}", f"--http-address={host}", f"--grpc-address={host}",
            f"--metrics-address={host}", "--allow-sagemaker=false", "--allow-vertex-ai=false",
            *_access(admin_key, reload_models), "--exit-on-error=true", "--log-verbose=0",
            # A model whose worker was killed never finishes unloading, and an idle
            # HTTP keep-alive connection holds the server open: stopping waits this long.
            f"--exit-timeout-secs={EXIT_TIMEOUT_S}"]
