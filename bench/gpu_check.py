"""The GPU repository's checks on a GPU host: the served path beside the exported graph in process and
sentence-transformers fp16 on the same GPU, and the graph's fidelity.

Run where ``onnxruntime-gpu``, PyTorch with CUDA and sentence-transformers are installed, on a
repository written by ``nexus-sli export --target gpu --accelerator cuda``::

    python -m nexus_sli.bench.gpu_check --repository REPO --model NAME --weights MODEL_DIR --out record.json

Its steps (``--steps``; by default all but ``padding``, in this order, the most important first):

- ``environment``: versions, the GPU, the providers this onnxruntime has;
- ``speed``: the graph in process (the tokenizer step's bucket padding, then one ``session.run`` per
  batch) and sentence-transformers fp16, interleaved round by round: short texts in batches of 32 and
  256, long texts in batches of 32, and single short queries (p50, p99);
- ``served``: the repository served by ``nexus-sli serve`` on this GPU (bench/gpu_served.py), each
  variant of the served configuration in turn: throughput from client processes, single queries paired
  with the graph in process, GPU utilisation, the GPU memory the server holds, and the served vectors
  against the PyTorch fp32 reference the export stored;
- ``validate``: ``nexus-sli validate`` on the repository;
- ``fidelity``: the stored reference's inputs through the graph and through sentence-transformers fp16;
- ``levers``: the graph in process with ONNX Runtime's I/O binding, and with CUDA graphs at one bucket
  (last: a provider that refuses a capture may abort the process);
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

from nexus_sli.bench.measure import cosines

#: Texts per call of the batch workloads.
BATCHES = (32, 256)
SINGLE_QUERIES = 64
#: A short text has at most this many tokens (the bench set's sentences and queries: 17 on average).
SHORT_TOKENS = 32
#: Short texts joined into one long text (about 150 tokens).
LONG_JOINED = 10


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


def reference_batches(repository: Path, model: str) -> list[tuple[dict, np.ndarray]]:
    """The stored validation text batches: (inputs, the PyTorch fp32 sentence embeddings, made from the
    stored token states the way the export's validation.json says the model pools them)."""
    from nexus_sli.exporter.export import export_report, stored_reference
    from nexus_sli.exporter.export.validate import embedder_from_report
    from nexus_sli.tasks import get_task

    folder = repository / f"{model}_encoder"
    exported = export_report.read(folder)
    reference = stored_reference.load(folder, list(exported.inputs), get_task(exported.task).output_names())
    embedder = embedder_from_report(exported)
    return [(inputs, embedder(outputs[0], inputs["attention_mask"]))
            for inputs, outputs in zip(reference.batches[reference.first_text:],
                                       reference.outputs[reference.first_text:])]


def reference_embeddings(repository: Path, model: str, tokenizer) -> tuple[list[str], np.ndarray]:
    """The validation texts and their PyTorch fp32 sentence embeddings as the export stored them, each text
    found by its tokens (the stored batches are sorted by length); a ValueError where one is missing."""
    from nexus_sli.exporter.export.validate import validation_texts

    stored = {}
    for inputs, want in reference_batches(repository, model):
        for ids, mask, vector in zip(inputs["input_ids"], inputs["attention_mask"], want):
            stored[tuple(ids[mask.astype(bool)].tolist())] = vector
    texts = validation_texts()
    keys = [tuple(e.ids) for e in tokenizer.encode_batch(texts)]
    missing = sum(key not in stored for key in keys)
    if missing:
        raise ValueError(f"{missing} of {len(texts)} validation texts are not in the stored reference: export the "
                         "repository with this version of nexus-sli")
    return texts, np.stack([stored[key] for key in keys])


def fidelity(args, cell) -> None:
    """Sentence embeddings of the 240 validation texts against PyTorch fp32, for both fp16 paths."""
    import torch

    session, providers = encoder_session(args.repository, args.model)
    model = st_model(args.weights, args.device)
    found: dict[str, list] = {"onnxruntime fp16 graph": [], "sentence-transformers fp16": []}
    for inputs, want in reference_batches(args.repository, args.model):
        found["onnxruntime fp16 graph"].append(cosines(session.run(["EMBEDDING"], inputs)[0], want))
        with torch.inference_mode():
            features = {k: torch.from_numpy(v).to(args.device) for k, v in inputs.items()}
            got = model(features)["sentence_embedding"].float().cpu().numpy()
        found["sentence-transformers fp16"].append(cosines(got, want))
    cell("reference", "PyTorch fp32 (stored at export)")
    cell("providers", providers)
    for name, values in found.items():
        cell(name, {"texts": int(sum(len(c) for c in values)), "cosine_min": float(np.concatenate(values).min()),
                    "cosine_mean": float(np.concatenate(values).mean())})


def encoder_session(repository: Path, model: str, **provider_options):
    """The encoder's session as ``nexus-sli validate`` opens it: the providers its config.pbtxt names."""
    from google.protobuf import json_format

    from nexus_sli.exporter.targets import TARGETS
    from nexus_sli.exporter.triton import config as tc

    folder = repository / f"{model}_encoder"
    config = json_format.MessageToDict(tc.read(folder / "config.pbtxt"), preserving_proto_field_name=True)
    session = TARGETS["onnxruntime-cuda"].open(folder / "1" / "model.onnx", {}, config=config)
    if provider_options:  # the same providers, the CUDA provider's options changed
        import onnxruntime as ort

        providers = [(name, {**options, **provider_options}) if name == "CUDAExecutionProvider" else (name, options)
                     for name, options in zip(session.get_providers(), session.get_provider_options().values())]
        session = ort.InferenceSession(str(folder / "1" / "model.onnx"), providers=providers)
    return session, session.get_providers()


def st_model(weights: Path, device: str):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(weights), device=device).half().eval()


