"""One call's requests sent together: the answers in the call's order, the first request's error raised.

A call larger than the model's ``max_batch_size`` is several requests (chunks).  Sent one after
another, each costs a round trip while the server's other steps wait; sent together, the server
overlaps them (one chunk tokenized while another is encoded), and a step with several instances
runs them at once.  Each request keeps its own retries over the replicas: a failed one is sent
again as it would be alone, the others are not.

The synchronous client sends them from the calling thread and workers beside it: threads for
gRPC (tritonclient's gRPC client may be called from several threads at once), greenlets of the
calling thread for HTTP (tritonclient's HTTP client runs on gevent and is not thread-safe).  Not
through tritonclient's ``async_infer``: the HTTP one sleeps 10 ms after sending each request, and
both would need the retries rewritten around callbacks.  A call of one request starts no worker.

The asynchronous client sends them as tasks, under the same bound and with the same answer: once one
has failed no other starts, and those after it in order still in flight are cancelled (their errors
could not be the one raised), so nothing of a call is sent once it has raised.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor, wait
from typing import Any

#: The most requests of one call in flight at once (the calling thread's own included).  One: on the CPU,
#: sending them at once was no faster with the steps joined and slower with them separate
#: (bench/data/tried.md, "The synchronous client's chunks at once"), and on a GPU, where a call of 256
#: is one request, smaller requests sent at once carried fewer texts under load (docs/gpu.md, "Served on
#: a GPU").  Above one, a bound still: the server runs no more at once than its
#: steps have instances, so more in flight only wait in its queues ahead of other clients' requests
#: (Triton's queues are first come, first served), and one call cannot fill a step's queue by itself.
IN_FLIGHT = 1

Send = Callable[[int], Any]
AsyncSend = Callable[[int], Awaitable[Any]]


class _Requests:
    """A call's requests ``send(0)`` .. ``send(count - 1)``, taken in order by each of its workers.
    Once one has failed, or the calling thread has stopped, no worker takes another: a call that sent
    them one after another would have stopped there too."""

    def __init__(self, count: int, send: Send):
        self._send, self._count, self._taken = send, count, 0
        self._lock = threading.Lock()
        self.answers: list = [None] * count
        self.errors: dict[int, Exception] = {}

    def _take(self) -> int | None:
        with self._lock:
            if self.errors or self._taken >= self._count:
                return None
            self._taken += 1
            return self._taken - 1

    def work(self) -> None:
        """Send requests until none is left to take."""
        while (index := self._take()) is not None:
            try:
                self.answers[index] = self._send(index)
            except Exception as exc:  # noqa: BLE001 - the call raises it, in request order (result())
                with self._lock:
                    self.errors[index] = exc

    def stop(self) -> None:
        """Take no more requests (the calling thread is done, or interrupted)."""
        with self._lock:
            self._taken = self._count

    def result(self) -> list:
        """Every request's answer in order, or the error of the first request in order that failed (the
        one a call sending them one after another would have raised)."""
        if self.errors:
            raise self.errors[min(self.errors)]
        return self.answers


def _workers(count: int) -> int:
    """Workers beside the calling thread: no more than the requests, nor than :data:`IN_FLIGHT` in all."""
    return max(min(count, IN_FLIGHT) - 1, 0)


def in_threads(executor: Executor, count: int, send: Send) -> list:
    """``send(i)`` for every request of a call, from the calling thread and threads of ``executor``."""
    requests = _Requests(count, send)
    helpers = [executor.submit(requests.work) for _ in range(_workers(count))]
    try:
        requests.work()
    finally:
        requests.stop()
    # a helper still queued behind other calls' has nothing left to do: it is cancelled, not waited for
    wait([helper for helper in helpers if not helper.cancel()])
    return requests.result()


def in_greenlets(count: int, send: Send) -> list:
    """``send(i)`` for every request of a call, from the calling thread's greenlet and greenlets beside it
    (each waits for the network without holding the thread)."""
    import gevent

    requests = _Requests(count, send)
    helpers = [gevent.spawn(requests.work) for _ in range(_workers(count))]
    try:
        requests.work()
    finally:
        requests.stop()
    gevent.joinall(helpers)
    return requests.result()


async def in_tasks(count: int, send: AsyncSend) -> list:
    """``await send(i)`` for every request of a call, up to :data:`IN_FLIGHT` at once, taken in order.  A failed
    request starts no other and cancels those after it; the call raises the error of the first request in
    order that failed, once those before it have answered (one of them may fail too)."""
    if count <= 1:  # one request is awaited as it is: no task to start
        return [await send(index) for index in range(count)]
    answers, errors = [None] * count, {}
    running: dict[int, asyncio.Task] = {}
    taken = 0
    try:
        while running or (taken < count and not errors):
            while taken < count and not errors and len(running) < max(IN_FLIGHT, 1):
                running[taken] = asyncio.ensure_future(send(taken))
                taken += 1
            await asyncio.wait(running.values(), return_when=asyncio.FIRST_COMPLETED)
            for index in [i for i, task in running.items() if task.done()]:
                task = running.pop(index)
                if task.exception() is None:
                    answers[index] = task.result()
                else:
                    errors[index] = task.exception()
            if errors:
                await _cancel([running.pop(i) for i in list(running) if i > min(errors)])
    finally:
        await _cancel(list(running.values()))  # the caller was cancelled: so are its requests
    if errors:
        raise errors[min(errors)]
    return answers


async def _cancel(tasks: list[asyncio.Task]) -> None:
    """Cancel ``tasks`` and wait until they have stopped: none is left to send again, nor to retry."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)  # one that finished first: its error is not the call's
