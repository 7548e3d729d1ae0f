"""SIGTERM as a Ctrl-C: a process manager's stop, a CI job's timeout or a deleted Kubernetes Job unwinds a
command through its clean-up (serve's children, publish's lock), where SIGTERM's default action would end it
where it stands."""

from __future__ import annotations

import signal


def interrupt_on_sigterm() -> None:
    """From now on, SIGTERM raises KeyboardInterrupt in the main thread, as Ctrl-C does."""
    signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(*_) -> None:
    raise KeyboardInterrupt
