"""Which replica a request goes to, and which next when one fails.

Several server URLs serving the same repository are replicas.  Requests take
turns over the replicas that answered last time (round-robin); a replica whose
request failed with a :class:`~nexus_sli.client.RetryableError` is set aside
for ``down_for_s`` seconds and tried only after the others, so a dead replica
costs one failed attempt, not one per request, and comes back by itself.

A call that every replica failed with retryable errors (one replica as well as
several: a worker restarting, a model reloading, a replica gone) is tried
again, with growing pauses, until its retry budget is spent (:class:`Retries`):
a fault then costs the call latency, not a failure.  A call whose own deadline
passed is the exception: it is not sent again (:func:`retryable`), and raises
:class:`~nexus_sli.client.DeadlineExceededError`.  So that a replica that takes no
connection at all (a host gone without refusing, whose packets are dropped) costs
a connect timeout, not the call, a replica not yet seen answering (new, or failed
last) is first asked for a TCP connection (:func:`probe`): where none comes, nothing
was sent, and the next replica is tried.

A URL ``dns:///NAME:PORT`` (gRPC's syntax; a Kubernetes headless Service's
name) stands for every address the name resolves to, each a replica.  The
name is resolved again every ``refresh_s`` seconds, and after a pass that
failed everywhere (at most once a second): pods the autoscaler adds get
requests, and pods that are gone get none, within ``refresh_s`` plus the
DNS answer's time to live (:class:`Resolved`).  gRPC itself re-resolves a name
only when a connection breaks, so a client holding one channel stays on the
pods it first found; here each address has its own connection.
"""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

from . import protocol as p
from .errors import ClientError, DeadlineExceededError, ReplicasFailedError, RetryableError, ServerUnavailableError

#: How long a replica that failed is tried only after the others.
DOWN_FOR_S = 5.0
#: How long one call keeps trying again after retryable failures, by default: several times a
#: python-backend worker's restart or a small model's reload (bench/data/tried.md, "The client's
#: retry budget"), short enough that a server that is gone is reported soon.
RETRY_S = 15.0
#: The pause before the second pass over the replicas, doubled after each pass up to the last.
FIRST_PAUSE_S, MAX_PAUSE_S = 0.05, 1.0


#: How long a replica not yet seen answering has to take a TCP connection before the call moves on: a live
#: server on the same network takes one within milliseconds, and a lost SYN is sent again after a second
#: (Linux's first retransmission timeout), so a slow network still connects.
CONNECT_S = 3.0

#: The URL prefix that stands for every address of a DNS name (gRPC's name syntax).
DNS_PREFIX = "dns:///"
#: How often such a name is resolved again, by default.
REFRESH_S = 10.0
#: The least time between two resolutions a failed pass asks for.
MIN_REFRESH_S = 1.0

#: ``resolve(host, port)`` -> the addresses (IP strings) of ``host``; the default asks the system's resolver.
Resolve = Callable[[str, int], list[str]]


def system_resolve(host: str, port: int) -> list[str]:
    """Every address the system's resolver gives ``host`` (a headless Service: one per ready pod)."""
    found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({info[4][0] for info in found})


