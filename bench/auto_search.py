"""How long ``auto`` takes: ``nexus-sli export --precision auto --backend auto`` with an empty layer and candidate
cache, each step's seconds read from the export's own log, what it kept, and the machine it ran on
(``make bench AUTO_SEARCH=1 MODEL=all-mpnet-base-v2``).

    python -m nexus_sli.bench.auto_search [--model all-mpnet-base-v2] [--out bench/results/auto_search-<model>.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .cpu_classes import cpu_class
from .machine import checkout, machine_info

#: The log lines that begin a step after the first (exporter/export/pipeline.py and timing.py), and the step's name
#: (None: the configuration the line names).
STEPS = (
    (re.compile(r"nexus-sli: (\S+ \S+): making the candidate graphs"), None),
    (re.compile(r"nexus-sli: timing \d+ graphs"), "timing"),
    (re.compile(r"nexus-sli: (one graph passed|measured \()"), "the report and the repository"),
)
FIRST_STEP = "walk, plain ONNX graph, PyTorch reference"


def steps(lines: list[tuple[float, str]]) -> dict[str, float]:
    """Seconds per step, from the line that begins it to the next step's: ``lines`` are (seconds since the
    start, log line)."""
    marks = [(0.0, FIRST_STEP)]
    for at, line in lines:
        for pattern, name in STEPS:
            found = pattern.search(line)
            if found:
                marks.append((at, name or found.group(1)))
    ends = [at for at, _ in marks[1:]] + [lines[-1][0] if lines else 0.0]
    out: dict[str, float] = {}
    for (at, name), end in zip(marks, ends):
        out[name] = round(out.get(name, 0.0) + end - at, 1)
    return out


def run(model: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="nexus-sli-auto-") as scratch:
        env = {**os.environ, "NEXUS_SLI_CACHE_DIR": str(Path(scratch) / "empty-cache")}
        command = [sys.executable, "-m", "nexus_sli.cli.main", "export", "--model", model, "--precision", "auto",
                   "--backend", "auto", "--out", str(Path(scratch) / "repo")]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started, lines = time.monotonic(), []
        with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as export:
            for line in export.stdout:
                lines.append((time.monotonic() - started, line.rstrip("\n")))
                print(f"{lines[-1][0]:7.1f} {line}", end="", flush=True)
        wall = time.monotonic() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if export.returncode:
            raise RuntimeError(f"the export failed with code {export.returncode}: {lines[-1][1] if lines else ''}")
        report = json.loads((next((Path(scratch) / "repo").glob("*_encoder")) / "validation.json").read_text())
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"model": model, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "steps_s": steps(lines),
            "kept": _kept(report),
            "kept_because": report.get("kept_because"), "cosine_min": report.get("cosine_min"),
            "timing": report.get("timing")}


def _kept(report: dict) -> str:
    row = next(r for r in report["measured"] if r.get("chosen"))
    return f"{row['backend']} {row['precision']} {row['graph']}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="all-mpnet-base-v2")
    parser.add_argument("--out", help="default: bench/results/auto_search-<model>.json")
    args = parser.parse_args(argv)
    machine = machine_info()
    result = {"command": f"python -m nexus_sli.bench.auto_search --model {args.model}",
              "machine": {**machine, "cpu_class": cpu_class(machine["flags"])}, "checkout": checkout(),
              "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **run(args.model)}
    result["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    out = Path(args.out or f"bench/results/auto_search-{Path(args.model).name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("machine", "checkout", "timing")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
