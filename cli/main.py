"""``nexus-sli``: the command line.  Thin: parse, call, print; heavy imports inside commands.

This is the only module that sees every package (exporter, bench, client);
nothing imports it.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time

from nexus_sli.exporter.errors import NexusError
from nexus_sli.tasks import TaskError

from . import (bench_command, build_plan_command, client_commands, export_command, fetch_command, gateway_command,
               publish_command, serve_command, validate_command)


#: Each command module, and the extra of pyproject.toml whose packages its parser may import.
COMMANDS = ((export_command, "export"), (fetch_command, "export"), (validate_command, "export"),
            (build_plan_command, "plan"), (serve_command, "serve"), (publish_command, "publish"),
            (gateway_command, "gateway"), (bench_command, "export"), (client_commands, "client"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nexus-sli", description="Export BERT-family encoders into a Triton model repository, "
                                     "serve it, and call it.")
    commands = parser.add_subparsers(dest="command", required=True)
    for module, extra in COMMANDS:
        try:
            (module.add_parsers if hasattr(module, "add_parsers") else module.add_parser)(commands)
        except ImportError as exc:  # an install with only some extras (the gateway's image) still runs the others
            _missing(commands, module, extra, exc)
    return parser


def _missing(commands, module, extra: str, exc: ImportError) -> None:
    """A command whose packages are not installed: it is listed, and says what to install."""
    name = module.__name__.rsplit(".", 1)[-1].removesuffix("_command").replace("_", "-")
    if name in commands.choices:  # registered before its import failed
        return

    def run(args) -> int:
        print(f"nexus-sli: error: '{name}' needs nexus-sli[{extra}] ({exc}): pip install 'nexus-sli[{extra}]'",
              file=sys.stderr)
        return 2
    commands.add_parser(name, help=f"(not installed: pip install 'nexus-sli[{extra}]')").set_defaults(run=run)


#: How often the thread that raises a swallowed interrupt again looks whether the main thread has left the hook
INTERRUPT_AGAIN_S = 0.001


def _interrupt_again(unraisable) -> None:
    """Python only prints an exception raised where it cannot propagate (a weakref callback or a ``__del__``, such
    as an import's module-lock callback): a Ctrl-C, or the SIGINT that serve stops its export with, landing there
    would be lost, and the command would run on to its end.  It is raised again on the main thread once that has
    left this hook (raised inside it, it would be swallowed again)."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        # a thread, not a flag: the signal also ends a wait in progress there (a sleep, a pipe's read)
        again = threading.Thread(target=_signal_once_out, args=(threading.main_thread().ident,), daemon=True)
        again.start()  # daemon: a command ending meanwhile does not wait for it
    else:
        sys.__unraisablehook__(unraisable)


def _signal_once_out(main: int) -> None:
    """SIGINT to the thread ``main`` once no frame of :func:`_interrupt_again` is on its stack.  Not after a fixed
    delay: on a busy machine the main thread may still be in the hook then (starting this thread)."""
    while _in_hook(sys._current_frames().get(main)):
        time.sleep(INTERRUPT_AGAIN_S)
    signal.pthread_kill(main, signal.SIGINT)


def _in_hook(frame) -> bool:
    while frame is not None:
        if frame.f_code is _interrupt_again.__code__:
            return True
        frame = frame.f_back
    return False


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if sys.unraisablehook is sys.__unraisablehook__:  # a host's own (pytest's, running main in process) stays
        sys.unraisablehook = _interrupt_again
    # Libraries (the ORT optimizer above all) log chattily at INFO; only ours speaks at INFO.
    logging.basicConfig(level=logging.WARNING, format="nexus-sli: %(message)s", stream=sys.stderr)
    logging.getLogger("nexus_sli").setLevel(logging.INFO)
    try:
        return args.run(args)
    except (NexusError, TaskError) as exc:
        print(f"nexus-sli: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C, or serve's SIGTERM: each command cleans up as the interrupt unwinds it
        print("nexus-sli: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:  # a full disk, a permission, a path that is a file: the system's words say it
        print(f"nexus-sli: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
