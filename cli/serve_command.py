"""``nexus-sli serve``: the Triton server on a model repository."""

from __future__ import annotations

import argparse
import importlib.util
import signal
import sys
from pathlib import Path

from .arguments import batch_rows, port, port_or_0
from .interrupts import interrupt_on_sigterm


def add_parser(commands) -> None:
    serve = commands.add_parser("serve", help="start the Triton server on a model repository")
    serve.add_argument("--model-repository", default="model_repository",
                       help="a folder, or object storage: s3://HOST:PORT/bucket/prefix (credentials from the "
                            "standard AWS environment; docs/deployment.md)")
    serve.add_argument("--http-port", type=port, default=8000)
    serve.add_argument("--grpc-port", type=port, default=8001)
    serve.add_argument("--metrics-port", type=port, default=8002)
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default loopback only; see docs/serving.md before exposing it)")
    serve.add_argument("--gateway-port", type=port_or_0, default=8080,
                       help="port of the HTTP gateway (OpenAI /v1/embeddings, TEI /embed ...) started beside the "
                            "server on the same host; 0: no gateway (docs/gateway.md)")
    serve.add_argument("--gpu-models-on-cpu", action="store_true",
                       help="where there is no GPU, serve KIND_GPU models on the CPU (a logged, temporary "
                            "override; the repository keeps KIND_GPU; docs/gpu.md)")
    serve.add_argument("--separate-steps", action="store_true",
                       help="serve each ensemble as exported, its steps in separate processes (by default each "
                            "batched ensemble's steps run in one process, which a short query crosses faster; "
                            "docs/serving.md)")
    _add_first_export_options(serve)
    serve.set_defaults(run=run)


def _add_first_export_options(serve: argparse.ArgumentParser) -> None:
    """What a repository folder with no model gets: the model exported in ONNX Runtime fp32 (one graph, no
    search) and served at once, then the export asked for searched in the background and swapped in."""
    from nexus_sli.exporter.targets import AUTO, TARGETS, precisions

    first = serve.add_argument_group(
        "a repository with no model", "exported first in ONNX Runtime fp32 (no search) and served at once; the "
        "export asked for (auto: the fastest faithful graph) runs in the background and is swapped in when it "
        "wins, with no failed call (docs/serving.md). A repository that holds a model is served as it is.")
    first.add_argument("--model", default="", help="as for export (default: packaged all-MiniLM-L6-v2)")
    first.add_argument("--task", default="auto", help="as for export")
    first.add_argument("--name", default="", help="as for export")
    first.add_argument("--backend", default=AUTO, choices=[AUTO, *TARGETS], help="the search's, as for export")
    first.add_argument("--precision", default=AUTO, choices=[AUTO, *precisions()], help="the search's, as for export")
    first.add_argument("--optimize", default="balanced", choices=["balanced", "throughput", "latency"],
                       help="the search's, as for export")
    first.add_argument("--max-batch-size", type=batch_rows, default=None, metavar="ROWS", help="as for export")
    for flag in ("--allow-pickle", "--no-truncate", "--no-cache"):
        first.add_argument(flag, action="store_true", help="as for export")
    first.add_argument("--no-search", action="store_true",
                       help="serve the fp32 export and search for nothing faster")


