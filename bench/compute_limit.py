"""How far each path is from the hardware: an encoder's FLOPs per text against the CPU's peak.

An estimate, and labelled as one wherever it is printed.  The model's FLOPs
are counted from its config (the matmuls of every layer: projections,
feed-forward, and attention's two length-squared products); embeddings,
normalisations and activations are left out (a few percent for BERT-sized
models).  The peak is cores x clock x the FLOPs one core can issue per cycle
for the path's number format, from the CPU's flags, vendor and family
(:data:`FLOPS_PER_CYCLE`); the clock is the one /proc/cpuinfo reports, which on
a virtual machine is often the nominal clock, not the turbo one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

#: FLOPs per cycle per core (one multiply-add counts two), by format and instruction set.
#: fp32: ``avx512-full`` is two 512-bit FMA ports (16 lanes x 2 ports x 2: Intel's AVX-512
#: server cores, and AMD's from :data:`AMD_FULL_WIDTH_FAMILY` on); ``avx512-half`` runs AVX-512
#: on 256-bit units (AMD's family before it), as ``avx2`` cores with two FMA ports do (8 lanes x 2 x 2).
#: bf16: AVX512-BF16's dot product does twice fp32's work per instruction; AMX's tile
#: multiply 1024 bf16 FLOPs per cycle (Intel's published figure).
#: int8: VNNI dot products do four times fp32's work; AMX-INT8 2048 ops per cycle.
FLOPS_PER_CYCLE = {
    "fp32": {"avx512-full": 64, "avx512-half": 32, "avx2": 32},
    "bf16": {"amx": 1024, "avx512-full": 128, "avx512-half": 64},
    "int8": {"amx": 2048, "avx512-full": 256, "avx512-half": 128, "avx2": 64},
}
#: The first AMD CPU family (/proc/cpuinfo's ``cpu family``) whose AVX-512 units are full-width
#: (512-bit): 0x1A; family 0x19 runs AVX-512 on 256-bit units.
AMD_FULL_WIDTH_FAMILY = 26


@dataclass(frozen=True)
class EncoderShape:
    """What an encoder's FLOPs depend on."""

    layers: int
    hidden: int
    intermediate: int

    def flops_per_token(self) -> float:
        """Matmul FLOPs per token of every layer's projections and feed-forward (attention's
        length-squared products left out): the model's size as a cost, whatever the text."""
        return self.layers * 2 * (4 * self.hidden * self.hidden + 2 * self.hidden * self.intermediate)

    def flops_per_text(self, tokens: int) -> float:
        """Matmul FLOPs of one text of ``tokens`` tokens through every layer."""
        attention = 2 * 2 * tokens * tokens * self.hidden  # scores (QK^T) and the weighted sum of values
        return tokens * self.flops_per_token() + self.layers * attention


def instruction_set(flags: set[str], vendor: str, precision: str, family: int = 0) -> str | None:
    """The key of :data:`FLOPS_PER_CYCLE` this CPU uses for ``precision`` (None: no native path)."""
    full = "intel" in vendor.lower() or family >= AMD_FULL_WIDTH_FAMILY
    avx512 = "avx512-full" if full else "avx512-half"
    if precision == "bf16":
        if "amx_bf16" in flags:
            return "amx"
        return avx512 if "avx512_bf16" in flags else None
    if precision == "int8" and "amx_int8" in flags:
        return "amx"
    if precision == "int8" and "avx512_vnni" not in flags:
        return "avx2" if "avx2" in flags else None
    if "avx512f" in flags:
        return avx512
    return "avx2" if "avx2" in flags else None


def peak_flops(flags: set[str], vendor: str, precision: str, cores: int, ghz: float,
               family: int = 0) -> tuple[float, str] | None:
    """(FLOP/s, the instruction set assumed) for ``precision`` on ``cores`` at ``ghz``, or None."""
    key = instruction_set(flags, vendor, precision if precision in FLOPS_PER_CYCLE else "fp32", family)
    table = FLOPS_PER_CYCLE.get(precision, FLOPS_PER_CYCLE["fp32"])
    if key is None or key not in table:
        return None
    return cores * ghz * 1e9 * table[key], key


def number_format(precision: str) -> str:
    """The arithmetic a bench row's precision label runs in (``openvino-bf16``, ``bf16 autocast``: bf16)."""
    return next((f for f in ("int8", "bf16", "fp16") if f in precision), "fp32")


def mean_flops(shape: EncoderShape, token_counts: list[int]) -> float:
    """FLOPs per text, averaged over the texts actually sent (attention grows with the square)."""
    return sum(shape.flops_per_text(n) for n in token_counts) / len(token_counts)


def fraction_of_peak(texts_per_s: float, flops_per_text: float, peak: float) -> float:
    """The share of the peak a path's throughput amounts to."""
    return texts_per_s * flops_per_text / peak


def encoder_shape(model_dir) -> EncoderShape:
    """The shape of the checkpoint's encoder, read through its family handler (one home for config keys)."""
    from nexus_sli.exporter.export.handler import get_registry
    from nexus_sli.exporter.export.source import load_config

    config = load_config(model_dir)
    family = get_registry().detect_family(config).family
    hidden = int(family.hidden_size(config))
    return EncoderShape(int(family.num_layers(config)), hidden, int(family.ffn_width(config) or 4 * hidden))


def clock_ghz(cpuinfo: dict[str, str]) -> float | None:
    """The clock /proc/cpuinfo reports (on a virtual machine often the nominal one)."""
    try:
        return float(cpuinfo["cpu MHz"]) / 1000
    except (KeyError, ValueError):
        return None


def summary(model_dir, token_counts: list[int], rows: list[dict], modes: tuple[str, ...]) -> dict:
    """The estimate for ``latest.json``: FLOPs per text, the peaks, and each throughput row's share."""
    from nexus_sli.exporter.targets.cpu import cpu_flags, cpuinfo

    info, flags = cpuinfo(), cpu_flags()
    ghz, cores = clock_ghz(info), len(os.sched_getaffinity(0))
    flops = mean_flops(encoder_shape(model_dir), token_counts)
    family = int(info.get("cpu family", "0") or 0)
    result = {"flops_per_text": round(flops), "clock_ghz": ghz, "cores": cores,
              "vendor": info.get("vendor_id", "unknown"), "cpu_family": family, "peaks": {}, "rows": []}
    if ghz is None:
        return result
    for number in sorted({number_format(r["precision"]) for r in rows} | {"fp32"}):
        found = peak_flops(flags, result["vendor"], number, cores, ghz, family)
        if found:
            result["peaks"][number] = {"flops": found[0], "instruction_set": found[1]}
    for row in rows:
        peak = result["peaks"].get(number_format(row["precision"]))
        if row["mode"] in modes and peak and row["texts_per_s"]:
            count = row.get("threads")
            threads = f" ({count} torch thread{'s' if count > 1 else ''})" if count else ""
            result["rows"].append({"path": row["path"] + threads, "precision": row["precision"],
                                   "protocol": row["protocol"],
                                   "mode": row["mode"], "texts_per_s": row["texts_per_s"],
                                   "gflops": round(row["texts_per_s"] * flops / 1e9, 2),
                                   "share_of_peak": round(fraction_of_peak(row["texts_per_s"], flops, peak["flops"]), 4)})
    return result
