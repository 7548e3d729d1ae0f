"""Requests spread over every Triton replica behind one name, as over a Kubernetes headless Service.

Three real ``tritonserver`` replicas on loopback, each on its own address (127.0.0.1,
127.0.0.2, 127.0.0.3) with the same ports, as pods behind one Service name.  The
name is resolved by a resolver hook that answers what a headless Service's DNS
answers: the addresses of the pods that are up.  16 concurrent clients, through the
Python client and through the gateway: every replica serves a share (Triton's own
per-server statistics), one SIGKILLed under load costs no request, and a fourth one
started later receives requests within the client's refresh bound.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from starlette.testclient import TestClient

from helpers.servers import end_now, kill_server
from helpers.waiting import wait_until
from nexus_sli.bench.served import free_ports
from nexus_sli.client import EncoderClient
from nexus_sli.client.replicas import Resolved, system_resolve
from nexus_sli.exporter.export.pipeline import ExportOptions, run_export
from nexus_sli.exporter.export.validate import validation_texts
from nexus_sli.exporter.serving import server as serve
from nexus_sli.gateway import GatewayConfig, create_app

NAME = "fleet-headless"
MODEL = "embedder"
CLIENTS = 16
#: how often the clients resolve the name again here (the default is 10 s): the bound a new pod waits
REFRESH_S = 2.0
TEXTS = validation_texts()[:32]


class Dns:
    """What a headless Service's DNS answers: the addresses of the ready pods, changed by the test."""

    def __init__(self, addresses: list[str]):
        self.addresses = list(addresses)
        self.lock = threading.Lock()

    def __call__(self, host: str, port: int) -> list[str]:
        if host != NAME:
            raise socket.gaierror(socket.EAI_NONAME, f"{host} is not known")
        with self.lock:
            return list(self.addresses)

    def set(self, addresses: list[str]) -> None:
        with self.lock:
            self.addresses = list(addresses)


def _loopback_address_works(address: str) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_checkpoint):
    """Three replicas of one repository on 127.0.0.1-3, same ports; a fourth address kept for later."""
    if not all(_loopback_address_works(f"127.0.0.{i}") for i in range(1, 5)):
        pytest.skip("this machine's loopback takes only 127.0.0.1 (Linux routes all of 127/8 to it)")
    root = tmp_path_factory.mktemp("fleet")
    run_export(ExportOptions(model=str(tiny_checkpoint("bert")), name=MODEL, out=root / "repo"))
    http, grpc, metrics = free_ports(3)
    state = {"root": root, "ports": (http, grpc, metrics), "servers": {}}

    def start(address: str) -> None:
        log = open(root / f"{address}.log", "wb")
        state["servers"][address] = serve.start(root / "repo", http, grpc, metrics, host=address, stdout=log,
                                                stderr=log)

    state["start"] = start
    with ThreadPoolExecutor(3) as pool:  # the replicas start side by side, as pods do
        list(pool.map(start, ["127.0.0.1", "127.0.0.2", "127.0.0.3"]))
    yield state
    for process in state["servers"].values():
        end_now(process)


def _successes(address: str, http_port: int) -> int:
    """The requests one replica answered, from Triton's own statistics."""
    with urllib.request.urlopen(f"http://{address}:{http_port}/v2/models/{MODEL}/stats", timeout=10) as response:
        stats = json.loads(response.read())["model_stats"]
    return sum(int(entry["inference_stats"]["success"]["count"]) for entry in stats)


def _kill(process) -> None:
    """A pod that dies: SIGKILL to the server, its python-backend processes ended after it."""
    kill_server({"process": process})


class Load:
    """``CLIENTS`` threads calling ``embed`` until stopped; failures and answers unlike ``reference`` are
    kept (no reference: ``embed`` checks its answers itself)."""

    def __init__(self, embed, reference: np.ndarray | None):
        self.embed, self.reference = embed, reference
        self.stop, self.done = threading.Event(), 0
        self.failures: list[str] = []
        self.wrong = 0
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(n,), daemon=True) for n in range(CLIENTS)]

    def _run(self, number: int) -> None:
        rng = np.random.default_rng(number)
        while not self.stop.is_set():
            picked = sorted(rng.choice(len(TEXTS), size=int(rng.integers(1, 4)), replace=False))
            try:
                vectors = self.embed(number, [TEXTS[i] for i in picked])
            except Exception as exc:  # noqa: BLE001 - every failure is counted, none may happen
                self.failures.append(repr(exc))
                continue
            with self.lock:
                self.done += 1
                if self.reference is not None:
                    self.wrong += int(not np.allclose(vectors, self.reference[picked], atol=1e-4))

    def __enter__(self) -> "Load":
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)

    def wait_for(self, condition, what: str, timeout: float = 60.0) -> None:
        def holds() -> bool:
            assert not self.failures, self.failures[:3]
            return condition()

        wait_until(holds, what, timeout)


