"""Every path a run times, as measurements: the baselines and in-process peers, the served
configurations over each protocol, the HTTP gateway, and the peer libraries and servers."""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

from . import machine
from .measure import (
    BATCH32,
    CONCURRENT16,
    GATEWAY_PATH,
    GATEWAY_PROTOCOL,
    LATENCY1,
    OPENAI_PLAIN_PROTOCOL,
    PAIRED32,
    SEQ_LEN,
    SHORT32,
    TEI_PROTOCOL,
    Measurement,
    in_process_precision,
    one_by_one,
    timed,
)
from .prepare import Setup
from .run_size import RunSize

log = logging.getLogger("nexus_sli.bench")


@dataclass
class InProcess:
    path: str
    precision: str
    encoder: object
    baseline: bool = False      # a baseline candidate: the fastest candidate of each mode is the reference
    threads: int | None = None  # torch intra-op threads (None: not a torch path)
    torch: bool = False
    latency: bool = False       # also timed on single queries (the default graph: target (c)'s overhead)


def baselines(setup: Setup) -> list[InProcess]:
    """sentence-transformers at each torch thread count (:func:`runners.torch_thread_counts`); for a
    bare checkpoint, PyTorch fp32 with the model's pooling."""
    from .runners import SentenceTransformersEncoder, TorchEncoder, has_sentence_transformers_config, torch_thread_counts

    threads = torch_thread_counts()
    if has_sentence_transformers_config(setup.model_dir):
        model = SentenceTransformersEncoder.load(setup.model_dir)
        return [InProcess("sentence-transformers", "fp32", SentenceTransformersEncoder(model, n), True, n, True)
                for n in threads]
    # No sentence-transformers folder (a bare checkpoint): the baseline is PyTorch fp32 with the
    # model's pooling, the reference the exporter itself validates against.
    fp32 = setup.facts["fp32"]
    log.warning("%s has no sentence-transformers config: the baseline falls back to PyTorch fp32 "
                "with %s pooling", setup.model_id, fp32.pooling)
    model = TorchEncoder.load(setup.model_dir)
    return [InProcess("pytorch (baseline fallback)", "fp32", TorchEncoder(model, fp32, threads=n), True, n, True)
            for n in threads]


def in_process_peers(setup: Setup, run_size: RunSize) -> list[InProcess]:
    """transformers' AutoModel where ``run_size`` asks for it, and each exported graph in process."""
    from .runners import GraphEncoder, TorchEncoder

    fp32, peers = setup.facts["fp32"], []
    if run_size.torch_peers:
        model = TorchEncoder.load(setup.model_dir)
        peers.append(InProcess("pytorch", "fp32", TorchEncoder(model, fp32), torch=True))
        if machine.supports_bf16():
            peers.append(InProcess("pytorch", "bf16 autocast", TorchEncoder(model, fp32, bf16=True), torch=True))
        else:
            setup.skipped.append({"path": "pytorch bf16", "mode": "all", "reason": "the CPU has no bf16 support"})
    default = setup.default["label"] if setup.default else None
    for label in setup.names:
        encoder = GraphEncoder.for_model(setup.repository, setup.facts[label])
        peers.append(InProcess(encoder.path, in_process_precision(label), encoder, latency=label == default))
    return peers


def calibrate_torch_threads(candidates: list[InProcess], peers: list[InProcess], texts: list[str]) -> dict:
    """The PyTorch peers run at the thread count the baseline was fastest with on ``texts``
    (which also warms the baseline up); the baseline itself keeps both, measured side by side."""
    seconds = {}
    for candidate in candidates:
        timings = []
        for _ in range(2):
            started = time.perf_counter()
            candidate.encoder(texts)
            timings.append(time.perf_counter() - started)
        seconds[candidate.threads] = min(timings)
    best = min(seconds, key=seconds.get)
    for peer in peers:
        if peer.torch:
            peer.threads = peer.encoder.threads = best
    return {"peers": best, "calibration_s": {str(k): round(v, 3) for k, v in seconds.items()},
            "calibration_texts": len(texts)}


def groups(setup: Setup) -> dict:
    """The texts of each group of rows, with their token counts."""
    from .runners import token_counts

    fp32 = setup.facts["fp32"]
    return {
        "set": dict(texts=setup.texts, token_counts=setup.tokens, sliced=True),
        "latency": dict(texts=setup.queries, token_counts=token_counts(fp32, setup.queries)),
        # every short text in each repetition, unsliced: a slice would hold two batches of 32
        "short": dict(texts=setup.short, token_counts=token_counts(fp32, setup.short)),
        "seq": {n: dict(texts=texts, token_counts=token_counts(fp32, texts), seq_len=n)
                for n, texts in setup.sweep.items()},
    }


def in_process_measurements(setup: Setup, run_size: RunSize, encoders: list[InProcess]) -> list[Measurement]:
    texts, measurements = groups(setup), []
    for p in encoders:
        common = dict(path=p.path, precision=p.precision, protocol="in-process", baseline=p.baseline,
                      threads=p.threads)
        measurements.append(Measurement(mode=BATCH32, run=timed(p.encoder), **texts["set"], **common))
        if p.baseline and setup.short:
            measurements.append(Measurement(mode=SHORT32, run=timed(p.encoder), **texts["short"], **common))
        if p.baseline or p.latency:
            measurements.append(Measurement(mode=LATENCY1, run=one_by_one(p.encoder, run_size.latency_budget_s),
                                            **texts["latency"], **common))
        if p.baseline:
            measurements += [Measurement(mode=SEQ_LEN, run=timed(p.encoder), **group, **common)
                             for group in texts["seq"].values()]
    return measurements