def _url(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


class Resolved:
    """The replica URLs behind one ``dns:///HOST:PORT`` name, resolved again when older than ``refresh_s``."""

    def __init__(self, name: str, resolve: Resolve | None = None, refresh_s: float = REFRESH_S):
        host, _, port = name[len(DNS_PREFIX):].rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{name!r} is not {DNS_PREFIX}HOST:PORT")
        if isinstance(refresh_s, bool) or not isinstance(refresh_s, (int, float)) or refresh_s <= 0:
            raise ValueError(f"refresh_s must be a positive number of seconds, got {refresh_s!r}")
        self.name, self.host, self.port = name, host.strip("[]"), int(port)
        self.resolve = resolve or system_resolve
        self.refresh_s = refresh_s
        self.resolved_at = float("-inf")
        self._lock = threading.Lock()

    def urls(self) -> list[str]:
        """The addresses now: a ServerUnavailableError when the name has none (no pod is ready)."""
        try:
            addresses = self.resolve(self.host, self.port)
        except OSError as exc:
            addresses, reason = [], f"{type(exc).__name__}: {exc}"
        else:
            reason = "no addresses"
        self.resolved_at = time.monotonic()
        if not addresses:
            raise ServerUnavailableError(f"{self.name} resolves to no server ({reason}); check that the Service's "
                                         "pods are ready, then retry")
        return [_url(a, self.port) for a in addresses]

    def due(self, failed: bool = False) -> bool:
        """Whether to resolve again: the list is older than ``refresh_s``, or a pass failed everywhere
        and the last resolution is older than :data:`MIN_REFRESH_S`."""
        age = time.monotonic() - self.resolved_at
        return age >= self.refresh_s or (failed and age >= MIN_REFRESH_S)


def parse_urls(url: str | Sequence[str] | None, default: str) -> list[str]:
    """One URL, a comma-separated list, or a sequence of URLs; ``default`` when none."""
    if url is None:
        return [default]
    items = url.split(",") if isinstance(url, str) else list(url)
    urls = list(dict.fromkeys(u.strip() for u in items if u and u.strip()))
    if not urls:
        raise ValueError("no server URL given")
    return urls


def address(url: str) -> tuple[str, int] | None:
    """(host, port) of a ``HOST:PORT`` or ``[IPv6]:PORT`` replica URL; None for any other form (not probed)."""
    host, _, port = url.rpartition(":")
    return (host.strip("[]"), int(port)) if host and port.isdigit() else None


def connect_timeout(timeout_s: float | None) -> float:
    """The probe's bound: :data:`CONNECT_S`, or the call's own deadline where that is shorter."""
    return CONNECT_S if timeout_s is None else min(CONNECT_S, timeout_s)


def _unreachable(url: str, exc: BaseException, timeout: float) -> ServerUnavailableError:
    return ServerUnavailableError(f"Triton server unreachable at {url} (no connection within {timeout:g} s: "
                                  f"{type(exc).__name__}: {exc}), nothing sent; check that it runs and the URL is "
                                  "right, then retry")


def probe(url: str, timeout_s: float | None, create_connection=socket.create_connection) -> None:
    """A :class:`~nexus_sli.client.ServerUnavailableError` where ``url`` takes no TCP connection within
    :func:`connect_timeout`.  The request was never sent, so unlike a passed deadline it goes to the next
    replica.  ``create_connection``: gevent's where the call's other requests are greenlets of this thread."""
    found = address(url)
    if found is None:
        return
    timeout = connect_timeout(timeout_s)
    try:
        create_connection(found, timeout=timeout).close()
    except OSError as exc:  # refused, unreachable, or the timeout (an OSError)
        raise _unreachable(url, exc, timeout) from None


async def probe_async(url: str, timeout_s: float | None) -> None:
    """:func:`probe` on the running event loop."""
    found = address(url)
    if found is None:
        return
    timeout = connect_timeout(timeout_s)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(*found), timeout)
    except (OSError, asyncio.TimeoutError) as exc:  # asyncio's TimeoutError is no OSError before Python 3.11
        raise _unreachable(url, exc, timeout) from None
    writer.close()


class Replicas:
    """Thread-safe choice of replica; ``served`` counts the requests each answered."""

    def __init__(self, urls: Sequence[str], down_for_s: float = DOWN_FOR_S):
        self.urls = list(urls)
        self.down_for_s = down_for_s
        self._next = 0
        self._down_until: dict[str, float] = {}
        #: the replicas whose last request was answered: sent to without a probe
        self._answering: set[str] = set()
        self._lock = threading.Lock()
        self.served: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()

    def order(self) -> list[str]:
        """Every replica once, in the order to try for one request: the next in turn first,
        the ones set aside last (soonest back first)."""
        with self._lock:
            if not self.urls:  # a name that has not resolved yet
                return []
            start, self._next = self._next, (self._next + 1) % len(self.urls)
            now = time.monotonic()
            turn = self.urls[start:] + self.urls[:start]
            up = [u for u in turn if self._down_until.get(u, 0.0) <= now]
            down = sorted((u for u in turn if u not in up), key=lambda u: self._down_until[u])
            return up + down

    def update(self, urls: Sequence[str]) -> tuple[list[str], list[str]]:
        """Serve ``urls`` from now on (a name resolved again); (added, gone).  Counts are kept."""
        with self._lock:
            added = [u for u in urls if u not in self.urls]
            gone = [u for u in self.urls if u not in urls]
            self.urls = list(urls)
            self._next %= len(self.urls)
            for url in gone:
                self._down_until.pop(url, None)
                self._answering.discard(url)
            return added, gone

    def answering(self, url: str) -> bool:
        """Whether ``url``'s last request was answered; a new replica's or a failed one's is probed first."""
        with self._lock:
            return url in self._answering

    def succeeded(self, url: str) -> None:
        with self._lock:
            self.served[url] += 1
            self._down_until.pop(url, None)
            self._answering.add(url)

    def refused(self, url: str) -> None:
        """``url`` answered with an error of the request's own (invalid input, unknown model): it answers."""
        with self._lock:
            self._answering.add(url)

    def failed_on(self, url: str) -> None:
        with self._lock:
            self.failed[url] += 1
            self._down_until[url] = time.monotonic() + self.down_for_s
            self._answering.discard(url)


