"""Replicas that fail over: two real ``tritonserver`` replicas on loopback read one ``s3://``
repository (SeaweedFS), 16 clients send load, one replica is SIGKILLed mid-run; no request
fails, every answer is its own text's embedding, and the survivor carries the load.
Over gRPC and over HTTP, with a fresh pair of replicas each."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import threading
import time
import urllib.request

import numpy as np
import pytest

from helpers.waiting import wait_until
from helpers import object_store
from helpers.servers import end_now, kill_server
from nexus_sli.client import (AsyncEncoderClient, DeadlineExceededError, EncoderClient, InvalidInputError,
                              ReplicasFailedError, ServerUnavailableError)
from nexus_sli.client.replicas import RETRY_S, Replicas, address, parse_urls, retryable
from nexus_sli.exporter.export.pipeline import ExportOptions, run_export
from nexus_sli.exporter.export.validate import validation_texts
from nexus_sli.exporter.serving import server as serve
from nexus_sli.exporter.triton import publish as pub

BUCKET = "models"
CLIENTS = 16
#: requests before the kill, and after it, across all clients (bounded: a few seconds of load each)
BEFORE, AFTER = 300, 1000
TEXTS = validation_texts()[:48]


def test_replicas_take_turns_and_set_a_failed_one_aside():
    replicas = Replicas(["a", "b", "c"], down_for_s=60)
    assert [replicas.order()[0] for _ in range(4)] == ["a", "b", "c", "a"]
    replicas.failed_on("b")
    assert [replicas.order() for _ in range(3)] == [["c", "a", "b"], ["c", "a", "b"], ["a", "c", "b"]]
    replicas.succeeded("b")  # answered again (tried last, or after its time aside)
    assert replicas.order() == ["b", "c", "a"] and replicas.served["b"] == 1 and replicas.failed["b"] == 1
    assert parse_urls("h1:8001, h2:8001,h1:8001", "d") == ["h1:8001", "h2:8001"]
    assert parse_urls(None, "d") == ["d"] and parse_urls(("x",), "d") == ["x"]
    with pytest.raises(ValueError):
        parse_urls(" , ", "d")


def test_a_replica_is_probed_until_it_answers_and_again_once_it_failed():
    replicas = Replicas(["a:1", "b:2"])
    assert not replicas.answering("a:1")  # new: probed before its first request
    replicas.succeeded("a:1")
    assert replicas.answering("a:1") and not replicas.answering("b:2")
    replicas.failed_on("a:1")
    assert not replicas.answering("a:1")
    replicas.succeeded("b:2")
    replicas.update(["a:1"])  # b gone from a name's addresses, and back: new again
    replicas.update(["a:1", "b:2"])
    assert not replicas.answering("b:2")
    replicas.failed_on("b:2")
    with pytest.raises(InvalidInputError):  # an answer all the same: the next request goes without a probe
        retryable(InvalidInputError("texts[0] is not a string"), "m", replicas, "b:2")
    assert replicas.answering("b:2") and replicas.served["b:2"] == 1
    assert address("10.0.0.5:8001") == ("10.0.0.5", 8001) and address("[::1]:8001") == ("::1", 8001)
    assert address("host.svc:8001") == ("host.svc", 8001) and address("unix:/tmp/triton.sock") is None


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_all_replicas_down_is_one_error_with_every_attempt(protocol):
    dead = [f"127.0.0.1:{port}" for port in object_store.free_ports(2)]
    started = time.monotonic()
    with EncoderClient(dead, protocol=protocol, model="embedder", timeout_s=5, retry_s=1.0) as client:
        with pytest.raises(ReplicasFailedError) as failed:
            client.embed("text")
    # passes over both replicas, with pauses, until the retry budget was spent; the error lists the last pass
    assert time.monotonic() - started >= 1.0 and all(client.replicas.failed[url] > 1 for url in dead)
    assert sorted(url for url, _ in failed.value.attempts) == sorted(dead)
    assert all(isinstance(error, ServerUnavailableError) for _, error in failed.value.attempts)
    assert all(url in str(failed.value) for url in dead)
    # one URL: retried the same way, then its own error
    with EncoderClient(dead[:1], protocol=protocol, model="embedder", timeout_s=5, retry_s=1.0) as one:
        with pytest.raises(ServerUnavailableError):
            one.embed("text")
    assert one.replicas.failed[dead[0]] > 1


def test_attempts_caps_the_tries_and_one_attempt_raises_the_error_itself():
    dead = [f"127.0.0.1:{port}" for port in object_store.free_ports(2)]
    with EncoderClient(dead, model="embedder", timeout_s=5, attempts=1) as client:
        with pytest.raises(ServerUnavailableError) as raised:
            client.embed("text")
        assert not isinstance(raised.value, ReplicasFailedError)
        assert sum(client.replicas.failed.values()) == 1  # one try, and that replica is set aside

    async def one_try():
        async with AsyncEncoderClient(dead, model="embedder", timeout_s=5, attempts=1) as client:
            await client.embed("text")
    with pytest.raises(ServerUnavailableError) as raised:
        asyncio.run(one_try())
    assert not isinstance(raised.value, ReplicasFailedError)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="attempts must be a positive integer"):
            EncoderClient(dead, attempts=bad)
        with pytest.raises(ValueError, match="attempts must be a positive integer"):
            AsyncEncoderClient(dead, attempts=bad)
    for bad in (-1, True, "5"):
        with pytest.raises(ValueError, match="retry_s must be a number of seconds >= 0"):
            EncoderClient(dead, retry_s=bad)
    assert EncoderClient(dead, attempts=1).retry_s == 0 and EncoderClient(dead).retry_s == RETRY_S
    assert EncoderClient(dead, attempts=5).attempts == 2 and EncoderClient(dead).attempts == 2


def test_a_call_whose_deadline_passed_is_not_sent_again():
    """A server that takes requests and never answers (one overloaded past the client's timeout): the
    call fails after one deadline with its own error, not after a retry budget of copies sent to a
    server that may still hold the first one queued.  The synchronous HTTP client too: its connection
    carries the deadline (tritonclient's HTTP calls take none of their own)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.listen(16)
    url = f"127.0.0.1:{listener.getsockname()[1]}"

    async def async_call(protocol):
        async with AsyncEncoderClient(url, protocol=protocol, model="embedder", timeout_s=0.5, retry_s=30) as client:
            await client.embed("text")
        return client

    try:
        for protocol in ("grpc", "http"):
            started = time.monotonic()
            with pytest.raises(DeadlineExceededError, match="did not answer within"):
                asyncio.run(async_call(protocol))
            assert time.monotonic() - started < 5, protocol
            with EncoderClient(url, protocol=protocol, model="embedder", timeout_s=0.5, retry_s=30) as client:
                started = time.monotonic()
                with pytest.raises(DeadlineExceededError, match="did not answer within"):
                    client.embed("text")
            assert time.monotonic() - started < 5 and client.replicas.failed[url] == 1, protocol
    finally:
        listener.close()


def test_a_connection_closed_mid_response_is_retryable():
    from geventhttpclient.response import HTTPConnectionClosed

    from nexus_sli.client.protocol import translate

    # what tritonclient's HTTP client raises when the replica dies while answering
    assert isinstance(translate(HTTPConnectionClosed("connection closed."), "embedder"), ServerUnavailableError)


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_checkpoint):
    """The tiny embedder published once to SeaweedFS; the AWS variables set for Triton."""
    root = tmp_path_factory.mktemp("failover")
    checkpoint = tiny_checkpoint("bert")
    with object_store.serving(root, BUCKET) as s3:
        run_export(ExportOptions(model=str(checkpoint), name="embedder", out=root / "repo"))
        pub.publish(root / "repo", pub.Destination.parse(f"s3://{BUCKET}/fleet", s3.endpoint))
        yield {"s3": s3, "root": root, "reference": object_store.torch_embeddings(checkpoint, TEXTS)}


@pytest.fixture(scope="module", params=["grpc", "http"])
def replicas(request, store):
    """Two replicas reading the published repository, called over one protocol."""
    protocol, servers = request.param, []
    try:
        for index in range(2):
            http, grpc, metrics = object_store.free_ports(3)
            log = open(store["root"] / f"replica-{protocol}-{index}.log", "wb")
            process = serve.start(store["s3"].triton_url(BUCKET, "fleet"), http, grpc, metrics, stdout=log,
                                  stderr=log)
            servers.append({"process": process, "http": f"127.0.0.1:{http}", "grpc": f"127.0.0.1:{grpc}",
                            "url": f"127.0.0.1:{grpc if protocol == 'grpc' else http}", "log": log})
        yield {"servers": servers, "protocol": protocol, "reference": store["reference"]}
    finally:
        for server in servers:
            end_now(server["process"])
            server["log"].close()


def _successes(http: str) -> int:
    with urllib.request.urlopen(f"http://{http}/v2/models/embedder/stats", timeout=10) as response:
        stats = json.loads(response.read())["model_stats"]
    return sum(int(entry["inference_stats"]["success"]["count"]) for entry in stats)


def test_a_replica_killed_under_load_loses_no_request(replicas):
    victim, survivor = replicas["servers"]
    reference = replicas["reference"]
    urls = [victim["url"], survivor["url"]]
    lock = threading.Lock()
    done = {"before": 0, "after": 0}
    killed = threading.Event()
    stop = threading.Event()
    wrong, failures, clients = [], [], []

    def load(number: int) -> None:
        rng = random.Random(number)
        with EncoderClient(urls, protocol=replicas["protocol"], model="embedder", timeout_s=30) as client:
            clients.append(client)
            while not stop.is_set():
                picked = rng.sample(range(len(TEXTS)), rng.randint(1, 3))
                after = killed.is_set()  # sent after the kill: only the survivor can answer it
                try:
                    vectors = client.embed([TEXTS[i] for i in picked])
                except Exception as exc:  # noqa: BLE001 - every failure is counted, none may happen
                    failures.append(repr(exc))
                    continue
                if not np.allclose(vectors, reference[picked], atol=1e-4):
                    wrong.append(picked)
                with lock:
                    done["after" if after else "before"] += 1

    threads = [threading.Thread(target=load, args=(n,), daemon=True) for n in range(CLIENTS)]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: done["before"] >= BEFORE or failures, f"{BEFORE} requests before the kill")
        survivor_at_kill = _successes(survivor["http"])
        kill_server(victim)
        killed.set()
        wait_until(lambda: done["after"] >= AFTER or failures, f"{AFTER} requests after the kill")
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)

    assert failures == [] and wrong == []
    assert done["before"] >= BEFORE and done["after"] >= AFTER, done
    # both replicas served before the kill; the victim's failures were retried on the survivor
    assert sum(c.replicas.served[victim["url"]] for c in clients) > 0
    assert sum(c.replicas.failed[victim["url"]] for c in clients) >= 1
    # the survivor answered every request sent after the kill (Triton's own count says so, once it has counted
    # the last ones: Triton counts a request when it releases it, which can come after the client has its answer)
    wait_until(lambda: _successes(survivor["http"]) - survivor_at_kill >= done["after"],
               f"the survivor to count the {done['after']} requests answered after the kill", timeout=30)


