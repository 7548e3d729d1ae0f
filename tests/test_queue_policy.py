"""Triton's queue policy on the exported steps, and its refusals as the client reads them; and what the
joined model, which has none, does instead.

A seeded tiny model is exported in fp32 and served by the real Triton server, once on each serving path
(tests/helpers/serving_paths.py).  Its batching steps carry the exported queue policy; a second ensemble,
``held``, runs the same encoder behind a copy of the tokenizer whose batcher holds every request far
longer than the queue's timeout, with room for one request.  With the steps separate, a second request is
refused at once (queue full) and a held one is dropped when its time in the queue passes, the default's or
the shorter deadline the client sends with it; each reaches the client as ``ServerBusyError``, but a drop at
the client's own deadline as ``DeadlineExceededError``.  Under
``nexus-sli serve``'s default each ensemble is one joined model, batched with its steps' longest delay but
without their queue policy, on purpose (docs/serving.md): nothing is refused or dropped by the queue; a
request waits for its batch, and a gRPC call that passes its deadline is cancelled and dropped unrun.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import time

import pytest

import tritonclient.http as httpclient

from helpers.servers import serving
from helpers.serving_paths import JOINED, PATHS, SEPARATE, joined_models, per_path, start_options
from nexus_sli.client import DeadlineExceededError, EncoderClient, ServerBusyError, ServerUnavailableError
from nexus_sli.exporter.export.pipeline import ExportOptions, run_export
from nexus_sli.exporter.triton import config as tc

NAME, HELD = "queued", "held"
#: the held tokenizer's queue: one request, dropped after this long (a request may ask for less)
HELD_TIMEOUT_S = 1.0
#: far past the timeout: the batcher waits this long for company before it runs a request
HELD_DELAY_US = 30_000_000


def _held_ensemble(repo) -> None:
    """``HELD``: ``NAME``'s ensemble with its tokenizer replaced by a copy that holds its queue."""
    tokenizer = tc.read(repo / f"{NAME}_tokenizer" / "config.pbtxt")
    tokenizer.name = f"{HELD}_tokenizer"
    tokenizer.dynamic_batching.max_queue_delay_microseconds = HELD_DELAY_US
    policy = tokenizer.dynamic_batching.default_queue_policy
    policy.max_queue_size, policy.default_timeout_microseconds = 1, int(HELD_TIMEOUT_S * 1_000_000)
    shutil.copytree(repo / f"{NAME}_tokenizer", repo / tokenizer.name)
    tc.write(tokenizer, repo / tokenizer.name)
    ensemble = tc.read(repo / NAME / "config.pbtxt")
    ensemble.name = HELD
    ensemble.ensemble_scheduling.step[0].model_name = tokenizer.name
    (repo / HELD / "1").mkdir(parents=True)
    tc.write(ensemble, repo / HELD)


@pytest.fixture(scope="module")
def repository(tmp_path_factory, tiny_checkpoint):
    repo = tmp_path_factory.mktemp("queue-policy")
    run_export(ExportOptions(model=str(tiny_checkpoint("bert")), name=NAME, out=repo, precision="fp32"))
    _held_ensemble(repo)
    return repo


@pytest.fixture(scope="module")
def servers(repository):
    @contextlib.contextmanager
    def start(path):
        with serving(repository, **start_options(path)) as served:
            assert joined_models(served["http"], [NAME, HELD]) == ({NAME, HELD} if path == JOINED else set())
            yield {**served, "path": path}

    with per_path(start) as server:
        yield server


@pytest.fixture(params=PATHS)
def server(request, servers):
    """The repository served on one path: ``{"path", "repo", "http", "grpc", ...}``."""
    return servers(request.param)


def _client(server, protocol: str, timeout_s: float = 60.0) -> EncoderClient:
    """One attempt: a refusal is raised as it came, not retried."""
    return EncoderClient(server[protocol], protocol=protocol, model=HELD, timeout_s=timeout_s, attempts=1, retry_s=0)


def _served_policy(server, model: str) -> dict:
    """The queue policy of ``model`` as the server runs it (Triton's JSON; a field left out is its zero)."""
    client = httpclient.InferenceServerClient(server["http"])
    try:
        return client.get_model_config(model).get("dynamic_batching", {}).get("default_queue_policy", {})
    finally:
        client.close()


def _counts(server, model: str) -> tuple[int, int]:
    """(inferences, executions) Triton's statistics count for ``model``: one inference per text."""
    client = httpclient.InferenceServerClient(server["http"])
    try:
        stats = client.get_inference_statistics(model)["model_stats"][0]
    finally:
        client.close()
    return int(stats["inference_count"]), int(stats["execution_count"])


