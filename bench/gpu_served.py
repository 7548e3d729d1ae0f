"""The GPU repository served on its GPU, one variant of the served configuration at a time: the
``served`` and ``levers`` steps of bench/gpu_check.py.

A variant is a copy of the repository (or of the fused graph's, ``--fused-repository``: bench/gpu_fused.py)
with some of the settings Triton reads changed through its config schema (the encoder's instances, its
queue delay, the rows an execution merges, the tokenizer step's instances), the requests of one call its
clients send at once, and a way of serving it
(``nexus-sli serve``'s default, each ensemble's steps joined in one process, or the steps as exported).
Each is served by ``nexus-sli serve`` (with the interpreter ``--serve-python`` names: the python backend
needs numpy<2) and loaded by client processes of their own (bench/stack_load.py), the cells that judge the
served path first:

- texts per second from 16 clients sending short texts in calls of 32, and from one sending calls of 256;
- single short queries, the served path and the graph in this process taking turns;
- for the first variant, the other loads (one client of 32, four of 256, long texts) and the served
  vectors of the export's validation texts against the PyTorch fp32 reference it stored.

With each load: the GPU's utilisation sampled by ``nvidia-smi``, each process's CPU time per call
(clients, ``tritonserver``, each python-backend stub) and Triton's statistics per model.  With each
variant: the GPU memory its processes hold.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nexus_sli.bench.measure import cosines


@dataclass(frozen=True)
class ServedVariant:
    """Settings changed from the repository as exported (None: as exported)."""

    label: str
    instances: int | None = None
    queue_delay_us: int | None = None
    max_batch_size: int | None = None
    tokenizer_instances: int | None = None
    separate_steps: bool = False
    #: the client's requests of one call in flight at once (``fan_out.IN_FLIGHT``; None: the client's default)
    in_flight: int | None = None
    #: the repository with ONNX Runtime's fused graph (``--fused-repository``), its single queries paired with
    #: that graph in process
    fused: bool = False
    #: every load, and the served vectors' fidelity, not only the cells that judge
    full: bool = False


#: In the order they run, the most telling first (a run cut short keeps them): the repository as exported,
#: the settings it had before a GPU measured them, then the alternatives to each of its settings.
#: (Labels hold no commas: ``--variants`` is a comma-separated list of them.)
VARIANTS = (
    ServedVariant("as exported", full=True),
    ServedVariant("fused graph", fused=True, full=True),
    ServedVariant("max batch 64 + 1 instance + queue delay 500", max_batch_size=64, instances=1, queue_delay_us=500,
                  full=True),
    ServedVariant("max batch 64 + 4 instances + 4 in flight", max_batch_size=64, instances=4, in_flight=4, full=True),
    ServedVariant("1 instance", instances=1),
    ServedVariant("4 instances", instances=4),
    ServedVariant("max batch 128 + 2 in flight", max_batch_size=128, in_flight=2),
    ServedVariant("queue delay 500", queue_delay_us=500),
    ServedVariant("steps separate", separate_steps=True),
    ServedVariant("steps separate + 4 tokenizer instances", tokenizer_instances=4, separate_steps=True),
)
#: load -> (client processes, texts, texts per call): those that judge, then the rest (full variants)
JUDGED_LOADS = {"16 clients, short, batch 32": (16, "short", 32), "1 client, short, batch 256": (1, "short", 256)}
MORE_LOADS = {"1 client, short, batch 32": (1, "short", 32), "4 clients, short, batch 256": (4, "short", 256),
              "1 client, long, batch 32": (1, "long", 32), "16 clients, long, batch 32": (16, "long", 32)}
SINGLE_ROUNDS = 3
#: The batches of short texts the in-process levers are timed at.
LEVER_BATCHES = (32, 256)


def variant_repository(source: Path, target: Path, variant: ServedVariant) -> Path:
    """A copy of ``source`` with ``variant``'s settings written into its configs."""
    from nexus_sli.exporter.triton import config as tc

    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target)
    for path in target.glob("*/config.pbtxt"):
        config = tc.read(path)
        if variant.max_batch_size is not None and config.max_batch_size:
            config.max_batch_size = variant.max_batch_size
        if config.name.endswith("_encoder"):
            if variant.instances is not None:
                config.instance_group[0].count = variant.instances
            if variant.queue_delay_us is not None:
                config.dynamic_batching.max_queue_delay_microseconds = variant.queue_delay_us
        if config.name.endswith("_tokenizer") and variant.tokenizer_instances is not None:
            config.instance_group[0].count = variant.tokenizer_instances
        tc.write(config, path.parent)
    return target


