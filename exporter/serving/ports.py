"""The ports ``nexus-sli serve`` is asked to listen on, checked before anything starts.

Taken, tritonserver exits with code 1 once it has loaded every model, and uvicorn once Triton is ready: after
the minute or more of a first export, and with the cause in their logs only.  Checked first, serve refuses in
one line naming the port.  A check, not a reservation: a port taken between it and the server's bind still
fails as before.
"""

from __future__ import annotations

import errno
import socket

from .binary import ServerError


def check_free(host: str, ports: dict[str, int]) -> None:
    """A :class:`ServerError` where two of ``ports`` (``{what: port}``, 0 for none) are the same, or where one
    cannot be listened on at ``host`` now (in use, or the address is not this machine's)."""
    given: dict[int, str] = {}
    for what, port in ports.items():
        if port and port in given:
            raise ServerError(f"{given[port]} and {what} are both {port}: each needs a port of its own")
        given.setdefault(port, what)
    for what, port in ports.items():
        problem = _cannot_listen(host, port) if port else None
        if problem:
            raise ServerError(f"cannot listen on {host}:{port} for {what}: {problem}")


def _cannot_listen(host: str, port: int) -> str | None:
    """Why a server could not listen on ``host``:``port`` now, or None.  Every address ``host`` names is tried
    (``localhost``: ::1 and 127.0.0.1), since which one a server binds is its own choice: one in use is refused,
    and so is a host none of whose addresses can be bound."""
    try:
        addresses = {info[:3] + (info[4][:2],) for info in socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)}
    except socket.gaierror as exc:
        return f"{host!r} is not an address of this machine ({exc.strerror})"
    problems = []
    for family, kind, proto, address in sorted(addresses, key=str):
        with socket.socket(family, kind, proto) as probe:
            # as servers bind: a connection closed a moment ago (TIME_WAIT) does not hold the port
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return ("the port is in use (is a server running there already? `ss -ltnp` names the "
                            "process); choose another port, or stop it")
                problems.append(exc.strerror or str(exc))
    return problems[0] if len(problems) == len(addresses) else None