def test_every_batching_step_has_a_bounded_queue_with_a_timeout(server):
    for step in (f"{NAME}_tokenizer", f"{NAME}_encoder"):
        batching = tc.read(server["repo"] / step / "config.pbtxt").dynamic_batching
        assert batching.default_queue_policy == tc.queue_policy()
        assert int(_served_policy(server, step)["max_queue_size"]) == tc.MAX_QUEUE_SIZE  # the steps are served too
    policy = tc.queue_policy()
    assert policy.timeout_action == tc.pb.ModelQueuePolicy.REJECT and policy.allow_timeout_override
    assert policy.max_queue_size == tc.MAX_QUEUE_SIZE and policy.default_timeout_microseconds == tc.QUEUE_TIMEOUT_US
    # an ensemble has no queue of its own: its steps' policies apply
    assert not tc.read(server["repo"] / NAME / "config.pbtxt").HasField("dynamic_batching")
    if server["path"] == JOINED:  # the model that answers NAME batches without a queue policy, on purpose
        served = _served_policy(server, NAME)
        assert int(served.get("max_queue_size", 0)) == 0 and int(served.get("default_timeout_microseconds", 0)) == 0
    with EncoderClient(server["grpc"], model=NAME) as client:
        assert client.embed(["served as before"]).shape[0] == 1


@pytest.mark.parametrize("server", [SEPARATE], indirect=True)
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_full_queue_is_refused_at_once_as_server_busy(server, protocol):
    first: list[Exception] = []

    def held():
        with _client(server, protocol) as client, pytest.raises(ServerBusyError) as raised:
            client.embed(["first, held in the queue"])
        first.append(raised.value)

    holder = threading.Thread(target=held)
    holder.start()
    time.sleep(HELD_TIMEOUT_S / 4)
    started = time.monotonic()
    with _client(server, protocol) as client, pytest.raises(ServerBusyError, match="maximum queue size"):
        client.embed(["second, past the queue's size"])
    assert time.monotonic() - started < HELD_TIMEOUT_S / 2
    holder.join()
    assert "timeout expired" in str(first[0])  # the held one was dropped when its time in the queue passed


@pytest.mark.parametrize("server", [SEPARATE], indirect=True)
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_request_queued_past_the_timeout_is_dropped_as_server_busy(server, protocol):
    started = time.monotonic()
    with _client(server, protocol) as client, pytest.raises(ServerBusyError, match="timeout expired"):
        client.embed(["held until its time in the queue passes"])
    assert HELD_TIMEOUT_S <= time.monotonic() - started < 10


@pytest.mark.parametrize("server", [SEPARATE], indirect=True)
def test_the_clients_deadline_reaches_the_steps_through_the_ensemble(server):
    """A shorter deadline than the queue's timeout drops the request sooner: the ensemble passes the
    client's per-request timeout to its steps.  Given a connection that outlives the deadline, the
    answer is the step's drop, which is the call's deadline, not a busy server: not sent again."""
    url = server["http"]
    with EncoderClient(url, protocol="http", model=HELD, timeout_s=HELD_TIMEOUT_S / 5, retry_s=30) as client:
        client.fleet.clients[url].close()
        client.fleet.clients[url] = httpclient.InferenceServerClient(url)  # tritonclient's 60 s timeouts
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError, match="timeout expired"):
            client.embed(["dropped at the client's deadline"])
    assert time.monotonic() - started < HELD_TIMEOUT_S * 0.8 and client.replicas.failed[url] == 1


@pytest.mark.parametrize("server", [JOINED], indirect=True)
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_the_joined_model_neither_refuses_nor_drops_what_waits_in_its_queue(server, protocol):
    """The joined ``held`` waits for company as long as its held tokenizer would (far past the steps' queue
    timeout) and bounds nothing: a request waits past the timeout, a second one is queued beside it, and both
    run in one execution once the batch is full."""
    before = _counts(server, HELD)
    first: list = []

    def held():
        with _client(server, protocol) as client:
            first.append(client.embed(["first, held past the steps' queue timeout"]))

    holder = threading.Thread(target=held)
    holder.start()
    time.sleep(HELD_TIMEOUT_S * 1.5)
    assert holder.is_alive() and not first, "the first request was answered or dropped while it waited"
    started = time.monotonic()
    with _client(server, protocol) as client:  # with the first one, a full batch: run at once
        second = client.embed(["second, past the steps' queue size"] * (tc.MAX_BATCH_SIZE - 1))
    holder.join(HELD_DELAY_US / 1e6)
    assert first[0].shape[0] == 1 and second.shape[0] == tc.MAX_BATCH_SIZE - 1
    assert time.monotonic() - started < HELD_DELAY_US / 1e6 / 3, "the full batch waited for the batching delay"
    after = _counts(server, HELD)
    assert (after[0] - before[0], after[1] - before[1]) == (tc.MAX_BATCH_SIZE, 1)


@pytest.mark.parametrize("server", [JOINED], indirect=True)
def test_a_grpc_call_past_its_deadline_is_dropped_from_the_joined_models_queue(server):
    """Without a queue policy Triton does not act on the request's timeout; but a gRPC call that passes its
    deadline is cancelled, and Triton drops a cancelled request from the batcher's queue unrun."""
    before = _counts(server, HELD)
    started = time.monotonic()
    with _client(server, "grpc", timeout_s=HELD_TIMEOUT_S / 5) as client, pytest.raises(ServerUnavailableError):
        client.embed(["dropped at the client's deadline"])
    assert time.monotonic() - started < HELD_TIMEOUT_S * 0.8
    with _client(server, "grpc") as client:  # a full batch alone: run at once
        client.embed(["a full batch"] * tc.MAX_BATCH_SIZE)
    after = _counts(server, HELD)
    # the cancelled request ran neither in this execution (it would not fit) nor in one of its own
    assert (after[0] - before[0], after[1] - before[1]) == (tc.MAX_BATCH_SIZE, 1)