def test_a_name_resolves_through_the_system_resolver_by_default():
    assert "127.0.0.1" in system_resolve("localhost", 8001)
    with pytest.raises(ValueError, match="is not dns:///HOST:PORT"):
        Resolved("dns:///no-port")
    with pytest.raises(ValueError, match="one dns:///HOST:PORT name or a list of addresses, not both"):
        EncoderClient(["dns:///a:8001", "b:8001"])
    empty = EncoderClient(f"dns:///{NAME}:1", resolve=Dns([]), retry_s=0.3, model=MODEL)
    with pytest.raises(Exception, match=f"dns:///{NAME}:1 resolves to no server"):
        empty.embed("text")


def _alive(fleet) -> list[str]:
    """The addresses of the replicas that run now (a test before this one may have killed one)."""
    return [address for address, process in fleet["servers"].items() if process.poll() is None]


def _spread_over_the_fleet(fleet, embed, grow_to: str | None = None):
    """Load through ``embed``: every replica serves a share; one killed costs nothing; a new one joins."""
    http = fleet["ports"][0]
    servers, dns = fleet["servers"], fleet["dns"]
    alive = _alive(fleet)
    before = {a: _successes(a, http) for a in alive}
    with Load(embed, fleet["reference"]) as load:
        load.wait_for(lambda: all(_successes(a, http) - before[a] >= 20 for a in alive),
                      "every replica to serve a share")
        victim = alive[0]
        served_at_kill = load.done
        _kill(servers[victim])
        dns.set([a for a in alive if a != victim])  # the pod is gone from the Service's endpoints
        load.wait_for(lambda: load.done - served_at_kill >= 300, "300 requests after the kill")
        if grow_to is not None:
            fleet["start"](grow_to)
            dns.set([*dns.addresses, grow_to])
            added_at = time.monotonic()
            load.wait_for(lambda: _successes(grow_to, http) >= 20, "the new replica to serve requests",
                          timeout=REFRESH_S + 30)
            joined_after = time.monotonic() - added_at
    assert load.failures == [] and load.wrong == 0
    assert load.done - served_at_kill >= 300
    return (joined_after if grow_to is not None else None), victim


def test_clients_spread_over_every_replica_lose_nothing_when_one_dies_and_find_a_new_one(fleet):
    alive = _alive(fleet)
    fleet = {**fleet, "dns": Dns(alive)}
    fleet["reference"] = EncoderClient(f"{alive[-1]}:{fleet['ports'][1]}", model=MODEL).embed(TEXTS)
    clients = [EncoderClient(f"dns:///{NAME}:{fleet['ports'][1]}", model=MODEL, resolve=fleet["dns"],
                             refresh_s=REFRESH_S) for _ in range(CLIENTS)]
    joined_after, victim = _spread_over_the_fleet(fleet, lambda n, texts: clients[n].embed(texts),
                                                  grow_to="127.0.0.4")
    # the new replica got requests (within _spread_over_the_fleet's wait); how soon is printed, not asserted
    port = fleet["ports"][1]
    assert all(f"127.0.0.4:{port}" in c.replicas.urls for c in clients)  # every client found it
    assert sum(c.replicas.served[f"127.0.0.4:{port}"] for c in clients) > 0
    assert all(f"{victim}:{port}" not in c.replicas.urls for c in clients)  # dropped at the next resolution
    print(f"client: the new replica served requests {joined_after:.1f} s after it joined the name")


def test_the_gateway_spreads_over_every_replica_and_loses_nothing(fleet):
    """The gateway given ``dns:///NAME:PORT``, in process (the resolver hook is an argument of create_app),
    called by 16 threads: the same checks over the replicas that run (in any order of the tests)."""
    alive = _alive(fleet)
    # the API's unit vectors, as one replica answers them
    reference = EncoderClient(f"{alive[-1]}:{fleet['ports'][1]}", model=MODEL).embed(TEXTS)
    fleet = {**fleet, "dns": Dns(alive), "reference": reference / np.linalg.norm(reference, axis=1, keepdims=True)}
    config = GatewayConfig(triton=f"dns:///{NAME}:{fleet['ports'][1]}")
    with TestClient(create_app(config, resolve=fleet["dns"])) as gateway:
        def embed(_, texts):
            response = gateway.post("/v1/embeddings", json={"model": MODEL, "input": texts})
            assert response.status_code == 200, response.text
            return np.array([d["embedding"] for d in response.json()["data"]], dtype=np.float32)

        _spread_over_the_fleet(fleet, embed)


