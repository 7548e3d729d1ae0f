"""Which replica a request goes to, and which next when one fails.

Several server URLs serving the same repository are replicas.  Requests take
turns over the replicas that answered last time (round-robin); a replica whose
request failed with a :class:`~nexus_sli.client.RetryableError` is set aside
for ``down_for_s`` seconds and tried only after the others, so a dead replica
costs one failed attempt, not one per request, and comes back by itself.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence

from . import protocol as p
from .errors import ClientError, RetryableError

#: How long a replica that failed is tried only after the others.
DOWN_FOR_S = 5.0


def parse_urls(url: str | Sequence[str] | None, default: str) -> list[str]:
    """One URL, a comma-separated list, or a sequence of URLs; ``default`` when none."""
    if url is None:
        return [default]
    items = url.split(",") if isinstance(url, str) else list(url)
    urls = list(dict.fromkeys(u.strip() for u in items if u and u.strip()))
    if not urls:
        raise ValueError("no server URL given")
    return urls


class Replicas:
    """Thread-safe choice of replica; ``served`` counts the requests each answered."""

    def __init__(self, urls: Sequence[str], down_for_s: float = DOWN_FOR_S):
        self.urls = list(urls)
        self.down_for_s = down_for_s
        self._next = 0
        self._down_until: dict[str, float] = {}
        self._lock = threading.Lock()
        self.served: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()

    def order(self) -> list[str]:
        """Every replica once, in the order to try for one request: the next in turn first,
        the ones set aside last (soonest back first)."""
        with self._lock:
            start, self._next = self._next, (self._next + 1) % len(self.urls)
            now = time.monotonic()
            turn = self.urls[start:] + self.urls[:start]
            up = [u for u in turn if self._down_until.get(u, 0.0) <= now]
            down = sorted((u for u in turn if u not in up), key=lambda u: self._down_until[u])
            return up + down

    def succeeded(self, url: str) -> None:
        with self._lock:
            self.served[url] += 1
            self._down_until.pop(url, None)

    def failed_on(self, url: str) -> None:
        with self._lock:
            self.failed[url] += 1
            self._down_until[url] = time.monotonic() + self.down_for_s


def attempts_for(attempts: int | None, urls: Sequence[str]) -> int:
    """How many replicas one request may try: ``attempts`` (at most one try per replica),
    or every replica when None.  ``attempts`` below 1 is a ValueError, not "all"."""
    if attempts is None:
        return len(urls)
    if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
        raise ValueError(f"attempts must be a positive integer (or None: every replica once), got {attempts!r}")
    return min(attempts, len(urls))


def retryable(exc: Exception, model: str, attempts: int, replicas: Replicas, url: str) -> RetryableError:
    """The failure of one attempt on ``url``: the client's error when the request may be tried
    again on another replica, raised at once otherwise (a non-retryable error, or only one
    attempt allowed, so that ``attempts=1`` and a single URL both raise the error itself).
    A retryable failure sets the replica aside either way."""
    error = exc if isinstance(exc, ClientError) else p.translate(exc, model)
    if isinstance(error, RetryableError):
        replicas.failed_on(url)
    if not isinstance(error, RetryableError) or attempts == 1:
        raise error from None
    return error
