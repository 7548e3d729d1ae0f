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
import urllib.request

import pytest

import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families

from helpers.servers import serving
from helpers.serving_paths import JOINED, PATHS, SEPARATE, joined_models, per_path, start_options
from helpers.waiting import wait_until
from nexus_sli.client import DeadlineExceededError, EncoderClient, ServerBusyError
from nexus_sli.exporter.export.pipeline import ExportOptions, run_export
from nexus_sli.exporter.triton import config as tc

NAME, HELD = "queued", "held"
#: the held tokenizer's queue: one request, dropped after this long (a request may ask for less)
HELD_TIMEOUT_S = 1.0
#: far past the timeout: the batcher waits this long for company before it runs a request
HELD_DELAY_US = 30_000_000
HELD_DELAY_S = HELD_DELAY_US / 1e6


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


def _queue_of(server) -> str:
    """The model whose batcher holds ``HELD``'s requests: its tokenizer step, or, joined, the model itself."""
    return HELD if server["path"] == JOINED else f"{HELD}_tokenizer"


def _pending(server, model: str) -> int:
    """The requests waiting in ``model``'s queue now: Triton's pending-request gauge."""
    with urllib.request.urlopen(f"http://{server['metrics']}/metrics", timeout=30) as response:
        families = text_string_to_metric_families(response.read().decode())
        return sum(int(sample.value) for family in families if family.name == "nv_inference_pending_request_count"
                   for sample in family.samples if sample.labels.get("model") == model)


def _wait_until_held(server, holder: threading.Thread) -> None:
    """Until the request ``holder`` sent waits in the held queue (it fails at once where the holder ended)."""
    def held() -> bool:
        assert holder.is_alive(), "the first request was answered before it was seen waiting in the queue"
        return _pending(server, _queue_of(server)) == 1

    wait_until(held, "the first request to wait in the held queue")


def _failed(server, model: str) -> tuple[int, int]:
    """(requests, nanoseconds) Triton's statistics count as failed in ``model``: a request dropped from its
    queue is counted with the time it spent there, measured by the server."""
    client = httpclient.InferenceServerClient(server["http"])
    try:
        failed = client.get_inference_statistics(model)["model_stats"][0]["inference_stats"]["fail"]
    finally:
        client.close()
    return int(failed["count"]), int(failed["ns"])


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
    with _client(server, protocol) as client:
        client.info(HELD)  # connected and the model read: the second call is one request, sent at once
        holder.start()
        _wait_until_held(server, holder)
        with pytest.raises(ServerBusyError, match="maximum queue size"):
            client.embed(["second, past the queue's size"])
        # refused at once: while the first still waits, not after any time in the queue
        assert holder.is_alive() and not first, "the refusal came after the first request left the queue"
    holder.join()
    assert "timeout expired" in str(first[0])  # the held one was dropped when its time in the queue passed


@pytest.mark.parametrize("server", [SEPARATE], indirect=True)
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_request_queued_past_the_timeout_is_dropped_as_server_busy(server, protocol):
    started = time.monotonic()
    # unanswered, it would run at the batching delay; dropped at the client's deadline, it would be a
    # DeadlineExceededError: a ServerBusyError is the queue's own timeout
    with _client(server, protocol) as client, pytest.raises(ServerBusyError, match="timeout expired"):
        client.embed(["held until its time in the queue passes"])
    assert time.monotonic() - started >= HELD_TIMEOUT_S  # a lower bound: the call outlives its time in the queue


@pytest.mark.parametrize("server", [SEPARATE], indirect=True)
def test_the_clients_deadline_reaches_the_steps_through_the_ensemble(server):
    """A shorter deadline than the queue's timeout drops the request sooner: the ensemble passes the
    client's per-request timeout to its steps.  Given a connection that outlives the deadline, the
    answer is the step's drop, which is the call's deadline, not a busy server: not sent again."""
    url, step = server["http"], _queue_of(server)
    before = _failed(server, step)
    with EncoderClient(url, protocol="http", model=HELD, timeout_s=HELD_TIMEOUT_S / 5, retry_s=30) as client:
        client.fleet.clients[url].close()
        client.fleet.clients[url] = httpclient.InferenceServerClient(url)  # tritonclient's 60 s timeouts
        with pytest.raises(DeadlineExceededError, match="timeout expired"):
            client.embed(["dropped at the client's deadline"])
    assert client.replicas.failed[url] == 1  # one attempt: not sent again
    # Triton counts the drop with its time in the step's queue, measured by the server (a loaded client's clock
    # would add its own delays): less than the queue's timeout, which would have dropped it at HELD_TIMEOUT_S
    def counted():  # Triton may answer before the step has counted the drop
        now = _failed(server, step)
        return now if now[0] > before[0] else None

    after = wait_until(counted, "the step to count the drop")
    assert after[0] - before[0] == 1 and (after[1] - before[1]) / 1e9 < HELD_TIMEOUT_S


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
    _wait_until_held(server, holder)
    time.sleep(HELD_TIMEOUT_S * 1.5)  # the wait is what is tested (longer than the steps' timeout), not a sync
    assert holder.is_alive() and not first, "the first request was answered or dropped while it waited"
    assert _pending(server, HELD) == 1, "the first request left the queue while it waited"
    # with the first one, a full batch: run at once; had it waited for the batching delay, this call's
    # deadline, half that delay, would have passed
    with _client(server, protocol, timeout_s=HELD_DELAY_S / 2) as client:
        second = client.embed(["second, past the steps' queue size"] * (tc.MAX_BATCH_SIZE - 1))
    holder.join(HELD_DELAY_S)
    assert first[0].shape[0] == 1 and second.shape[0] == tc.MAX_BATCH_SIZE - 1
    after = _counts(server, HELD)
    assert (after[0] - before[0], after[1] - before[1]) == (tc.MAX_BATCH_SIZE, 1)


@pytest.mark.parametrize("server", [JOINED], indirect=True)
def test_a_grpc_call_past_its_deadline_is_dropped_from_the_joined_models_queue(server):
    """Without a queue policy Triton does not act on the request's timeout; but a gRPC call that passes its
    deadline is cancelled, and Triton drops a cancelled request from the batcher's queue unrun."""
    before = _counts(server, HELD)
    # answered, the call would have waited for the batching delay, far past its deadline
    with _client(server, "grpc", timeout_s=HELD_TIMEOUT_S / 5) as client, pytest.raises(DeadlineExceededError):
        client.embed(["dropped at the client's deadline"])
    with _client(server, "grpc") as client:  # a full batch alone: run at once
        client.embed(["a full batch"] * tc.MAX_BATCH_SIZE)
    after = _counts(server, HELD)
    # the cancelled request ran neither in this execution (it would not fit) nor in one of its own, and is
    # not left waiting for one: the queue is empty long before the batching delay would have run it
    assert (after[0] - before[0], after[1] - before[1]) == (tc.MAX_BATCH_SIZE, 1)
    assert _pending(server, HELD) == 0, "the cancelled request is still queued"
