"""SIGTERM as a Ctrl-C: a process manager's stop, a CI job's timeout or a deleted Kubernetes Job unwinds a
command through its clean-up (serve's children, publish's lock), where SIGTERM's default action would end it
where it stands."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator


def interrupt_on_sigterm() -> None:
    """From now on, SIGTERM raises KeyboardInterrupt in the main thread, as Ctrl-C does."""
    signal.signal(signal.SIGTERM, _interrupt)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """:func:`interrupt_on_sigterm` for the block, the handler before it put back after; nothing where the
    command runs off the main thread (``main()`` called in a thread), which no signal handler can be set from."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(*_) -> None:
    raise KeyboardInterrupt