def attempts_for(attempts: int | None, fleet: Fleet) -> int | None:
    """How many replicas one request may try per pass: ``attempts`` (at most one try per replica),
    or every replica when None (None for a name: its replicas change).  ``attempts`` below 1 is a
    ValueError, not "all"."""
    urls = fleet.replicas.urls
    if attempts is None:
        return None if fleet.resolved else len(urls)
    return attempts if fleet.resolved else min(check_attempts(attempts), len(urls))


def check_attempts(attempts: int | None) -> int | None:
    """``attempts`` if it is None or a positive integer, else a ValueError (checked before any connection)."""
    if attempts is not None and (isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1):
        raise ValueError(f"attempts must be a positive integer (or None: every replica once), got {attempts!r}")
    return attempts


def check_timeout(timeout_s: float | None) -> float | None:
    """``timeout_s`` if it is None (no bound) or a number of seconds > 0, else a ValueError: 0 would refuse every
    connection as too slow, and a negative number fails in tritonclient as a server error would."""
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                  or not timeout_s > 0):
        raise ValueError(f"timeout_s must be a number of seconds > 0 (or None: no bound), got {timeout_s!r}")
    return timeout_s


def retry_budget(retry_s: float, attempts: int | None) -> float:
    """Seconds a call keeps retrying: ``retry_s`` (>= 0), none when the caller allowed one attempt."""
    if isinstance(retry_s, bool) or not isinstance(retry_s, (int, float)) or retry_s < 0:
        raise ValueError(f"retry_s must be a number of seconds >= 0, got {retry_s!r}")
    return 0.0 if attempts == 1 else float(retry_s)


def retryable(exc: Exception, model: str, replicas: Replicas, url: str,
              deadline_passed: bool = False) -> RetryableError:
    """The failure of one attempt on ``url``: the client's error when the request may be tried
    again, raised at once otherwise.  A retryable failure sets the replica aside.  ``deadline_passed``:
    the attempt outlived its deadline (:func:`~nexus_sli.client.protocol.past_deadline`).

    A call whose own deadline passed (:class:`~nexus_sli.client.DeadlineExceededError`) is not sent
    again, to this replica or another, though its error is retryable for the caller: its first copy may
    still wait in an overloaded server's queue, and a second copy would only lengthen that queue.  A
    refusal for a full queue, or a drop at a queue policy's timeout shorter than the call's deadline
    (:class:`~nexus_sli.client.ServerBusyError`), is retried: the server did not keep that request."""
    error = exc if isinstance(exc, ClientError) else p.translate(exc, model, deadline_passed)
    if not isinstance(error, RetryableError):
        replicas.refused(url)
        raise error from None
    replicas.failed_on(url)
    if isinstance(error, DeadlineExceededError):
        raise error from None
    return error


class Retries:
    """One call's passes over the replicas: the first at once, the next after pauses that double
    from :data:`FIRST_PAUSE_S` to :data:`MAX_PAUSE_S` (with jitter, so clients that failed
    together do not come back together), while the call's budget of ``retry_s`` lasts."""

    def __init__(self, retry_s: float):
        self.end = time.monotonic() + retry_s
        self._pause = FIRST_PAUSE_S
        self.passes = 0

    def next_pause(self) -> float | None:
        """Seconds to wait before the next pass (0 before the first); None when the budget is spent."""
        self.passes += 1
        if self.passes == 1:
            return 0.0
        remaining = self.end - time.monotonic()
        if remaining <= 0:
            return None
        pause = min(self._pause * random.uniform(0.5, 1.0), remaining)
        self._pause = min(self._pause * 2, MAX_PAUSE_S)
        return pause


