"""What this CPU can run fast: the one place that reads its flags.

The exporter picks its defaults from them and the bench records them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: CPU flags that decide which fast paths exist: int8 dot products (VNNI, AMX) and bf16.
RELEVANT_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


def cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    return fields


def cpu_flags() -> set[str]:
    return set(cpuinfo().get("flags", "").split())


def supports_bf16() -> bool:
    """True where the CPU has native bf16 matmuls (AVX512-BF16 or AMX-BF16)."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


@dataclass(frozen=True)
class Default:
    """The encoder configuration an export makes when none is asked for, and why."""

    backend: str
    precision: str
    reason: str


def default_config(flags: set[str] | None = None) -> Default:
    """The fastest configuration that keeps full fidelity (min cosine >= 0.999) on CPUs
    with these flags, as measured with all-MiniLM-L6-v2 (BENCHMARKS.md, ../shared/ARCHITECTURE.md).

    int8 is never the default: ONNX Runtime's dynamic int8 measured min cosine 0.94
    (AVX2) and 0.991 (AMX) against sentence-transformers, and NNCF static int8 0.96 at
    best, short of the 0.98 the bench asks of a faster configuration."""
    flags = cpu_flags() if flags is None else flags
    if flags & {"avx512_bf16", "amx_bf16"}:
        return Default("openvino", "bf16", "the CPU has bf16 matmuls (avx512_bf16/amx_bf16): OpenVINO with "
                       "the bf16 hint ran 3.15x PyTorch fp32 at min cosine 0.99998 on an AMX machine")
    return Default("onnxruntime", "fp32", "no bf16 on this CPU: ONNX Runtime fp32 was the fastest full-fidelity "
                   "path measured (served 1.88-2.01x sentence-transformers, OpenVINO fp32 1.34-1.69x, on AVX2)")
