"""A pass over a ``dns:///`` name's replicas keeps the connections it started with: a resolution during the
pass that retires a replica it has yet to try (a pod scaled away, resolved again by another call) leaves it
failing over to the rest, not looking the retired one up, and closes the retired one's connection when it is
done with it (not before: another pass may hold it), so a long-lived client keeps no channel to every pod it
ever saw.  Stand-in servers and a stand-in resolver here;
tests/test_fleet.py runs real replicas."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException, deserialize_bytes_tensor

from nexus_sli.client import AsyncEncoderClient, EncoderClient
from nexus_sli.client.model_info import ModelInfo

pytestmark = pytest.mark.usefixtures("stand_in_servers")  # no server behind their URLs

NAME = "dns:///pods:8001"
FIRST, SCALED_AWAY, LAST = "10.0.0.1:8001", "10.0.0.2:8001", "10.0.0.3:8001"
#: how often the name is resolved again here: the first replica's request outlasts it
REFRESH_S = 0.01


class _Dns:
    """The name's addresses as a headless Service answers them: the ready pods, changed by the test."""

    def __init__(self, addresses: list[str]):
        self.addresses = addresses

    def __call__(self, host: str, port: int) -> list[str]:
        return list(self.addresses)


class _Answer:
    def __init__(self, rows: np.ndarray):
        self.rows = rows

    def as_numpy(self, name):
        return self.rows

    def get_response(self) -> dict:
        return {"model_version": "1"}


class _Pod:
    """One replica.  ``FIRST`` is slow and fails, and meanwhile the name is resolved again (another call's pass
    starting) without ``SCALED_AWAY``, which then refuses connections; ``LAST`` answers ``[text, 1]``."""

    def __init__(self, url: str, fleet: dict):
        self.url, self.fleet, self.tried, self.closed = url, fleet, 0, 0

    def _answer(self, inputs):
        self.tried += 1
        if self.url == FIRST:
            self.fleet["dns"].addresses = ["10.0.0.1", "10.0.0.3"]
            self.fleet["client"].fleet.refresh()
        assert not self.closed, f"{self.url} used after its connection was closed"
        if self.url != LAST:
            raise InferenceServerException(msg="failed to connect to all addresses", status="StatusCode.UNAVAILABLE")
        texts = deserialize_bytes_tensor(inputs[0]._get_content())
        return _Answer(np.array([[float(text), 1.0] for text in texts], np.float32))

    def infer(self, model, inputs, outputs=None, **kwargs):
        if self.url == FIRST:
            time.sleep(2 * REFRESH_S)
        return self._answer(inputs)

    def close(self):
        self.closed += 1


class _AsyncPod(_Pod):
    async def infer(self, model, inputs, outputs=None, **kwargs):
        if self.url == FIRST:
            await asyncio.sleep(2 * REFRESH_S)
        return self._answer(inputs)

    async def close(self):
        self.closed += 1


def _fleet(client_class, pod_class) -> dict:
    fleet = {"dns": _Dns(["10.0.0.1", "10.0.0.2", "10.0.0.3"])}
    fleet["pods"] = {url: pod_class(url, fleet) for url in (FIRST, SCALED_AWAY, LAST)}
    client = fleet["client"] = client_class(NAME, model="m", resolve=fleet["dns"], refresh_s=REFRESH_S)
    client.fleet._connect = fleet["pods"].__getitem__  # stand-ins for the connections the name's pods get
    client._info["m"] = ModelInfo("m", "embedding", 64, dimensions=2)
    return fleet


def _check(fleet: dict, vectors: np.ndarray) -> None:
    assert vectors.tolist() == [7.0, 1.0]
    assert {url: pod.tried for url, pod in fleet["pods"].items()} == {FIRST: 1, SCALED_AWAY: 1, LAST: 1}
    assert fleet["client"].fleet.replicas.urls == [FIRST, LAST] and dict(fleet["client"].replicas.served) == {LAST: 1}


def _closed(fleet: dict) -> dict:
    return {url: pod.closed for url, pod in fleet["pods"].items()}


def test_a_replica_retired_during_a_pass_is_still_tried_from_the_pass_and_the_call_fails_over():
    fleet = _fleet(EncoderClient, _Pod)
    with fleet["client"] as client:
        _check(fleet, client.embed("7"))
        assert _closed(fleet) == {FIRST: 0, SCALED_AWAY: 1, LAST: 0}  # closed once the pass was done with it
        assert SCALED_AWAY not in client.fleet.clients and len(client.fleet.connections()) == 2
    assert _closed(fleet) == {FIRST: 1, SCALED_AWAY: 1, LAST: 1}  # each closed once in all


def test_a_retired_connection_stays_open_while_another_pass_holds_it():
    fleet = _fleet(EncoderClient, _Pod)
    client = fleet["client"]
    client.fleet.refresh()
    first, second = client.fleet.turn(), client.fleet.turn()
    assert [url for url, _ in first] == [FIRST, SCALED_AWAY, LAST]
    fleet["dns"].addresses = ["10.0.0.1", "10.0.0.3"]
    time.sleep(2 * REFRESH_S)
    client.fleet.refresh()
    assert client.fleet.done(first) == []  # the second pass still holds the retired replica
    assert client.fleet.done(second) == [fleet["pods"][SCALED_AWAY]]
    assert client.fleet.done(client.fleet.turn()) == []  # handed back once
    client.close()
    assert _closed(fleet) == {FIRST: 1, SCALED_AWAY: 0, LAST: 1}  # the fleet left closing it to the caller


def test_the_async_client_fails_over_past_a_replica_retired_during_its_pass():
    async def call():
        fleet = _fleet(AsyncEncoderClient, _AsyncPod)  # made in the loop that uses it
        async with fleet["client"] as client:
            vectors = await client.embed("7")
            assert _closed(fleet) == {FIRST: 0, SCALED_AWAY: 1, LAST: 0}
            return fleet, vectors
    fleet, vectors = asyncio.run(call())
    _check(fleet, vectors)
    assert _closed(fleet) == {FIRST: 1, SCALED_AWAY: 1, LAST: 1}