def gave_up(tried: list[tuple[str, RetryableError]]) -> RetryableError:
    """The error of a call whose last pass failed: the error itself where the pass had one try
    (one URL, ``attempts=1``), else :class:`ReplicasFailedError` listing every try of that pass."""
    return tried[0][1] if len(tried) == 1 else ReplicasFailedError(tried)


class Fleet:
    """A client's replicas and one connection (``connect(url)``) to each: the URLs given, or the
    addresses of one ``dns:///HOST:PORT`` name, kept current by :meth:`refresh`.  A connection to an
    address that is gone is kept while a pass that took it (:meth:`turn`) is in flight, and handed back
    for closing by the last such pass's :meth:`done`: a long-lived client under a name whose pods come and
    go would otherwise keep a channel to every address it ever saw."""

    def __init__(self, url: str | Sequence[str] | None, default: str, connect: Callable[[str], object],
                 resolve: Resolve | None = None, refresh_s: float = REFRESH_S):
        urls = parse_urls(url, default)
        names = [u for u in urls if u.startswith(DNS_PREFIX)]
        if names and len(urls) > 1:
            raise ValueError(f"give one {DNS_PREFIX}HOST:PORT name or a list of addresses, not both: {urls}")
        #: the name resolved to the replicas, None for a fixed list
        self.resolved = Resolved(names[0], resolve, refresh_s) if names else None
        self.replicas = Replicas([] if names else urls)
        self._connect = connect
        self.clients = {u: connect(u) for u in self.replicas.urls}
        #: connections to addresses that are gone, by id: kept while a pass holds them
        self._retired: dict[int, object] = {}
        #: how many passes in flight hold each connection, by id
        self._held: Counter = Counter()
        #: why the last resolution found no server (None after one that did)
        self.error: RetryableError | None = None
        #: one resolution at a time
        self._lock = threading.Lock()
        #: the replicas and their connections change together under it (not under the resolution's lock: a
        #: request taking its turn waits for no DNS answer)
        self._swap = threading.Lock()

    def refresh(self, failed: bool = False) -> None:
        """Resolve the name again where due (:meth:`Resolved.due`).  Where it resolves to nothing the
        replicas stay as they were, and :attr:`error` says why."""
        if self.resolved is None or not self.resolved.due(failed):
            return
        with self._lock:
            if not self.resolved.due(failed):  # resolved by another thread meanwhile
                return
            try:
                urls = self.resolved.urls()
            except RetryableError as exc:
                self.error = exc
                return
            self.error = None
            connected = {url: self._connect(url) for url in urls if url not in self.clients}
            with self._swap:
                _, gone = self.replicas.update(urls)
                self.clients.update(connected)
                for url in gone:
                    connection = self.clients.pop(url)
                    self._retired[id(connection)] = connection

    def turn(self, attempts: int | None = None) -> list[tuple[str, object]]:
        """The replicas one pass of a request tries, in order (:meth:`Replicas.order`, the first ``attempts``),
        each with its connection, taken together.  A refresh during the pass may retire some of them: the pass
        keeps their connections rather than looking them up again, and gives them back with :meth:`done`."""
        with self._swap:
            order = [(url, self.clients[url]) for url in self.replicas.order()[:attempts]]
            self._held.update(id(connection) for _, connection in order)
            return order

    def done(self, order: list[tuple[str, object]]) -> list:
        """A pass of :meth:`turn` is over: the retired connections that no pass holds any more (this pass's,
        and any retired while no pass held them), taken out of the fleet for the caller to close: an asyncio
        client's ``close`` is awaited, so the fleet closes nothing itself."""
        with self._swap:
            self._held.subtract(id(connection) for _, connection in order)
            return self._unheld()

    def _unheld(self) -> list:
        """Under ``_swap``: retired connections no pass holds, removed from the fleet."""
        unheld = [key for key in self._retired if self._held[key] <= 0]
        for key in unheld:
            del self._held[key]
        return [self._retired.pop(key) for key in unheld]

    def connections(self) -> list:
        """Every connection still open, for closing with the client."""
        with self._swap:
            return [*self.clients.values(), *self._retired.values()]


def unresolved(fleet: Fleet) -> list[tuple[str, RetryableError]]:
    """The failed "tries" of a pass that had no replica to try: a name that has not resolved to any."""
    name = fleet.resolved.name if fleet.resolved else "?"
    return [(name, fleet.error or ServerUnavailableError(f"{name} has no server to try; retry"))]
