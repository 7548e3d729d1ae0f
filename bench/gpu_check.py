"""The GPU repository's checks on a GPU host: the served path beside the exported graph in process and
sentence-transformers fp16 on the same GPU, and the graph's fidelity.

Run where ``onnxruntime-gpu``, PyTorch with CUDA and sentence-transformers are installed, on a
repository written by ``nexus-sli export --target gpu --accelerator cuda``::

    python -m nexus_sli.bench.gpu_check --repository REPO --model NAME --weights MODEL_DIR --out record.json

``--fused-repository``: the same model's repository with ONNX Runtime's fused graph (bench/gpu_fused.py), timed,
checked and served beside the exported one in the steps that say so.

Its steps (``--steps``; by default all but ``padding``, in this order, the most important first):

- ``environment``: versions, the GPU, the providers this onnxruntime has;
- ``speed``: the graph in process (the tokenizer step's bucket padding, then one ``session.run`` per
  batch), the fused graph likewise, and sentence-transformers fp16, interleaved round by round: short texts
  in batches of 32 and 256, long texts in batches of 32, and single short queries (p50, p99);
- ``joined``: the joined model (``nexus-sli serve``'s steps in one process) run in this process, step by step;
- ``served``: the repository served by ``nexus-sli serve`` on this GPU (bench/gpu_served.py), each
  variant of the served configuration in turn: throughput from client processes, single queries paired
  with the graph in process, GPU utilisation, the GPU memory the server holds, and the served vectors
  against the PyTorch fp32 reference the export stored;
- ``validate``: ``nexus-sli validate`` on the repository;
- ``fidelity``: the stored reference's inputs through the graph, the fused graph and sentence-transformers
  fp16;
- ``levers``: the graph in process with ONNX Runtime's I/O binding, the nodes ONNX Runtime places on the
  CPU, and CUDA graphs at one bucket, for each graph (last: a provider that refuses a capture may abort the
  process);
- ``padding``: what padding a batch to wider widths costs on the GPU.

Every cell of the record is written as it finishes (``--out``), so a run cut short keeps what it measured
(docs/gpu.md, "Served on a GPU").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
import traceback
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from pathlib import Path

import numpy as np

from nexus_sli.bench.gpu_paths import (
    GraphPath,
    Texts,
    encoder_session,
    latency,
    reference_batches,
    singles_ms,
)
from nexus_sli.bench.measure import cosines


class Record:
    """The JSON record, written to ``path`` whenever a cell is added."""

    def __init__(self, path: Path, command: str):
        self.path, self.data = path, {"command": command}

    def cell(self, step: str, name: str, value) -> None:
        self.data.setdefault(step, {})[name] = value
        self.save()

    def save(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repository", type=Path, required=True)
    parser.add_argument("--model", required=True, help="the model's name in the repository")
    parser.add_argument("--weights", type=Path, help="the sentence-transformers model folder (speed, fidelity)")
    parser.add_argument("--fused-repository", type=Path,
                        help="the model's repository with the fused graph (bench/gpu_fused.py), measured beside")
    parser.add_argument("--out", type=Path, required=True, help="the JSON record to write")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds in process")
    parser.add_argument("--seconds", type=float, default=4.0, help="each served load's window")
    parser.add_argument("--device", default="cuda", help="torch device for sentence-transformers (cpu: a dry run)")
    parser.add_argument("--serve-python", type=Path, default=Path(sys.executable),
                        help="the interpreter that runs nexus-sli serve (one with numpy<2: the python backend's)")
    parser.add_argument("--variants", default="", help="the served variants to run, comma-separated "
                                                       "(default: all, bench/gpu_served.py VARIANTS)")
    parser.add_argument("--steps", default=",".join(s for s in STEPS if s != "padding"),
                        help=f"which of {', '.join(STEPS)}, comma-separated")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    record = Record(args.out, "python -m nexus_sli.bench.gpu_check " + " ".join(argv))
    for name in args.steps.split(","):
        started = time.perf_counter()
        try:
            STEPS[name](args, lambda cell, value, step=name: record.cell(step, cell, value))
        except Exception:  # one failed step must not cost the others' results
            record.cell(name, "error", traceback.format_exc())
        record.cell(name, "seconds", round(time.perf_counter() - started, 1))
        print(f"gpu_check: {name} done in {record.data[name]['seconds']} s", flush=True)
    return 0


def environment(args, cell) -> None:
    found = {"python": platform.python_version(), "cpu": cpu_name()}
    with contextlib.suppress(ImportError):
        import torch  # first: its CUDA libraries are the ones the CUDA provider then finds

        found["torch"] = torch.__version__
        if args.device == "cuda":
            found.update(gpu=torch.cuda.get_device_name(0), capability=list(torch.cuda.get_device_capability(0)),
                         cuda=torch.version.cuda)
    for package in ("sentence-transformers", "numpy", "nvidia-pytriton", "tritonclient"):
        with contextlib.suppress(PackageNotFoundError):  # read, not imported
            found[package] = package_version(package)
    import onnxruntime as ort

    from nexus_sli.exporter.serving.backends.onnxruntime_providers import load_gpu_libraries

    found.update(onnxruntime=ort.__version__, onnxruntime_providers=ort.get_available_providers(),
                 gpu_libraries=load_gpu_libraries(ort) or "loaded")
    from nexus_sli.exporter.triton import config as tc

    encoder = tc.read(args.repository / f"{args.model}_encoder" / "config.pbtxt")
    found["accelerators"] = [a.name for a in encoder.optimization.execution_accelerators.gpu_execution_accelerator]
    for key, value in found.items():
        cell(key, value)


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine()


def validate(args, cell) -> None:
    """What ``nexus-sli validate`` runs, in this process (where the CUDA libraries are loaded)."""
    from nexus_sli.exporter.errors import ValidationError
    from nexus_sli.exporter.export.revalidate import revalidate

    try:
        cell("passed", True)
        cell("revalidation", revalidate(args.repository, args.model))
    except ValidationError as failed:
        cell("passed", False)
        cell("failure", str(failed))
        cell("revalidation", failed.report)


def fidelity(args, cell) -> None:
    """Sentence embeddings of the 240 validation texts against PyTorch fp32, for both fp16 paths."""
    import torch

    sessions = {"onnxruntime fp16 graph": encoder_session(args.repository, args.model)}
    if args.fused_repository is not None:
        sessions["onnxruntime fp16 fused graph"] = encoder_session(args.fused_repository, args.model)
    model = st_model(args.weights, args.device)
    found: dict[str, list] = {**{name: [] for name in sessions}, "sentence-transformers fp16": []}
    for inputs, want in reference_batches(args.repository, args.model):
        for name, (session, _) in sessions.items():
            found[name].append(cosines(session.run(["EMBEDDING"], inputs)[0], want))
        with torch.inference_mode():
            features = {k: torch.from_numpy(v).to(args.device) for k, v in inputs.items()}
            got = model(features)["sentence_embedding"].float().cpu().numpy()
        found["sentence-transformers fp16"].append(cosines(got, want))
    cell("reference", "PyTorch fp32 (stored at export)")
    cell("providers", {name: providers for name, (_, providers) in sessions.items()})
    for name, values in found.items():
        cell(name, {"texts": int(sum(len(c) for c in values)), "cosine_min": float(np.concatenate(values).min()),
                    "cosine_mean": float(np.concatenate(values).mean())})


def st_model(weights: Path, device: str):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(weights), device=device).half().eval()


def st_embedder(weights: Path, device: str):
    model = st_model(weights, device)
    return lambda texts: model.encode(texts, batch_size=len(texts), convert_to_numpy=True)


def texts_per_s(embed, calls: list[list[str]]) -> float:
    started = time.perf_counter()
    for texts in calls:
        embed(texts)
    return sum(len(t) for t in calls) / (time.perf_counter() - started)


def interleaved(paths: dict, calls: list[list[str]], rounds: int) -> dict:
    """Texts per second of each path (texts -> vectors) on ``calls``, the paths' order alternating round by
    round so that a drift of the machine falls on all of them; the median of the rounds, and the rounds."""
    for embed in paths.values():  # warm-up: every bucket width and the CUDA kernels' first launches
        texts_per_s(embed, calls)
    found: dict[str, list[float]] = {name: [] for name in paths}
    for r in range(rounds):
        for name in (list(paths) if r % 2 == 0 else list(reversed(paths))):
            found[name].append(texts_per_s(paths[name], calls))
    return {name: {"texts_per_s": float(np.median(v)), "rounds": v} for name, v in found.items()}


def speed(args, cell) -> None:
    """The graph in process and sentence-transformers fp16: each workload, then single queries."""
    graph = GraphPath(args.repository, args.model)
    texts = Texts(graph.tokenizer)
    paths = {"graph in process": graph}
    if args.fused_repository is not None:
        paths["fused graph in process"] = GraphPath(args.fused_repository, args.model)
    try:
        paths["sentence-transformers fp16"] = st_embedder(args.weights, args.device)
    except Exception:  # the graph's figures are still worth having
        cell("sentence-transformers error", traceback.format_exc())
    for name, calls in texts.workloads().items():
        cell(name, interleaved(paths, calls, args.rounds))
    for name, path in paths.items():
        if isinstance(path, GraphPath):
            cell(f"{name}, by part", graph_parts(path, texts))
    times: dict[str, list[float]] = {name: [] for name in paths}
    for r in range(3):
        for name in (list(paths) if r % 2 == 0 else list(reversed(paths))):
            times[name] += singles_ms(paths[name], texts.singles)
    cell("single queries", {name: latency(t) for name, t in times.items()})


def graph_parts(graph, texts) -> dict:
    """Milliseconds per call of the graph path's parts (tokenizing, the arrays, ``session.run``) at each
    batch of short texts and a single query: the median of 20 calls after 3."""
    found = {}
    for label, batch in [("single", texts.singles[:1]), *((f"batch {size}", texts.batches("short", size, 1)[0])
                                                         for size in (32, 256))]:
        parts: dict[str, list[float]] = {"tokenize": [], "arrays": [], "session.run": []}
        for repetition in range(23):
            began = time.perf_counter()
            encodings = graph.tokenizer.encode_batch(batch)
            tokenized = time.perf_counter()
            feeds = graph.arrays(encodings)
            arrayed = time.perf_counter()
            graph.session.run(["EMBEDDING"], feeds)
            if repetition >= 3:
                for name, ms in zip(parts, (tokenized - began, arrayed - tokenized, time.perf_counter() - arrayed)):
                    parts[name].append(ms * 1e3)
        found[label] = {name: round(float(np.median(ms)), 3) for name, ms in parts.items()}
    return found


def joined(args, cell) -> None:
    """The joined model's ``execute`` in this process, on this GPU (bench/joined_profile.py): each step's time on
    one call of 256 short texts, on 8 calls of 32 and on one text, to set beside the graph path's parts (speed)
    and Triton's ``compute_infer`` (served)."""
    from nexus_sli.bench.gpu_paths import step_tokenizer
    from nexus_sli.bench.joined_profile import JoinedModel

    texts = Texts(step_tokenizer(args.repository, args.model, truncate=False)[1])
    model = JoinedModel(args.repository, args.model, "GPU" if args.device == "cuda" else "CPU")
    for label, calls in {"1 call of 256, ms": texts.batches("short", 256, 1),
                         "8 calls of 32, ms": texts.batches("short", 32, 8),
                         "1 text, ms": [texts.singles[:1]]}.items():
        cell(label, model.medians(calls))