class GpuSampler:
    """``nvidia-smi``'s GPU utilisation every 100 ms while the context is open (None where it is missing)."""

    def __init__(self):
        self.samples: list[float] = []

    def __enter__(self) -> "GpuSampler":
        self.process = _smi(["--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-lms", "100"],
                            stream=True)
        if self.process is not None:
            self.reader = threading.Thread(target=self._read, daemon=True)
            self.reader.start()
        return self

    def _read(self) -> None:
        for line in self.process.stdout:
            if line.strip().isdigit():
                self.samples.append(float(line))

    def __exit__(self, *exc) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
            self.reader.join(5)

    def summary(self) -> dict:
        if not self.samples:
            return {"gpu_utilization_percent": None}
        return {"gpu_utilization_percent": {"mean": round(float(np.mean(self.samples)), 1),
                                            "max": float(np.max(self.samples)), "samples": len(self.samples)}}


def _smi(arguments: list[str], stream: bool = False):
    """nvidia-smi's process (``stream``) or its output; None where the machine has none."""
    if shutil.which("nvidia-smi") is None:
        return None
    if stream:
        return subprocess.Popen(["nvidia-smi", *arguments], stdout=subprocess.PIPE, text=True)
    return subprocess.run(["nvidia-smi", *arguments], capture_output=True, text=True, timeout=30).stdout


