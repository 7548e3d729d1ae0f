"""argparse types for the numbers several commands take: a value out of range is refused as the command line is
parsed (exit 2, naming the option), not passed on to fail later in a server, a socket or a builder."""

from __future__ import annotations

import argparse
import math
from urllib.parse import urlsplit

#: the highest TCP port
MAX_PORT = 65535


def _number(kind, value: str, wants: str):
    try:
        number = kind(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes {wants}, got {value!r}") from None
    if isinstance(number, float) and not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"takes {wants}, got {value!r}")
    return number


def _in_range(kind, low, high, wants: str):
    def check(value: str):
        number = _number(kind, value, wants)
        if number < low or (high is not None and number > high):
            raise argparse.ArgumentTypeError(f"takes {wants}, got {value!r}")
        return number
    return check


def port(value: str) -> int:
    """A TCP port to listen on: 1 to 65535 (Triton would bind a larger number modulo 65536, and say the other)."""
    return _in_range(int, 1, MAX_PORT, f"a port from 1 to {MAX_PORT}")(value)


def port_or_0(value: str) -> int:
    """A TCP port, or 0 where 0 turns the listener off."""
    return _in_range(int, 0, MAX_PORT, f"a port from 1 to {MAX_PORT}, or 0 (none)")(value)


def batch_rows(value: str) -> int:
    """``--max-batch-size``: the rows a repository may merge, 1 to what one request of the gateway may carry."""
    from nexus_sli.exporter.triton.config import MAX_ROWS_ASKED

    return _in_range(int, 1, MAX_ROWS_ASKED, f"a number of rows from 1 to {MAX_ROWS_ASKED}")(value)


def positive_int(value: str) -> int:
    return _in_range(int, 1, None, "an integer >= 1")(value)


def int_at_least_0(value: str) -> int:
    """An integer >= 0, where 0 means no bound."""
    return _in_range(int, 0, None, "an integer >= 0 (0: no bound)")(value)


def _above_0(value: str, wants: str) -> float:
    number = _number(float, value, wants)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"takes {wants}, got {value!r}")
    return number


def positive_seconds(value: str) -> float:
    return _above_0(value, "a number of seconds > 0")


def seconds_at_least_0(value: str) -> float:
    return _in_range(float, 0, None, "a number of seconds >= 0")(value)


def positive_number(value: str) -> float:
    return _above_0(value, "a number > 0")


def http_url(value: str) -> str:
    """An http(s):// URL with a host (an S3 endpoint); anything else fails deep in botocore with a traceback."""
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"takes an http:// or https:// URL with a host, got {value!r}")
    return value
