"""How many threads the exporter's runtimes take to validate and time the candidate graphs.

``NEXUS_SLI_EXPORT_THREADS`` (default 0: each runtime's own choice, one per core)
sets ONNX Runtime's intra-op threads and OpenVINO's inference threads.  Set it
where an export shares the cores with other work, several exports or a server:
threads of two processes that each take every core wait on each other, and the
timing then measures the wait.
"""

from __future__ import annotations

import os

from nexus_sli.exporter.errors import NexusError

ENV = "NEXUS_SLI_EXPORT_THREADS"


def export_threads() -> int:
    """The threads asked for in :data:`ENV` (0: the runtime's default)."""
    value = os.environ.get(ENV, "0").strip() or "0"
    if not value.isdigit():
        raise NexusError(f"{ENV} must be a whole number of threads (0: one per core), not {value!r}")
    return int(value)
