"""``nexus-sli serve``'s two ways of serving a batched CPU ensemble, for the modules whose tests run on both.

:data:`JOINED`: its default, the ensemble's steps run in one python-backend process under the ensemble's name
(exporter/serving/joined_steps.py); :data:`SEPARATE`: ``--separate-steps``, the steps as exported, as an NGC
container or a Kubernetes pod serves them.  A module serves its repository once per path (a module-scoped
fixture of :func:`per_path`), each test picks it through a function-scoped fixture with ``params=PATHS``, and a
test that holds on one path only says so with ``@pytest.mark.parametrize("server", [JOINED], indirect=True)``.
(Not a module-scoped fixture with ``params``: pytest orders a module's tests by the position of that
parameter in each test's own list, so a test's ``[SEPARATE]`` would be taken for the fixture's first path,
and the servers started again and again.)
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Iterator, TypeVar

import tritonclient.http as httpclient

T = TypeVar("T")

JOINED, SEPARATE = "joined", "separate"
PATHS = (JOINED, SEPARATE)


def start_options(path: str) -> dict:
    """What :func:`nexus_sli.exporter.serving.server.start` is given to serve on ``path``."""
    if path not in PATHS:
        raise ValueError(f"no serving path {path!r}: one of {PATHS}")
    return {"separate_steps": path == SEPARATE}


@contextlib.contextmanager
def per_path(start: Callable[[str], ContextManager[T]]) -> Iterator[Callable[[str], T]]:
    """A getter of one server per path: ``start(path)`` is entered the first time a test asks for that path,
    and every one entered is exited at the end."""
    with contextlib.ExitStack() as stack:
        started: dict[str, T] = {}

        def server(path: str) -> T:
            if path not in started:
                started[path] = stack.enter_context(start(path))
            return started[path]

        yield server


def joined_models(http: str, models: list[str]) -> set[str]:
    """Those of ``models`` (ensembles in the repository) that the server at ``http`` serves as one joined model:
    a python model under the ensemble's name, where the steps as exported are Triton's ``ensemble`` platform."""
    client = httpclient.InferenceServerClient(http)
    try:
        return {model for model in models if client.get_model_config(model).get("platform") != "ensemble"}
    finally:
        client.close()
