"""Starting, stopping and crashing the real Triton server the tests serve from."""

from __future__ import annotations

import os
import signal


def kill_server(server: dict) -> None:
    """A crash: SIGKILL to the server alone (its python-backend processes are ended after it)."""
    orphans = [p for ps in server["process"].supervisor.stub_processes().values() for p in ps]
    os.kill(server["process"].pid, signal.SIGKILL)
    server["process"].wait(30)
    for orphan in orphans:
        orphan.kill()
