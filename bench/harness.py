"""One bench run: size it, export what is missing, build every path, warm up, time the paths
interleaved repetition by repetition, and summarise.

Each step has its own module: how much the run measures (bench/run_size.py), what it
exports and what ``auto`` chose (bench/exports.py), what the measurements need
(bench/prepare.py), the paths it times (bench/paths.py), the repetitions
(bench/repetitions.py) and the rows of the results (bench/results.py).
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timezone
from pathlib import Path

from nexus_sli.exporter.export.source import resolve_model

from . import machine, paths, texts as text_set
from .compute_limit import EncoderShape
from .layout import layout
from .measure import BATCH32, CONCURRENT16, Measurement
from .options import BenchOptions
from .prepare import Setup, prepare
from .repetitions import Repetitions, run_repetitions
from .results import batch_padding, rows, server_memory
from .run_size import RunSize, run_size_for, run_size_record

log = logging.getLogger("nexus_sli.bench")


def _idle_rss(server, samples: int = 5) -> list[int]:
    values = []
    for _ in range(samples):
        time.sleep(0.2)
        values.append(server.rss_bytes())
    return values


def measure(setup: Setup, run_size: RunSize, repetitions: Repetitions) -> tuple[list[Measurement], dict, dict]:
    """Every path built, warmed up and timed for ``repetitions``, with the server's memory sampled
    meanwhile: (the measurements, the server's memory, the torch thread calibration)."""
    from .served import Gateway, RssSampler, Server

    baselines, peers = paths.baselines(setup), paths.in_process_peers(setup, run_size)
    threads = paths.calibrate_torch_threads(baselines, peers, setup.texts[:run_size.warmup_texts])
    measurements = paths.in_process_measurements(setup, run_size, [*baselines, *peers])
    clients: list = []
    with paths.peer_processes(setup, run_size) as peer_processes, Server(setup.repository) as server, \
            Gateway(server.url("grpc")) as gateway:
        try:
            measurements += peer_processes.measurements(paths.groups(setup), run_size.latency_budget_s)
            measurements += paths.served_measurements(setup, run_size, server, clients)
            measurements += paths.gateway_measurements(setup, run_size, gateway, clients)
            measurements += paths.paired_measurements(setup, server, gateway, clients)
            log.info("warming up %d measurements", len(measurements))
            paths.warm_up(measurements, run_size)
            idle = _idle_rss(server)
            processes = len(machine.process_tree(server.process.pid))
            with RssSampler(server) as sampler:
                run_repetitions(measurements, repetitions, sampler)
        finally:
            for client in clients:
                client.close()
    return measurements, server_memory(idle, sampler.samples, processes), threads


def run_bench(options: BenchOptions) -> dict:
    """Measure, write ``latest.json``, ``latest.md`` and ``latest.png`` under ``options.out``."""
    from . import compute_limit, report
    from .targets import evaluate

    started = time.perf_counter()
    run_size, shape = run_size_for(options)
    log.info("run size: %s (%s: %.0f M matmul FLOPs per token)", run_size.name, resolve_model(options.model).model_id,
             shape.flops_per_token() / 1e6)
    info, checkout = machine.machine_info(), machine.checkout()  # the checkout before the run writes results
    setup = prepare(options, run_size)
    repetitions = Repetitions.for_run_size(run_size, options.repetitions, setup.default)
    measurements, memory, threads = measure(setup, run_size, repetitions)
    stack = stack_ceiling(options)
    if stack is not None:
        save_stack_ceiling(stack, Path(options.out))
    table = rows(measurements)
    limit = compute_limit.summary(setup.model_dir, setup.tokens, table, (BATCH32, CONCURRENT16))
    results = {
        **_about(options, setup, info, checkout),
        "settings": _settings(options, setup, run_size, shape, repetitions, threads),
        "text_set": _text_set(setup),
        "server_memory": memory, "rows": table, "skipped": setup.skipped, "peers": setup.peers,
        "targets": evaluate(table, setup.default, limit), "compute_limit": limit,
        "duration_s": round(time.perf_counter() - started, 1),
    }
    report.write_all(results, Path(options.out), options.benchmarks_md)
    return results


def stack_ceiling(options: BenchOptions) -> dict | None:
    """The served stack's ceiling (bench/stack_ceiling.py), on the packaged model's full runs only: it serves
    a model of its own, whatever model the run measures, and takes minutes a smoke run has not."""
    from . import stack_ceiling as ceiling

    if options.model is not None or options.quick:
        return None
    return ceiling.measure(Path(layout(None).repository).parent / ".stack")


def save_stack_ceiling(stack: dict, out: Path) -> None:
    """The ceiling's record beside the run's (``stack_ceiling.json``): a run of its own (``--stack-only``)
    replaces it without touching the last full run's figures, which stay their CPU class's kept run."""
    import json

    from .stack_ceiling import RECORD

    out.mkdir(parents=True, exist_ok=True)
    (out / RECORD).write_text(json.dumps(stack, indent=2) + "\n")


def run_stack_only(options: BenchOptions) -> dict:
    """The ceiling measured again (:func:`stack_ceiling`), saved beside the last run's results in
    ``options.out``, and the page written again with it."""
    import json

    from . import report

    latest = Path(options.out) / "latest.json"
    if not latest.is_file():
        raise FileNotFoundError(f"{latest} is missing: run the bench once first (make bench)")
    stack = stack_ceiling(options)
    if stack is None:
        raise ValueError("the served stack's ceiling is measured on the packaged model's full runs only")
    save_stack_ceiling(stack, Path(options.out))
    report.write_all(json.loads(latest.read_text()), Path(options.out), options.benchmarks_md)
    return stack


def _about(options: BenchOptions, setup: Setup, info: dict, checkout: dict) -> dict:
    """What ran, where, on what: the head of ``latest.json``."""
    return {
        "schema": 1,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": options.command,
        "quick": options.quick,
        "layout": layout(options.model).record(options.repository, options.out, options.benchmarks_md),
        "model": setup.model_id,
        "served_models": setup.names,
        "machine": info,
        "libraries": machine.library_versions(),
        "checkout": checkout,
        "default_configuration": setup.default,
    }


def _settings(options: BenchOptions, setup: Setup, run_size: RunSize, shape: EncoderShape,
              repetitions: Repetitions, threads: dict) -> dict:
    """How the run measured: its size (the page's "plan"), repetitions, clients and texts."""
    return {"plan": run_size_record(run_size, shape, options.quick, len(text_set.bench_texts())),
            "repetitions": repetitions.done, "repetition_plan": repetitions.record(),
            "batch_size": 32, "concurrent_clients": 16,
            "latency_queries": len(setup.queries), "protocols": list(run_size.protocols),
            "latency_budget_s": run_size.latency_budget_s, "seq_lens": sorted(setup.sweep),
            "warmup_texts": run_size.warmup_texts, "torch_threads": threads}


def _text_set(setup: Setup) -> dict:
    """The texts' token lengths, and how much of a served batch of 32 is real tokens."""
    from .runners import token_counts

    fp32 = setup.facts["fp32"]
    stats = text_set.length_stats(token_counts(fp32, setup.texts, truncate=False), fp32.max_length)
    return {**stats, **batch_padding(setup.tokens, fp32)}
