"""What the numbers were measured on, and how much memory a process tree holds."""

from __future__ import annotations

import os
import platform
from pathlib import Path

from nexus_sli.exporter.targets.cpu import RELEVANT_FLAGS, cpu_flags, supports_bf16  # noqa: F401 - re-exported
from nexus_sli.exporter.targets.cpu import cpuinfo as _cpuinfo


def machine_info() -> dict:
    info = _cpuinfo()
    flags = cpu_flags()
    memory_kb = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_kb = int(line.split()[1])
    except OSError:
        pass
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {
        "cpu_model": info.get("model name", platform.processor() or "unknown"),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "flags": {flag: flag in flags for flag in RELEVANT_FLAGS},
        "memory_gb": round(memory_kb / 2**20, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average_at_start": load,
    }


def checkout() -> dict:
    """The commit the bench ran from, and whether tracked files differed from it (a run on a
    fresh clone is ``clean``); ``None`` values outside a git checkout."""
    import subprocess

    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                                  check=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    commit = git("rev-parse", "--short=12", "HEAD")
    changes = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "clean": None if changes is None else not changes}


def library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("torch", "transformers", "sentence-transformers", "onnxruntime", "nvidia-pytriton",
                 "tritonclient", "numpy"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found


def _children_from_proc() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # the command name may hold spaces and parentheses: the ppid follows the last ')'
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def _rss_bytes_from_proc(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants, read from /proc."""
    children = _children_from_proc()
    found, stack = [], [pid]
    while stack:
        current = stack.pop()
        found.append(current)
        stack.extend(children.get(current, []))
    return found


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` and all its descendants (Triton and its python backend stubs)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            root = psutil.Process(pid)
            processes = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0
        total = 0
        for process in processes:
            try:
                total += process.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total
    return sum(_rss_bytes_from_proc(p) for p in process_tree(pid))