# --- a new version rolled out under load ----------------------------------------------------------

BUCKET = "models"


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_tokenizer):
    """SeaweedFS on loopback holding the embedder's first version; the AWS variables set for Triton."""
    from helpers import object_store
    from helpers.tiny_models import build_tiny

    root = tmp_path_factory.mktemp("rollout")
    old, new = (build_tiny("bert", root / f"checkpoint-{seed}", tiny_tokenizer, seed=seed) for seed in (0, 1))
    with object_store.serving(root, BUCKET) as s3:
        yield {"s3": s3, "root": root, "checkpoints": {"old": old, "new": new},
               "reference": {v: object_store.torch_embeddings(c, TEXTS) for v, c in (("old", old), ("new", new))}}


def _publish(store, version: str) -> None:
    from nexus_sli.exporter.triton import publish as pub

    repo = store["root"] / f"repo-{version}"
    run_export(ExportOptions(model=str(store["checkpoints"][version]), name=MODEL, out=repo))
    pub.publish(repo, pub.Destination.parse(f"s3://{BUCKET}/fleet", store["s3"].endpoint))


def test_a_new_version_rolls_out_under_load_with_no_failed_request(store):
    """docs/deployment.md's recipe, "A new model version with no failed request", on loopback: two replicas
    read the store, a new version is published under load, then each replica is replaced one at a time
    (maxSurge 1, maxUnavailable 0: the new pod ready first, the old one out of the Service's answers before
    it is stopped).  No request fails, and every answer is wholly one version's (rows never mixed)."""
    if not all(_loopback_address_works(f"127.0.0.{i}") for i in range(5, 9)):
        pytest.skip("this machine's loopback takes only 127.0.0.1")
    _publish(store, "old")
    http, grpc, metrics = free_ports(3)
    servers: dict[str, object] = {}

    def start(address: str) -> None:
        log = open(store["root"] / f"{address}.log", "wb")
        servers[address] = serve.start(store["s3"].triton_url(BUCKET, "fleet"), http, grpc, metrics, host=address,
                                       stdout=log, stderr=log)

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(start, ["127.0.0.5", "127.0.0.6"]))
    dns = Dns(["127.0.0.5", "127.0.0.6"])
    clients = [EncoderClient(f"dns:///{NAME}:{grpc}", model=MODEL, resolve=dns, refresh_s=REFRESH_S)
               for _ in range(CLIENTS)]
    versions = {"old": 0, "new": 0}
    reference = store["reference"]

    def embed(number: int, texts: list[str]) -> np.ndarray:
        vectors = clients[number].embed(texts)
        rows = [TEXTS.index(t) for t in texts]
        matches = [v for v in ("old", "new") if np.allclose(vectors, reference[v][rows], atol=1e-4)]
        assert len(matches) == 1, f"an answer from neither version, or mixed: {matches}"
        versions[matches[0]] += 1
        return vectors

    try:
        with Load(embed, None) as load:
            load.wait_for(lambda: load.done >= 200, "200 requests on the first version")
            _publish(store, "new")  # running pods keep what they loaded: model control is off
            load.wait_for(lambda: load.done >= 400, "200 more requests after the publish")
            assert versions["new"] == 0, "a running replica switched versions under its clients"
            for old, replacement in (("127.0.0.5", "127.0.0.7"), ("127.0.0.6", "127.0.0.8")):
                start(replacement)  # the surge pod, ready before an old one goes
                dns.set([*dns.addresses, replacement])
                dns.set([a for a in dns.addresses if a != old])  # the old pod leaves the endpoints...
                # ... and keeps answering (preStop) until every client resolved the name again without it
                load.wait_for(lambda: not any(url.startswith(f"{old}:") for client in clients
                                              for url in client.replicas.urls), f"every client to drop {old}")
                serve.stop(servers[old])
            load.wait_for(lambda: versions["new"] >= 200, "200 requests on the new version")
    finally:
        for process in servers.values():
            end_now(process)
    # Load counts an assertion error in embed() as a failure: none, so no answer mixed versions
    assert load.failures == [], load.failures[:3]
    assert versions["old"] >= 400 and versions["new"] >= 200, versions
