"""Waiting on a condition, never for a fixed time: a test goes on the moment what it waits for holds."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")

#: how often a condition is checked again
POLL_S = 0.05


def wait_until(condition: Callable[[], T], what: str, timeout: float = 60.0, poll_s: float = POLL_S) -> T:
    """``condition()``'s first value that says it holds (:func:`holds`), checked every ``poll_s``; fails
    naming ``what`` after ``timeout`` seconds (a bound on the test, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if holds(value):
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(poll_s)


def holds(value) -> bool:
    """Whether ``value`` says the condition holds: None, False and an empty collection say "not yet";
    anything else (0, an exit code or an array included) is an answer."""
    if value is None or value is False:
        return False
    try:
        return len(value) > 0
    except TypeError:  # no length: a number, a 0-d array
        return True


def wait_for_line(process, log, line: str, timeout: float = 120.0) -> str:
    """``log``'s text once it holds ``line``, written by ``process`` (a ``Popen``); fails at once, with the
    log, where the process exits before saying it."""
    def said() -> str | None:
        text = log.read_text()
        if line not in text and process.poll() is not None:
            raise AssertionError(f"exited with {process.returncode} before saying {line!r}:\n{text}")
        return text if line in text else None

    return wait_until(said, f"{line!r} in {log}", timeout)
