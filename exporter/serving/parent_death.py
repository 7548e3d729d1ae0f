"""Children that do not outlive the process that started them, even one killed by SIGKILL.

A process killed outright runs no clean-up, so what it started (tritonserver, the gateway, an export) would
run on, holding its ports, its memory and the CPU, and the next ``nexus-sli serve`` on those ports would meet
"another server answers".  Linux's ``PR_SET_PDEATHSIG`` has the kernel signal the child when its parent goes;
the child then stops as it stops on that signal from a user: tritonserver and the gateway cleanly on SIGTERM,
an export on SIGINT, removing its staging folder as on a Ctrl-C.

The kernel sends the signal when the *thread* that started the child ends, not only the process: these
children are started from threads that outlive them (serve's main thread, the keeper's watcher, the search's
thread).  A library caller of :func:`server.start` may start servers from short-lived threads (a pool's), so
:func:`server.start` does not arm it by itself; ``serve_forever`` asks for it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Callable

#: ``<sys/prctl.h>``'s option number
_PR_SET_PDEATHSIG = 1


def dies_with_parent(signum: int = signal.SIGTERM, then: Callable[[], object] | None = None) -> Callable[[], None]:
    """A ``preexec_fn`` for :class:`subprocess.Popen`: ``signum`` to the child when this process (the thread
    starting it) dies; then ``then()``, in the child too.  Outside Linux, only ``then()``."""
    # resolved here, in the parent: the child runs as little as it can between fork and exec
    prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
    parent = os.getpid()

    def arm() -> None:
        if prctl is not None and prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0 and os.getppid() != parent:
            os.kill(os.getpid(), signum)  # the parent died before the signal was armed: nobody would send it now
        if then is not None:
            then()

    return arm
