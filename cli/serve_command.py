"""``nexus-sli serve``: the Triton server on a model repository."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(commands) -> None:
    serve = commands.add_parser("serve", help="start the Triton server on a model repository")
    serve.add_argument("--model-repository", default="model_repository")
    serve.add_argument("--http-port", type=int, default=8000)
    serve.add_argument("--grpc-port", type=int, default=8001)
    serve.add_argument("--metrics-port", type=int, default=8002)
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default loopback only; see docs/serving.md before exposing it)")
    serve.add_argument("--gpu-models-on-cpu", action="store_true",
                       help="where there is no GPU, serve KIND_GPU models on the CPU (a logged, temporary "
                            "override; the repository keeps KIND_GPU; docs/gpu.md)")
    serve.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from nexus_sli.exporter.serving.server import serve_forever

    return serve_forever(Path(args.model_repository), args.http_port, args.grpc_port, args.metrics_port, args.host,
                         args.gpu_models_on_cpu)
