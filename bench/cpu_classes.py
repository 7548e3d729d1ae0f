"""The CPU classes side by side: the latest full run of the packaged model on each class.

The default configuration, and how far it gets, depends on the instruction sets
(``auto`` picks int8 where VNNI makes it fast, bf16 where the CPU has bf16
matmuls, fp32 elsewhere), and the project's machines come in several classes.
One machine gives one class per run, so each full ``make bench`` of the packaged
model keeps its ``latest.json`` as ``bench/results/classes/<class>.json`` too,
and BENCHMARKS.md shows every class's latest run in one table, judged by the
current targets from each run's per-repetition figures.  A class no team run
has given yet shows the figures reported for it elsewhere, dated and sourced,
from ``bench/data/cpu_classes.json`` (hand-written: where those figures came
from, and what stops the default going higher on each class).
"""

from __future__ import annotations

import json
from pathlib import Path

from .targets import MET, NOT_MEASURED, judge, median_text

#: (class, description), most capable first
CLASSES = (
    ("amx", "Intel with AMX (AMX-INT8, AMX-BF16)"),
    ("avx512-vnni-bf16", "AVX-512 with VNNI and bf16 (AMD Zen 5 seen)"),
    ("avx512-vnni", "AVX-512 with VNNI, no bf16 (Intel Ice Lake seen)"),
    ("avx2", "AVX2 only: no AVX-512, no VNNI (AMD EPYC seen)"),
)
NOTES = Path(__file__).with_name("data") / "cpu_classes.json"

#: the columns: (heading, target, comparison prefix); figures are the target's median
COLUMNS = (
    ("batches of 32", "(a) client batches of 32", "vs sentence-transformers"),
    ("short-text batches", "(d) client batches of 32 short texts", "vs sentence-transformers"),
    ("16 clients", "(b) 16 concurrent single-text clients", "vs sentence-transformers"),
    ("single query p99 / p50", "(c) single short query", "p99 vs its own p50"),
    ("share of peak", "(e) share of the compute peak", "served batches of 32"),
    ("gRPC query / in process", "(f) the request path", "gRPC p50 vs"),
    ("OpenAI query - gRPC", "(f) the request path", "OpenAI route p50 minus"),
)


def cpu_class(flags: dict[str, bool]) -> str:
    """The class of a CPU from its flags (``machine_info()["flags"]``)."""
    if flags.get("amx_int8") or flags.get("amx_bf16"):
        return "amx"
    if flags.get("avx512_vnni"):
        return "avx512-vnni-bf16" if flags.get("avx512_bf16") else "avx512-vnni"
    return "avx2"


def classes_dir(results_dir: Path) -> Path:
    return Path(results_dir) / "classes"


def keep(results: dict, results_dir: Path) -> Path:
    """Keep a full run of the packaged model as its CPU class's latest."""
    target = classes_dir(results_dir) / f"{cpu_class(results['machine']['flags'])}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(results, indent=2) + "\n")
    return target


def _figure(target: dict | None) -> str:
    """A target's median as the targets table prints it, with its status unless it was met."""
    if target is None or target["median"] is None:
        return "not measured"
    value = median_text(target)
    return value if target["status"] == "met" else f"{value} ({target['status']})"


def _run_source(row: dict, note: dict) -> str:
    """Where a kept run came from: the notes' words where they say it (a run from before runs
    recorded their checkout), else whether its checkout was clean (its JSON keeps the commit)."""
    if note.get("run_source"):
        return note["run_source"]
    return "`make bench`, clean checkout" if row["commit"] and row["clean"] else "`make bench`"


def summary(results: dict) -> dict:
    """One class's row from a run's results, judged by the current targets."""
    targets = judge(results)
    judged = [t for t in targets if t["status"] != NOT_MEASURED]
    default = results.get("default_configuration") or {}
    checkout = results.get("checkout") or {}

    def find(name: str, prefix: str) -> dict | None:
        return next((t for t in targets if t["target"].startswith(name) and t["comparison"].startswith(prefix)), None)

    return {"class": cpu_class(results["machine"]["flags"]), "cpu": results["machine"]["cpu_model"],
            "date": results["created"][:10], "commit": checkout.get("commit"), "clean": checkout.get("clean"),
            "default": f"{default.get('backend', '?')} {default.get('precision', '?')}" if default else "unknown",
            "figures": [_figure(find(name, prefix)) for _, name, prefix in COLUMNS],
            "met": f"{sum(t['status'] == MET for t in judged)}/{len(judged)}"}


def rows(results_dir: Path, notes_file: Path = NOTES) -> list[dict]:
    """Every class: its latest kept run, else the figures reported for it, else nothing yet."""
    notes = json.loads(notes_file.read_text()) if notes_file.is_file() else {}
    found = []
    for name, description in CLASSES:
        note = notes.get(name, {})
        kept = classes_dir(results_dir) / f"{name}.json"
        if kept.is_file():
            row = summary(json.loads(kept.read_text()))
            row["source"] = _run_source(row, note)
        elif note.get("reported"):
            reported = note["reported"]["figures"]  # reported before later columns existed: "-" in those
            row = {"class": name, **note["reported"], "figures": [*reported, *["-"] * (len(COLUMNS) - len(reported))]}
        else:
            row = {"class": name, "cpu": "-", "date": "-", "default": "-", "figures": ["not run"] * len(COLUMNS),
                   "met": "-", "source": "no run on this class yet"}
        found.append({**row, "description": description, "note": note.get("note", ""),
                      "stops": note.get("stops", "")})
    return found


def section(results_dir: Path, notes_file: Path = NOTES) -> list[str]:
    """The page's table of CPU classes.  A cell holds a figure or a name; a row's reasons (where its
    figures came from, what stops the default going higher) are numbered notes below the table."""
    lines = ["## CPU classes side by side", "",
             "The default configuration (what `auto` picks on that CPU) served, each class's latest full run "
             "of the packaged model; ratios to sentence-transformers in the same run, judged by the targets "
             "below (a figure without a status met its target). Each row says where and when its figures "
             "came from.", "",
             "| CPU class | CPU | run | default | " + " | ".join(h for h, _, _ in COLUMNS) + " | targets met | note |",
             "|---|---|---|---|" + "---:|" * len(COLUMNS) + "---:|---|"]
    notes = []
    for row in rows(results_dir, notes_file):
        reasons = " ".join(text for text in (row["note"], row["stops"]) if text)
        if reasons:
            notes.append(f"{len(notes) + 1}. {row['description']}: {reasons}")
        lines.append(f"| {row['description']} | {row['cpu']} | {row['date']}, {row['source']} | {row['default']} | "
                     + " | ".join(row["figures"]) + f" | {row['met']} | {len(notes) if reasons else '-'} |")
    if not notes:
        return lines
    return [*lines, "", "Notes: where a row's figures came from, and what stops the default going higher "
            "on that class.", "", *notes]