def served(args, cell) -> None:
    from nexus_sli.bench.gpu_served import measure_variants

    measure_variants(args, cell)


def levers(args, cell) -> None:
    """The graph with ONNX Runtime's I/O binding (inputs copied to the GPU in one call each, the output left
    there and copied out once) and with CUDA graphs (captured at one batch shape, replayed), each beside
    the plain ``session.run`` on the same inputs, interleaved."""
    from nexus_sli.bench.gpu_served import cpu_placed_nodes, cuda_graph_runs, io_binding_runs

    cell("io binding", io_binding_runs(args, args.rounds))
    graphs = {"": args}
    if args.fused_repository is not None:
        graphs["fused graph, "] = argparse.Namespace(**{**vars(args), "repository": args.fused_repository})
    for prefix, graph_args in graphs.items():
        cell(f"{prefix}node placements", cpu_placed_nodes(graph_args))
    for prefix, graph_args in graphs.items():  # after every placement: a refused capture may abort the process
        cell(f"{prefix}cuda graphs", cuda_graph_runs(graph_args, args.rounds))


def padding(args, cell) -> None:
    """What computing the padding costs on this GPU: 16 rows of 12 tokens padded to each width, the
    widths interleaved, the median of 50 runs each after 5 warm-ups."""
    session, providers = encoder_session(args.repository, args.model)
    rows, tokens, widths = 16, 12, (16, 64, 256, 512)
    ids = np.random.default_rng(0).integers(1000, 20000, size=(rows, tokens), dtype=np.int64)
    feeds = {}
    for width in widths:
        mask = np.zeros((rows, width), dtype=np.int64)
        mask[:, :tokens] = 1
        padded = np.zeros((rows, width), dtype=np.int64)
        padded[:, :tokens] = ids
        feeds[width] = {"input_ids": padded, "attention_mask": mask, "token_type_ids": np.zeros_like(padded)}
    times: dict[int, list[float]] = {width: [] for width in widths}
    for repetition in range(55):
        for width in widths:
            started = time.perf_counter()
            session.run(["EMBEDDING"], feeds[width])
            if repetition >= 5:
                times[width].append((time.perf_counter() - started) * 1e3)
    medians = {width: float(np.median(t)) for width, t in times.items()}
    cell("providers", providers)
    cell("median_ms", medians)
    cell("vs_bucket", {width: m / medians[16] for width, m in medians.items()})


#: In the order they run: a step that crashes the process (a GPU driver's abort) costs only those after it.
STEPS = {"environment": environment, "speed": speed, "joined": joined, "served": served, "validate": validate,
         "fidelity": fidelity, "levers": levers, "padding": padding}

if __name__ == "__main__":
    raise SystemExit(main())
