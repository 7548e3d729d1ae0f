"""The GPU repository's checks on a GPU host: fidelity and speed of the fp16 graph on ONNX Runtime's
CUDA provider, beside sentence-transformers fp16 on the same GPU.

Run where ``onnxruntime-gpu``, PyTorch with CUDA and sentence-transformers are installed, on a
repository written by ``nexus-sli export --target gpu --accelerator cuda``::

    python -m nexus_sli.bench.gpu_check --repository REPO --model NAME --weights MODEL_DIR --out record.json

Its steps (``--steps``; the first four by default):

- ``environment``: versions, the GPU, the providers this onnxruntime has;
- ``validate``: ``nexus-sli validate`` on the repository (the stored PyTorch fp32 reference through
  the providers the encoder's config names);
- ``fidelity``: the same reference inputs through sentence-transformers fp16 on the GPU, held to the
  same reference, so both fp16 paths are read side by side;
- ``speed``: batches of 32 texts and single short queries, tokenizer included on both sides, the
  paths interleaved in every round;
- ``served``: the repository served by Triton on the GPU, through the client over gRPC and HTTP,
  beside the graph in process;
- ``padding``: what padding a batch to wider widths costs on the GPU.

Every step writes its part of the record as it ends, so a step that fails leaves the others' results
(docs/gpu.md, "Measured on a GPU").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import subprocess
import sys
import time
import traceback
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from pathlib import Path

import numpy as np

from nexus_sli.bench.measure import cosines

BATCH = 32
SINGLE_QUERIES = 64


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repository", type=Path, required=True)
    parser.add_argument("--model", required=True, help="the model's name in the repository")
    parser.add_argument("--weights", type=Path, help="the sentence-transformers model folder (fidelity, speed)")
    parser.add_argument("--out", type=Path, required=True, help="the JSON record to write")
    parser.add_argument("--rounds", type=int, default=6, help="interleaved timing rounds")
    parser.add_argument("--device", default="cuda", help="torch device for sentence-transformers (cpu: a dry run)")
    parser.add_argument("--steps", default="environment,validate,fidelity,speed",
                        help=f"which of {', '.join(STEPS)}, comma-separated")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    record: dict = {"command": "python -m nexus_sli.bench.gpu_check " + " ".join(argv)}
    steps = [(name, STEPS[name]) for name in args.steps.split(",")]
    for name, step in steps:
        started = time.perf_counter()
        try:
            record[name] = step(args)
        except Exception:  # one failed step must not cost the others' results
            record[name] = {"error": traceback.format_exc()}
        record[name]["seconds"] = round(time.perf_counter() - started, 1)
        args.out.write_text(json.dumps(record, indent=2))
        print(f"gpu_check: {name} done in {record[name]['seconds']} s", flush=True)
    return 0


def environment(args) -> dict:
    found = {"python": platform.python_version(), "cpu": cpu_name()}
    with contextlib.suppress(ImportError):
        import torch  # first: its CUDA libraries are the ones the CUDA provider then finds

        found["torch"] = torch.__version__
        if args.device == "cuda":
            found.update(gpu=torch.cuda.get_device_name(0), capability=list(torch.cuda.get_device_capability(0)),
                         cuda=torch.version.cuda)
    with contextlib.suppress(PackageNotFoundError):  # read, not imported: the served steps run without it
        found["sentence_transformers"] = package_version("sentence-transformers")
    import onnxruntime as ort

    from nexus_sli.exporter.serving.backends.onnxruntime_providers import load_gpu_libraries

    found.update(onnxruntime=ort.__version__, onnxruntime_providers=ort.get_available_providers(),
                 gpu_libraries=load_gpu_libraries(ort) or "loaded")
    return found


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine()


def validate(args) -> dict:
    """What ``nexus-sli validate`` runs, in this process (where the CUDA libraries are loaded)."""
    from nexus_sli.exporter.errors import ValidationError
    from nexus_sli.exporter.export.revalidate import revalidate

    try:
        return {"passed": True, "revalidation": revalidate(args.repository, args.model)}
    except ValidationError as failed:
        return {"passed": False, "error": str(failed), "revalidation": failed.report}


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


def fidelity(args) -> dict:
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
    summary = {name: {"texts": int(sum(len(c) for c in cs)), "cosine_min": float(np.concatenate(cs).min()),
                      "cosine_mean": float(np.concatenate(cs).mean())} for name, cs in found.items()}
    return {"reference": "PyTorch fp32 (stored at export)", "providers": providers, **summary}


def encoder_session(repository: Path, model: str):
    """The encoder's session as ``nexus-sli validate`` opens it: the providers its config.pbtxt names."""
    from google.protobuf import json_format

    from nexus_sli.exporter.targets import TARGETS
    from nexus_sli.exporter.triton import config as tc

    folder = repository / f"{model}_encoder"
    config = tc.read(folder / "config.pbtxt")
    session = TARGETS["onnxruntime-cuda"].open(folder / "1" / "model.onnx", {}, config=json_format.MessageToDict(
        config, preserving_proto_field_name=True))
    return session, session.get_providers()


def st_model(weights: Path, device: str):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(weights), device=device).half().eval()


def speed(args) -> dict:
    """Texts per second on batches of 32 and single-query latency, the two paths interleaved."""
    paths = {"onnxruntime fp16 graph": graph_embedder(args.repository, args.model),
             "sentence-transformers fp16": st_embedder(args.weights, args.device)}
    return interleaved(paths, args.rounds)


