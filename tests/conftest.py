from __future__ import annotations

import os
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from nexus_sli.exporter.export import timing
from nexus_sli.exporter.export.cache_files import CACHE_DIR_ENV
from nexus_sli.exporter.export.threads import ENV as THREADS_ENV
from helpers.exports import ExportStore
from helpers.tiny_models import build_tiny


@pytest.fixture(scope="session", autouse=True)
def scratch_layer_cache(tmp_path_factory):
    """Exports cache layers by default: keep every test (and its subprocesses) out of the user's cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_DIR_ENV, str(tmp_path_factory.mktemp("layer-cache")))
        yield


@pytest.fixture
def stand_in_servers(monkeypatch):
    """Stand-in connections (``client.fleet.clients[url]``, ``fleet._connect``) at URLs where no server
    listens: the clients' probe of a replica's TCP connection (``replicas.probe``) would find none, so it is
    off.  tests/test_failover.py probes real servers."""
    from nexus_sli.client import async_client, client

    async def reachable(url, timeout_s):
        return None

    monkeypatch.setattr(client, "probe", lambda url, timeout_s, create_connection: None)
    monkeypatch.setattr(async_client, "probe_async", reachable)


@pytest.fixture(scope="session", autouse=True)
def cores_shared_between_workers():
    """Under pytest-xdist each worker takes its share of the cores: the exporter's runtimes, the servers'
    ONNX Runtime backend, torch and the subprocesses' OpenMP.  Runtimes that each take every core spin and
    wait on each other's threads, and two workers then run slower than one."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers == 1:
        yield
        return
    import torch

    share = max(1, (os.cpu_count() or 1) // workers)
    previous = torch.get_num_threads()
    torch.set_num_threads(share)
    with pytest.MonkeyPatch.context() as patch:
        for variable in (THREADS_ENV, "NEXUS_ORT_THREADS", "OMP_NUM_THREADS"):
            patch.setenv(variable, str(share))
        yield
    torch.set_num_threads(previous)


#: The modules that take longest, longest first (make test's durations).  pytest-xdist hands modules to its
#: workers in collection order under make test's ``--no-loadscope-reorder`` (by default it orders them by their
#: number of tests): one of these started last would run alone while the other workers wait.
LONGEST_FIRST = ("test_serving.py", "test_reliability.py", "test_gateway.py", "test_bench.py", "test_tasks.py",
                 "test_serve_first.py")


def pytest_collection_modifyitems(items):
    """Modules in :data:`LONGEST_FIRST` collected first, the rest in their own order (a stable sort)."""
    rank = {name: number for number, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


#: The exporter's own timing (warm-up runs, then rounds of every candidate side by side), and the one round
#: the other tests time with.
EXPORT_TIMING = {"WARMUP": timing.WARMUP, "ROUNDS": timing.ROUNDS}
ONE_ROUND = {"WARMUP": 1, "ROUNDS": 1}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Exports made by tests time each candidate on one warm-up run and one round.  Which graph wins is a
    measurement no test asserts but those marked ``real_timing``, which get the exporter's own rounds;
    the rest only need a candidate kept the way an export keeps it.  Set before the test's fixtures, so
    that the exports of a module's (or the shared store's) fixtures follow the first test that needs them."""
    for name, value in (EXPORT_TIMING if item.get_closest_marker("real_timing") else ONE_ROUND).items():
        setattr(timing, name, value)


#: The tiny models' WordPiece tokenizer, trained once by :func:`tiny_models.train_tokenizer` on the validation
#: texts and kept: the trainer breaks frequency ties in a different order each run (tokenizers' hash maps),
#: so a tokenizer trained per run made every "seeded" tiny model a slightly different model each time, and
#: reduced-precision results near a bar passed or failed by chance.
TINY_TOKENIZER = Path(__file__).parent / "data" / "tiny_tokenizer.json"


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return load_tiny_tokenizer()


def load_tiny_tokenizer() -> Tokenizer:
    """The kept tokenizer; regenerate with ``train_tokenizer(validation_texts()).save(str(TINY_TOKENIZER))``."""
    return Tokenizer.from_file(str(TINY_TOKENIZER))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tiny_tokenizer):
    """``tiny_checkpoint("roberta")`` -> directory of a seeded tiny checkpoint (built once)."""
    built = {}

    def make(model_type: str):
        if model_type not in built:
            built[model_type] = build_tiny(model_type, tmp_path_factory.mktemp(model_type), tiny_tokenizer)
        return built[model_type]

    return make


@pytest.fixture(scope="session")
def exports(tmp_path_factory):
    """Exports made once per run (:mod:`helpers.exports`): ``exports.copy(name, repository, as_name)``.
    pytest-xdist's workers each have a folder in the run's: the store lies beside them, shared."""
    run = tmp_path_factory.getbasetemp()
    return ExportStore((run.parent if os.environ.get("PYTEST_XDIST_WORKER") else run) / "shared-exports")