def gpu_memory() -> dict | None:
    """The GPU memory in use (MiB), and each process's that holds some."""
    total = _smi(["--query-gpu=memory.used", "--format=csv,noheader,nounits"])
    if total is None:
        return None
    apps = _smi(["--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]) or ""
    return {"used_mib": int(total.split()[0]),
            "processes_mib": [int(line.split(",")[1]) for line in apps.splitlines() if "," in line]}


def measure_variants(args, cell) -> None:
    """Every variant of :data:`VARIANTS` (or those ``args.variants`` names) served and loaded in turn."""
    from nexus_sli.bench.gpu_paths import GraphPath, Texts, reference_embeddings

    graph = GraphPath(args.repository, args.model)
    texts = Texts(graph.tokenizer)
    wanted = [v for v in VARIANTS if (not args.variants or v.label in args.variants.split(","))
              and (args.fused_repository is not None or not v.fused)]
    cell("variants", [v.__dict__ for v in wanted])
    cell("gpu memory before serving", gpu_memory())
    work = Path(tempfile.mkdtemp(prefix="nexus-sli-gpu-served-"))  # repository copies: not beside the record
    for variant in wanted:
        try:
            cell(variant.label, _variant(args, variant, texts, graph, work, reference_embeddings if variant.full
                                         else None, lambda name, value, v=variant.label: cell(f"{v}: {name}", value)))
        except Exception:  # the next variant may still run
            cell(f"{variant.label}: error", traceback.format_exc())


def _variant(args, variant: ServedVariant, texts, graph, work: Path, reference, cell) -> str:
    from nexus_sli.bench.gpu_paths import GraphPath
    from nexus_sli.bench.stack_ceiling import Served, Variant, run_load
    from nexus_sli.client import EncoderClient

    source = args.fused_repository if variant.fused else args.repository
    repository = variant_repository(source, work / "repository", variant)
    if variant.fused:  # the single queries' pair: the same graph in process
        graph = GraphPath(source, args.model)
    started = time.perf_counter()
    flags = (*(("--separate-steps",) if variant.separate_steps else ()),
             *(("--gpu-models-on-cpu",) if args.device == "cpu" else ()))  # a dry run on a machine without a GPU
    served = Served(Variant(variant.label, None, flags), args.serve_python, repository, work / "served",
                    model=args.model)
    try:
        cell("ready after s", round(time.perf_counter() - started, 1))
        client = EncoderClient(f"127.0.0.1:{served.grpc}", model=args.model)
        for batch in (texts.batches("short", 256, 2) + texts.batches("long", 32, 2)):  # every bucket warm
            client.embed(batch)
        cell("gpu memory", gpu_memory())
        loads = {**JUDGED_LOADS, **(MORE_LOADS if variant.full else {})}
        for name, (clients, kind, size) in list(loads.items())[:2]:
            cell(name, _load(served, run_load, texts, kind, clients, size, args.seconds, variant.in_flight))
        cell("single queries", _singles(client, graph, texts.singles))
        for name, (clients, kind, size) in list(loads.items())[2:]:
            cell(name, _load(served, run_load, texts, kind, clients, size, args.seconds, variant.in_flight))
        if reference is not None:
            cell("fidelity", _fidelity(client, *reference(source, args.model, graph.tokenizer)))
        client.close()
    finally:
        served.stop()
    return "done"


def _load(served, run_load, texts, kind: str, clients: int, size: int, seconds: float, in_flight: int | None) -> dict:
    pool = texts.short if kind == "short" else texts.long
    found = run_load(served, clients, 1, size, pool, seconds, GpuSampler(), in_flight)
    found["texts_per_s"] = found.pop("rows_per_s")
    found.pop("latencies_ms", None)
    return found


def _singles(client, graph, queries: list[str]) -> dict:
    """Each single query served and in process, the two paths taking turns round by round."""
    from nexus_sli.bench.gpu_paths import latency, singles_ms

    paths = {"served, gRPC": client.embed, "graph in process": graph}
    times: dict[str, list[float]] = {name: [] for name in paths}
    for r in range(SINGLE_ROUNDS):
        for name in (list(paths) if r % 2 == 0 else list(reversed(paths))):
            times[name] += singles_ms(paths[name], queries)
    found = {name: latency(t) for name, t in times.items()}
    found["served p50 over the graph's"] = round(found["served, gRPC"]["p50_ms"] / found["graph in process"]["p50_ms"],
                                                 3)
    return found


def _fidelity(client, texts: list[str], wanted: np.ndarray) -> dict:
    got = np.concatenate([client.embed(texts[i:i + 32]) for i in range(0, len(texts), 32)])
    found = cosines(got, wanted)
    return {"reference": "PyTorch fp32 with the model's pooling, stored at export (reference.npz)",
            "texts": len(texts), "cosine_min": float(found.min()), "cosine_mean": float(found.mean())}


def _bucket_feeds(args, rows: int) -> dict[str, np.ndarray]:
    """``rows`` short texts tokenized and padded as the tokenizer step pads them."""
    from nexus_sli.bench.gpu_paths import GraphPath, Texts

    graph = GraphPath(args.repository, args.model)
    return graph.feeds(Texts(graph.tokenizer).batches("short", rows, 1)[0])


def _timed(run, repetitions: int = 100, budget_s: float = 2.0) -> float:
    """Milliseconds per call of ``run`` after five warm-ups: ``repetitions`` calls, fewer where they would
    take past ``budget_s``."""
    for _ in range(5):
        run()
    started, done = time.perf_counter(), 0
    while done < repetitions and (done == 0 or time.perf_counter() - started < budget_s):
        run()
        done += 1
    return (time.perf_counter() - started) / done * 1e3


def io_binding_runs(args, rounds: int) -> dict:
    """Milliseconds per run at a batch of 32 and of 256 short texts: ``session.run`` on numpy arrays, and
    with an I/O binding (the inputs bound from the CPU, the output left on the GPU and copied out once)."""
    from nexus_sli.bench.gpu_paths import encoder_session

    session, providers = encoder_session(args.repository, args.model)
    found = {"providers": providers}
    for rows in LEVER_BATCHES:
        feeds = _bucket_feeds(args, rows)
        binding = session.io_binding()

        def bound():
            for name, array in feeds.items():
                binding.bind_cpu_input(name, array)
            binding.bind_output("EMBEDDING", "cuda")
            session.run_with_iobinding(binding)
            return binding.copy_outputs_to_cpu()[0]

        paths = {"session.run": lambda: session.run(["EMBEDDING"], feeds), "io binding": bound}
        times = {name: [] for name in paths}
        for r in range(rounds):
            for name in (list(paths) if r % 2 == 0 else list(reversed(paths))):
                times[name].append(_timed(paths[name]))
        found[f"batch {rows} x {next(iter(feeds.values())).shape[1]} tokens, ms"] = {
            name: float(np.median(t)) for name, t in times.items()}
    return found


def cuda_graph_runs(args, rounds: int) -> dict:
    """Milliseconds per run at one bucket shape (32 short texts): an I/O-bound session, and one whose CUDA
    provider captures the run as a CUDA graph and replays it (inputs updated in place)."""
    import onnxruntime as ort

    from nexus_sli.bench.gpu_paths import encoder_session

    feeds = _bucket_feeds(args, 32)
    found = {}
    runs = {}
    for name, options in (("io binding", {}), ("cuda graph", {"enable_cuda_graph": "1"})):
        try:
            session, providers = encoder_session(args.repository, args.model, **options)
            inputs = {n: ort.OrtValue.ortvalue_from_numpy(a, "cuda", 0) for n, a in feeds.items()}
            output = ort.OrtValue.ortvalue_from_shape_and_type(
                (len(next(iter(feeds.values()))), session.get_outputs()[0].shape[-1]), np.float32, "cuda", 0)
            binding = session.io_binding()
            for n, value in inputs.items():
                binding.bind_ortvalue_input(n, value)
            binding.bind_ortvalue_output("EMBEDDING", output)

            def run(session=session, binding=binding, inputs=inputs):
                for n, value in inputs.items():
                    value.update_inplace(feeds[n])
                session.run_with_iobinding(binding)
                return output.numpy()

            run()
            runs[name] = run
            found[f"{name} providers"] = providers
        except Exception as exc:  # noqa: BLE001 - a provider that refuses the capture is the finding
            found[f"{name} error"] = f"{type(exc).__name__}: {exc}"
    times = {name: [] for name in runs}
    for r in range(rounds):
        for name in (list(runs) if r % 2 == 0 else list(reversed(runs))):
            times[name].append(_timed(runs[name]))
    found["batch 32, ms"] = {name: float(np.median(t)) for name, t in times.items()}
    return found


def cpu_placed_nodes(args) -> dict:
    """Where ONNX Runtime places the encoder graph's nodes in a session on its config's providers, from the
    session's verbose log (``VerifyEachNodeIsAssignedToAnEp``): each provider's count, and the nodes it puts on
    the CPU, which keep a CUDA graph from capturing the run (``cuda_graph_runs``)."""
    import os

    import onnxruntime as ort

    from nexus_sli.bench.gpu_paths import encoder_session

    verbose = ort.SessionOptions()
    verbose.log_severity_level = 0

    descriptor = 2  # the log is ONNX Runtime's C++ output to the process's standard error, not Python's
    saved = os.dup(descriptor)
    with tempfile.TemporaryFile(mode="w+") as log:
        sys.stderr.flush()
        os.dup2(log.fileno(), descriptor)
        try:
            encoder_session(args.repository, args.model, verbose)
        finally:
            os.dup2(saved, descriptor)
            os.close(saved)
        log.seek(0)
        lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).split("] ", 1)[-1].strip()  # colours off
                 for line in log.read().splitlines() if "VerifyEachNodeIsAssignedToAnEp" in line]
    found: dict = {"placements": [line for line in lines if "placed on" in line], "on the CPU": []}
    provider = None
    for line in lines:
        if "placed on [" in line:
            provider = line.split("placed on [", 1)[1].split("]", 1)[0]
        elif provider == "CPUExecutionProvider" and line:
            found["on the CPU"].append(line)
    return found

