"""What this CPU can run fast: the one place that reads its flags.

Targets say from them which configurations suit this machine (``auto``), and
the bench records them beside every figure.
"""

from __future__ import annotations

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


#: Native bf16 matmuls: without one of these, bf16 is emulated and slower than fp32.
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def supports_bf16() -> bool:
    """True where the CPU has native bf16 matmuls (AVX512-BF16 or AMX-BF16)."""
    return bool(cpu_flags() & BF16_FLAGS)