#: the modes each gateway route is timed in: OpenAI's through the SDK in every mode, beside the direct
#: gRPC rows; TEI's on single queries, the layer a query pays for beside the client's own protocols;
#: OpenAI's from a plain HTTP client on single queries, the route's cost without the SDK's
GATEWAY_MODES = {GATEWAY_PROTOCOL: (BATCH32, CONCURRENT16, LATENCY1), TEI_PROTOCOL: (LATENCY1,),
                 OPENAI_PLAIN_PROTOCOL: (LATENCY1,)}


def gateway_label(setup: Setup) -> str:
    """The configuration the gateway serves: the default, which the targets judge (fp32 when unknown)."""
    return setup.default["label"] if setup.default and setup.default["label"] in setup.names else "fp32"


def gateway_measurements(setup: Setup, run_size: RunSize, gateway, clients: list) -> list[Measurement]:
    """The default configuration through the HTTP gateway, each route with its own client
    (:data:`served.GATEWAY_EMBEDDERS`): beside the direct rows, its overhead is measured, not guessed."""
    from .served import GATEWAY_EMBEDDERS

    texts, label, measurements = groups(setup), gateway_label(setup), []
    for protocol, modes in GATEWAY_MODES.items():
        embedder = GATEWAY_EMBEDDERS[protocol](gateway.url, protocol, setup.names[label])
        clients.append(embedder)
        common = dict(path=GATEWAY_PATH, precision=label, protocol=protocol, served=True)
        runs = {BATCH32: embedder.batches, CONCURRENT16: embedder.concurrent,
                LATENCY1: functools.partial(embedder.sequential, budget_s=run_size.latency_budget_s)}
        measurements += [Measurement(mode=mode, run=runs[mode], **texts["latency" if mode == LATENCY1 else "set"],
                                     **common) for mode in modes]
    return measurements


def paired_measurements(setup: Setup, server, gateway, clients: list) -> list[Measurement]:
    """The default configuration's batches of 32 over gRPC (``EncoderClient``), through the OpenAI route
    with the ``openai`` SDK and through the same route from a plain HTTP client, sent in turn, request
    by request, on the same texts (bench/paired.py): target (f) compares the SDK's side with gRPC's, and
    timed as blocks their order would decide it; the plain side reads the route's own cost apart."""
    from .paired import TakingTurns
    from .served import GatewayEmbedder, OpenAIPlainEmbedder, ServedEmbedder

    label, senders = gateway_label(setup), []
    sides = (("triton", "grpc", ServedEmbedder, server.url("grpc")),
             (GATEWAY_PATH, GATEWAY_PROTOCOL, GatewayEmbedder, gateway.url),
             (GATEWAY_PATH, OPENAI_PLAIN_PROTOCOL, OpenAIPlainEmbedder, gateway.url))
    for _, protocol, embedder, url in sides:
        clients.append(embedder(url, protocol, setup.names[label]))  # closed by the caller, even on a failure
        senders.append(clients[-1].embed)
    turns, texts = TakingTurns(*senders), groups(setup)["set"]
    return [Measurement(path=path, precision=label, protocol=protocol, mode=PAIRED32, run=turns.side(which),
                        served=True, **texts)
            for which, (path, protocol, _, _) in enumerate(sides)]


def served_measurements(setup: Setup, run_size: RunSize, server, clients: list) -> list[Measurement]:
    """Every served configuration over each protocol ``run_size`` names; the sweep over the first only."""
    from .served import ServedEmbedder

    texts, measurements = groups(setup), []
    for precision, name in setup.names.items():
        for protocol in run_size.protocols:
            embedder = ServedEmbedder(server.url(protocol), protocol, name)
            clients.append(embedder)
            common = dict(path="triton", precision=precision, protocol=protocol, served=True)
            measurements += _served_rows(embedder, common, texts, run_size.latency_budget_s,
                                         sweep=protocol == run_size.protocols[0])
    return measurements


def _served_rows(embedder, common: dict, texts: dict, latency_budget_s: float, sweep: bool) -> list[Measurement]:
    """One served configuration over one protocol: batches, concurrent clients, single queries,
    short batches where the set has short texts, and the sequence-length sweep if ``sweep``."""
    single = functools.partial(embedder.sequential, budget_s=latency_budget_s)
    measurements = [
        Measurement(mode=BATCH32, run=embedder.batches, **texts["set"], **common),
        Measurement(mode=CONCURRENT16, run=embedder.concurrent, **texts["set"], **common),
        Measurement(mode=LATENCY1, run=single, **texts["latency"], **common),
    ]
    if texts["short"]["texts"]:
        measurements.append(Measurement(mode=SHORT32, run=embedder.batches, **texts["short"], **common))
    if sweep:
        measurements += [Measurement(mode=SEQ_LEN, run=embedder.batches, **group, **common)
                         for group in texts["seq"].values()]
    return measurements


def warm_up(measurements: list[Measurement], run_size: RunSize) -> None:
    for m in measurements:
        count = 4 if m.mode == LATENCY1 else run_size.warmup_texts if m.mode != SEQ_LEN else 32
        m.warm_up(m.texts[:count])


def peer_processes(setup: Setup, run_size: RunSize):
    """fastembed and infinity-emb, installed and started (or skipped with the reason), stopped on exit."""
    from .peers import NoPeers, Peers

    if not run_size.peers:
        setup.skipped.append({"path": "fastembed, infinity-emb (peers)", "mode": "all",
                              "reason": "a quick run leaves the peers out: the full bench (make bench) runs them"})
        return NoPeers()
    fp32 = setup.facts["fp32"]
    peers = Peers(setup.model_id, setup.model_dir, fp32, setup.skipped)
    setup.peers = peers.info
    return peers