def run(args: argparse.Namespace) -> int:
    from nexus_sli.exporter.serving.ports import check_free
    from nexus_sli.exporter.serving.search import (FIRST, BackgroundSearch, ModelChoice, export_first, holds_a_model,
                                                   remove_abandoned_searches)
    from nexus_sli.exporter.serving.server import is_remote, serve_forever
    from nexus_sli.exporter.serving.swap import retired_left

    # Started in the background by a shell without job control (a script's `&`), serve inherits SIGINT ignored,
    # and Python leaves it so: Ctrl-C's signal sent by `kill -INT` or a process manager would be lost, and with it
    # the clean stop (the search, the gateway, Triton).  The first export and the search inherit the handler's reset.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # SIGTERM (a process manager's stop) from the start: the first export and Triton's start stop their children
    # on the interrupt as they do on Ctrl-C, where the default action would leave them running
    interrupt_on_sigterm()

    # Path() would fold the '//' of an s3:// URL
    repository = args.model_repository if is_remote(args.model_repository) else Path(args.model_repository)
    search = None
    if not is_remote(repository):
        remove_abandoned_searches(repository)
        for folder in retired_left(repository):
            print(f"nexus-sli: {folder} holds models a swap took out of {repository} (a serve stopped during it, or "
                  "its undo failed): delete it once the repository serves what you expect, else move its models "
                  "back", file=sys.stderr, flush=True)
    first_export = not is_remote(repository) and not holds_a_model(repository)
    if not first_export and _first_export_options(args):
        print(f"nexus-sli: {repository} holds a model: served as it is ({', '.join(_first_export_options(args))} "
              "only apply to a folder with no model)", file=sys.stderr, flush=True)
    choice = ModelChoice(args.model, args.task, args.name, args.backend, args.precision, args.optimize,
                         args.allow_pickle, args.no_truncate, args.no_cache, args.max_batch_size)
    if first_export:
        # even --backend onnxruntime --precision fp32 searches: it times the fused graph beside the first export's
        _check_choice(choice, searches=not args.no_search)
        unused = [f"--{k}" for k in ("backend", "precision", "optimize") if getattr(args, k) != getattr(ModelChoice, k)]
        if args.no_search and unused:
            print(f"nexus-sli: {', '.join(unused)} only apply to the search, and --no-search runs none: serving "
                  f"{' '.join(FIRST)}", file=sys.stderr, flush=True)
    gateway = gateway_command(args)
    check_free(args.host, {"HTTP (--http-port)": args.http_port, "gRPC (--grpc-port)": args.grpc_port,
                           "metrics (--metrics-port)": args.metrics_port,
                           "the gateway (--gateway-port)": args.gateway_port if gateway else 0})
    if first_export:
        name = export_first(choice, repository)
        if not args.no_search:
            search = lambda server: BackgroundSearch(choice, repository, name, server, _search_threads())  # noqa: E731
    return serve_forever(repository, args.http_port, args.grpc_port, args.metrics_port, args.host,
                         args.gpu_models_on_cpu, beside=gateway, separate_steps=args.separate_steps,
                         background=search)


def _check_choice(choice, searches: bool) -> None:
    """The exports' options refused now, as the export would refuse them, not after the first one is served."""
    from nexus_sli.exporter.errors import NexusError
    from nexus_sli.exporter.targets import AUTO, configurations_for, get_target
    from nexus_sli.tasks import get_task

    if choice.task != "auto":
        get_task(choice.task)
    if searches and choice.backend != AUTO and get_target(choice.backend).device != "cpu":
        raise NexusError(f"--backend {choice.backend} runs on a GPU, and serve exports for this machine's CPU: "
                         "export for the GPU first (make export TARGET=gpu, docs/gpu.md), then serve that repository")
    if searches:
        configurations_for(choice.backend, choice.precision, device="cpu")


def _first_export_options(args: argparse.Namespace) -> list[str]:
    """The options for a folder with no model given other values than their defaults (ModelChoice's)."""
    from dataclasses import fields

    from nexus_sli.exporter.serving.search import ModelChoice

    given = [f"--{f.name.replace('_', '-')}" for f in fields(ModelChoice) if getattr(args, f.name) != f.default]
    return given + (["--no-search"] if args.no_search else [])


def _search_threads() -> dict[str, str]:
    """The background search's threads: half the cores, the rest left to the served model (unless the
    exporter's variable already says)."""
    import os

    from nexus_sli.exporter.export.threads import ENV

    return {ENV: os.environ.get(ENV) or str(max(1, (os.cpu_count() or 2) // 2))}


def gateway_command(args: argparse.Namespace) -> list[str] | None:
    """``nexus-sli gateway`` for this server (its API key from the environment), or None when
    turned off or when the gateway's packages are not installed (said, not fatal)."""
    if not args.gateway_port:
        return None
    from nexus_sli.gateway import REQUIRED_MODULES

    missing = [name for name in REQUIRED_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        print(f"nexus-sli: the HTTP gateway is not started: its packages are missing ({', '.join(missing)}; "
              "pip install 'nexus-sli[gateway]')", file=sys.stderr, flush=True)
        return None
    from nexus_sli.exporter.serving.server import client_host

    triton = client_host(args.host)  # the gateway beside Triton reaches it as a local client
    triton = f"[{triton}]" if ":" in triton else triton
    return [sys.executable, "-m", "nexus_sli.cli.main", "gateway", "--triton", f"{triton}:{args.grpc_port}",
            "--host", args.host, "--port", str(args.gateway_port)]