@contextlib.contextmanager
def taking_no_connection():
    """A ``HOST:PORT`` whose connection attempts go unanswered, as a host that is gone without refusing them
    (its packets dropped) does: a listener whose queue of connections is full, so the kernel drops each SYN."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=0)
    address = listener.getsockname()
    queued = []
    try:
        for _ in range(4):
            client = socket.socket()
            client.setblocking(False)
            client.connect_ex(address)
            queued.append(client)
        with pytest.raises(TimeoutError):  # the premise: a connection attempt now waits, unanswered
            socket.create_connection(address, timeout=0.5)
        yield f"127.0.0.1:{address[1]}"
    finally:
        for client in queued:
            client.close()
        listener.close()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_replica_that_takes_no_connection_costs_a_connect_timeout_not_the_call(replicas, asynchronous):
    """Nothing was sent to a replica that never took the connection: the call goes on to the next replica
    (a passed deadline would not: the request might be held there)."""
    survivor = replicas["servers"][1]
    with taking_no_connection() as gone:
        urls, options = [gone, survivor["url"]], {"protocol": replicas["protocol"], "model": "embedder",
                                                  "timeout_s": 10, "attempts": 2, "retry_s": 0}

        async def run():
            async with AsyncEncoderClient(urls, **options) as client:
                return await client.embed(TEXTS[:4]), client.replicas

        if asynchronous:
            vectors, chosen = asyncio.run(run())
        else:
            with EncoderClient(urls, **options) as client:
                vectors, chosen = client.embed(TEXTS[:4]), client.replicas
    assert np.allclose(vectors, replicas["reference"][:4], atol=1e-4)
    assert chosen.failed[gone] == 1 and chosen.served[survivor["url"]] >= 1 and chosen.served[gone] == 0


def test_async_client_fails_over_to_the_live_replica(replicas):
    victim, survivor = replicas["servers"]
    if victim["process"].poll() is None:  # run alone, without the load test before it
        kill_server(victim)

    async def run():
        async with AsyncEncoderClient([victim["url"], survivor["url"]], protocol=replicas["protocol"],
                                      model="embedder") as client:
            vectors = await asyncio.gather(*(client.embed([text]) for text in TEXTS[:8]))
            return np.concatenate(vectors), client.replicas

    vectors, chosen = asyncio.run(run())
    assert np.allclose(vectors, replicas["reference"][:8], atol=1e-4)
    assert chosen.failed[victim["url"]] >= 1 and chosen.served[survivor["url"]] >= 8