class Texts:
    """The workloads' texts: the bench set's short texts (at most :data:`SHORT_TOKENS` tokens), long texts of
    :data:`LONG_JOINED` short ones joined, and the shortest as single queries."""

    def __init__(self, tokenizer):
        from nexus_sli.bench.texts import bench_texts

        texts = bench_texts()
        counts = [len(e.ids) for e in tokenizer.encode_batch(texts)]
        self.short = [t for t, n in zip(texts, counts) if n <= SHORT_TOKENS]
        self.long = [" ".join(self.short[i:i + LONG_JOINED]) for i in range(0, len(self.short) - LONG_JOINED + 1,
                                                                             LONG_JOINED)]
        self.singles = sorted(self.short, key=len)[:SINGLE_QUERIES]

    def batches(self, kind: str, size: int, count: int) -> list[list[str]]:
        """``count`` calls of ``size`` texts of ``kind`` (short, long), going round the texts."""
        pool = self.short if kind == "short" else self.long
        return [[pool[(n * size + i) % len(pool)] for i in range(size)] for n in range(count)]

    def workloads(self) -> dict[str, list[list[str]]]:
        """name -> its calls: short texts in batches of 32 and 256, long ones in batches of 32."""
        return {f"short, batch {size}": self.batches("short", size, max(4, 1024 // size)) for size in BATCHES} | {
            "long, batch 32": self.batches("long", 32, 8)}


class GraphPath:
    """Texts -> EMBEDDING as the served path computes them: the tokenizer step's bucket padding, then
    the encoder graph on its config's providers, one ``session.run`` per call."""

    def __init__(self, repository: Path, model: str, **provider_options):
        from nexus_sli.exporter.triton import config as tc
        from nexus_sli.exporter.triton.python_models.encoding import load_tokenizer
        from nexus_sli.tasks.model_parameters import TokenizerParameters, message_strings

        self.session, providers = encoder_session(repository, model, **provider_options)
        print(f"gpu_check: the encoder graph runs on {providers}", flush=True)
        step = TokenizerParameters.read(message_strings(tc.read(repository / f"{model}_tokenizer" / "config.pbtxt")
                                                        .parameters))
        self.max_length, self.widths, self.pad_id = step.max_length, list(step.widths), step.pad_id
        self.tokenizer = load_tokenizer(str(repository / f"{model}_tokenizer" / "1" / "tokenizer.json"),
                                        self.max_length)
        self.names = [i.name for i in self.session.get_inputs()]

    def feeds(self, texts: list[str]) -> dict[str, np.ndarray]:
        from nexus_sli.exporter.triton.python_models.encoding import padded_length, to_arrays

        encodings = self.tokenizer.encode_batch(texts)
        width = padded_length(max(len(e.ids) for e in encodings), self.widths, self.max_length)
        return to_arrays(encodings, self.names, self.pad_id, width)

    def __call__(self, texts: list[str]) -> np.ndarray:
        return self.session.run(["EMBEDDING"], self.feeds(texts))[0]


def st_embedder(weights: Path, device: str):
    model = st_model(weights, device)
    return lambda texts: model.encode(texts, batch_size=len(texts), convert_to_numpy=True)


def texts_per_s(embed, calls: list[list[str]]) -> float:
    started = time.perf_counter()
    for texts in calls:
        embed(texts)
    return sum(len(t) for t in calls) / (time.perf_counter() - started)


def singles_ms(embed, texts: list[str]) -> list[float]:
    times = []
    for text in texts:
        started = time.perf_counter()
        embed([text])
        times.append((time.perf_counter() - started) * 1e3)
    return times


def latency(times: list[float]) -> dict:
    return {"p50_ms": float(np.percentile(times, 50)), "p99_ms": float(np.percentile(times, 99)), "queries": len(times)}


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
    try:
        paths["sentence-transformers fp16"] = st_embedder(args.weights, args.device)
    except Exception:  # the graph's figures are still worth having
        cell("sentence-transformers error", traceback.format_exc())
    for name, calls in texts.workloads().items():
        cell(name, interleaved(paths, calls, args.rounds))
    times: dict[str, list[float]] = {name: [] for name in paths}
    for r in range(3):
        for name in (list(paths) if r % 2 == 0 else list(reversed(paths))):
            times[name] += singles_ms(paths[name], texts.singles)
    cell("single queries", {name: latency(t) for name, t in times.items()})


def served(args, cell) -> None:
    from nexus_sli.bench.gpu_served import measure_variants

    measure_variants(args, cell)


def levers(args, cell) -> None:
    """The graph with ONNX Runtime's I/O binding (inputs copied to the GPU in one call each, the output left
    there and copied out once) and with CUDA graphs (captured at one batch shape, replayed), each beside
    the plain ``session.run`` on the same inputs, interleaved."""
    from nexus_sli.bench.gpu_served import cuda_graph_runs, io_binding_runs

    cell("io binding", io_binding_runs(args, args.rounds))
    cell("cuda graphs", cuda_graph_runs(args, args.rounds))


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
STEPS = {"environment": environment, "speed": speed, "served": served, "validate": validate, "fidelity": fidelity,
         "levers": levers, "padding": padding}

if __name__ == "__main__":
    raise SystemExit(main())
