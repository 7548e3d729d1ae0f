"""Waiting on a condition, never for a fixed time: a test goes on the moment what it waits for holds."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")

#: how often a condition is checked again
POLL_S = 0.05


def wait_until(condition: Callable[[], T], what: str, timeout: float = 60.0, poll_s: float = POLL_S) -> T:
    """``condition()``'s first truthy value, checked every ``poll_s``; fails naming ``what`` after ``timeout``
    seconds (a bound on the test, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(poll_s)
