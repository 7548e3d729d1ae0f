"""``nexus-sli``: the command line.  Thin: parse, call, print; heavy imports inside commands."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from nexus_sli.exporter.errors import NexusError
from nexus_sli.tasks import TaskError


def _export(args: argparse.Namespace) -> int:
    from nexus_sli.exporter.export.pipeline import ExportOptions, run_export

    result = run_export(ExportOptions(
        model=args.model or None, task=args.task, precision=args.precision, backend=args.backend,
        name=args.name or None,
        out=Path(args.out), allow_pickle=args.allow_pickle, allow_degraded=args.allow_degraded,
        truncate=not args.no_truncate,
        cache=not args.no_cache, cache_dir=Path(args.cache_dir) if args.cache_dir else None,
    ))
    summary = {k: result.report[k] for k in ("precision", "backend", "graph", "max_abs_diff", "cosine_min", "cosine_mean", "passed")}
    print(json.dumps({"name": result.name, **summary}))
    return 0


def _serve(args: argparse.Namespace) -> int:
    from nexus_sli.exporter.serving.server import serve_forever

    return serve_forever(Path(args.model_repository), args.http_port, args.grpc_port, args.metrics_port, args.host)


def _bench(args: argparse.Namespace) -> int:
    from nexus_sli.bench.cli import run

    return run(args)


def _client_call(args: argparse.Namespace) -> int:
    """embed / classify / ner / answer / rerank: one call, JSON on stdout."""
    import dataclasses

    from nexus_sli.client import ClientError, EncoderClient

    try:
        with EncoderClient(args.url, protocol=args.protocol) as client:
            if args.command == "embed":
                result = client.embed(args.texts, model=args.model).tolist()
            elif args.command == "classify":
                result = client.classify(args.texts, model=args.model, top_k=args.top_k)
            elif args.command == "ner":
                result = client.ner(args.texts, model=args.model)
            elif args.command == "answer":
                result = client.answer(args.question, args.context, model=args.model, top_k=args.top_k)
            else:
                result = client.rerank(args.query, args.documents, model=args.model, top_k=args.top_k)
    except ClientError as exc:
        print(f"nexus-sli: error: {exc}", file=sys.stderr)
        return 3
    print(json.dumps(result, default=lambda o: dataclasses.asdict(o)))
    return 0


def _add_client_commands(commands) -> None:
    def command(name: str, help_text: str):
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("--model", required=True, help="model name in the repository")
        sub.add_argument("--url", default=None, help="server address (default 127.0.0.1:8001 gRPC / :8000 HTTP)")
        sub.add_argument("--protocol", default="grpc", choices=["grpc", "http"])
        sub.set_defaults(run=_client_call)
        return sub

    command("embed", "embed texts").add_argument("texts", nargs="+")
    classify = command("classify", "classify texts")
    classify.add_argument("texts", nargs="+")
    classify.add_argument("--top-k", type=int, default=1)
    command("ner", "named entities in texts").add_argument("texts", nargs="+")
    answer = command("answer", "extractive question answering")
    answer.add_argument("question")
    answer.add_argument("--context", required=True)
    answer.add_argument("--top-k", type=int, default=1)
    rerank = command("rerank", "rank documents by relevance to a query")
    rerank.add_argument("query")
    rerank.add_argument("documents", nargs="+")
    rerank.add_argument("--top-k", type=int, default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nexus-sli", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    export = commands.add_parser("export", help="export a model into a Triton model repository")
    export.add_argument("--model", default="", help="hub id or local directory (default: packaged all-MiniLM-L6-v2)")
    export.add_argument("--task", default="auto",
                        help="embedding, classification, token-classification, question-answering, rerank "
                             "(default: inferred from the config's architectures)")
    export.add_argument("--precision", default="auto",
                        help="fp32 or int8; with --backend openvino also bf16 (fp32 where the CPU has no bf16); "
                             "auto (default): this CPU's default, see the README's 'Choosing a backend'")
    export.add_argument("--backend", default="auto", choices=["auto", "onnxruntime", "openvino"],
                        help="the Triton backend that serves the encoder; auto (default): openvino with bf16 "
                             "where the CPU has bf16 matmuls, else onnxruntime")
    export.add_argument("--name", default="", help="model name in the repository (default: from the model id)")
    export.add_argument("--out", default="model_repository", help="repository directory")
    export.add_argument("--allow-pickle", action="store_true", help="allow pytorch_model.bin (pickle) weights")
    export.add_argument("--allow-degraded", action="store_true",
                        help="write the model even when validation fails (recorded in validation.json)")
    export.add_argument("--no-truncate", action="store_true",
                        help="reject texts longer than the model's limit instead of truncating them")
    export.add_argument("--no-cache", action="store_true",
                        help="read every layer from the checkpoint; neither use nor fill the layer cache")
    export.add_argument("--cache-dir", default="",
                        help="layer cache directory (default: $NEXUS_SLI_CACHE_DIR, else "
                             "${XDG_CACHE_HOME:-~/.cache}/nexus-sli/layers)")
    export.set_defaults(run=_export)

    serve = commands.add_parser("serve", help="start the Triton server on a model repository")
    serve.add_argument("--model-repository", default="model_repository")
    serve.add_argument("--http-port", type=int, default=8000)
    serve.add_argument("--grpc-port", type=int, default=8001)
    serve.add_argument("--metrics-port", type=int, default=8002)
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default loopback only; see the README before exposing it)")
    serve.set_defaults(run=_serve)

    from nexus_sli.bench.cli import add_arguments as add_bench_arguments  # argparse only; cheap

    bench = commands.add_parser("bench", help="benchmark the served model against in-process peers")
    add_bench_arguments(bench)
    bench.set_defaults(run=_bench)
    _add_client_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Libraries (the ORT optimizer above all) log chattily at INFO; only ours speaks at INFO.
    logging.basicConfig(level=logging.WARNING, format="nexus-sli: %(message)s", stream=sys.stderr)
    logging.getLogger("nexus_sli").setLevel(logging.INFO)
    try:
        return args.run(args)
    except (NexusError, TaskError) as exc:
        print(f"nexus-sli: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