def workload() -> tuple[list[list[str]], list[str]]:
    """Eight batches of 32 texts spread over the bench set (its length mix), and its 64 shortest texts."""
    from nexus_sli.bench.texts import bench_texts, subset

    texts = subset(bench_texts(), 8 * BATCH)
    return [texts[i:i + BATCH] for i in range(0, len(texts), BATCH)], sorted(texts, key=len)[:SINGLE_QUERIES]


def interleaved(paths: dict, rounds: int) -> dict:
    """Each path (texts -> vectors) on the batches, then on the single queries one at a time; the paths'
    order alternates round by round, so a drift of the machine falls on all of them."""
    batches, singles = workload()
    for embed in paths.values():  # warm-up: every bucket width and the CUDA kernels' first launches
        for batch in batches:
            embed(batch)
    timed = {name: {"batch_s": [], "single_ms": []} for name in paths}
    for r in range(rounds):
        for name in (list(paths) if r % 2 == 0 else list(reversed(paths))):
            started = time.perf_counter()
            for batch in batches:
                paths[name](batch)
            timed[name]["batch_s"].append(time.perf_counter() - started)
            for text in singles:
                started = time.perf_counter()
                paths[name]([text])
                timed[name]["single_ms"].append((time.perf_counter() - started) * 1e3)
    texts = sum(len(b) for b in batches)
    return {"texts": texts, "batch": BATCH, "single_queries": len(singles), "rounds": rounds,
            **{name: summarize(t, texts) for name, t in timed.items()}}


def summarize(rounds: dict, texts: int) -> dict:
    per_round = [texts / s for s in rounds["batch_s"]]
    single = np.asarray(rounds["single_ms"])
    return {"batch_texts_per_s_median": float(np.median(per_round)), "batch_texts_per_s_rounds": per_round,
            "single_p50_ms": float(np.percentile(single, 50)), "single_p99_ms": float(np.percentile(single, 99))}


def graph_embedder(repository: Path, model: str):
    """Texts -> EMBEDDING as the served path computes them: the tokenizer step's bucket padding, then
    the encoder graph on its config's providers."""
    from nexus_sli.exporter.triton import config as tc
    from nexus_sli.exporter.triton.python_models.encoding import load_tokenizer, padded_length, to_arrays
    from nexus_sli.tasks.model_parameters import TokenizerParameters, message_strings

    session, providers = encoder_session(repository, model)
    print(f"gpu_check: the encoder graph runs on {providers}", flush=True)
    tokenizer_config = tc.read(repository / f"{model}_tokenizer" / "config.pbtxt")
    step = TokenizerParameters.read(message_strings(tokenizer_config.parameters))
    max_length, widths, pad_id = step.max_length, list(step.widths), step.pad_id
    tokenizer = load_tokenizer(str(repository / f"{model}_tokenizer" / "1" / "tokenizer.json"), max_length)
    names = [i.name for i in session.get_inputs()]

    def embed(texts: list[str]) -> np.ndarray:
        encodings = tokenizer.encode_batch(texts)
        width = padded_length(max(len(e.ids) for e in encodings), widths, max_length)
        return session.run(["EMBEDDING"], to_arrays(encodings, names, pad_id, width))[0]

    return embed


def st_embedder(weights: Path, device: str):
    model = st_model(weights, device)
    return lambda texts: model.encode(texts, batch_size=BATCH, convert_to_numpy=True)


def served(args) -> dict:
    """The repository served by Triton (``nexus-sli serve``'s server) on this GPU, through the client over
    gRPC and HTTP: its vectors against the graph in process, the providers the encoder's instance opened
    (its log lines), and the speed of the three paths, interleaved."""
    from nexus_sli.bench.served import free_ports
    from nexus_sli.client import EncoderClient
    from nexus_sli.exporter.serving import server

    http, grpc, metrics = free_ports(3)
    log = args.out.with_name("triton.log")
    with log.open("w") as sink:
        process = server.start(args.repository, http, grpc, metrics, gpu_on_cpu=args.device == "cpu", stdout=sink,
                               stderr=subprocess.STDOUT)
        try:
            clients = {"Triton gRPC": EncoderClient(f"127.0.0.1:{grpc}", "grpc", model=args.model),
                       "Triton HTTP": EncoderClient(f"127.0.0.1:{http}", "http", model=args.model)}
            in_process = graph_embedder(args.repository, args.model)
            batch = workload()[0][0]
            agreement = {name: float(cosines(client.embed(batch), in_process(batch)).min())
                         for name, client in clients.items()}
            paths = {"in process": in_process, **{name: client.embed for name, client in clients.items()}}
            speeds = interleaved(paths, args.rounds)
        finally:
            server.stop(process)
    encoder_lines = [line for line in log.read_text().splitlines() if "nexus-sli onnxruntime backend" in line]
    return {"cosine_min_vs_in_process": agreement, "encoder_log": encoder_lines, "speed": speeds}


def padding(args) -> dict:
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
    return {"providers": providers, "rows": rows, "tokens": tokens, "median_ms": medians,
            "vs_bucket": {width: m / medians[16] for width, m in medians.items()}}


STEPS = {"environment": environment, "validate": validate, "fidelity": fidelity, "speed": speed,
         "served": served, "padding": padding}

if __name__ == "__main__":
    raise SystemExit(main())
