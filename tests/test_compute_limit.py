"""The bench's compute-limit estimate: FLOP counts and peaks from the CPU's instruction sets."""

from __future__ import annotations

import pytest

from nexus_sli.bench.compute_limit import (EncoderShape, fraction_of_peak, instruction_set, mean_flops, number_format,
                                           peak_flops)

MINILM = EncoderShape(layers=6, hidden=384, intermediate=1536)


def test_flops_count_projections_feed_forward_and_attention():
    # one token: 4 d^2 projections + 2 d*ffn feed-forward, 2 FLOPs per multiply-add, plus 4 n^2 d attention
    assert MINILM.flops_per_text(1) == 6 * (2 * (4 * 384**2 + 2 * 384 * 1536) + 4 * 384)
    # attention's share grows with the square of the length
    assert MINILM.flops_per_text(256) - 2 * MINILM.flops_per_text(128) == 6 * 4 * 384 * (256**2 - 2 * 128**2)
    assert mean_flops(MINILM, [10, 30]) == (MINILM.flops_per_text(10) + MINILM.flops_per_text(30)) / 2


ZEN = {"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}
SAPPHIRE_RAPIDS = {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8"}


@pytest.mark.parametrize("flags, vendor, family, precision, expected", [
    ({"avx2"}, "AuthenticAMD", 23, "fp32", "avx2"),
    ({"avx2"}, "AuthenticAMD", 23, "bf16", None),  # no native bf16: no peak to compare with
    (ZEN, "AuthenticAMD", 25, "bf16", "avx512-half"),  # Zen 4: AVX-512 on 256-bit units
    (ZEN, "AuthenticAMD", 26, "fp32", "avx512-full"),  # Zen 5: full-width units
    (ZEN, "GenuineIntel", 6, "int8", "avx512-full"),
    (SAPPHIRE_RAPIDS, "GenuineIntel", 6, "bf16", "amx"),
    (SAPPHIRE_RAPIDS, "GenuineIntel", 6, "fp32", "avx512-full"),
])
def test_the_instruction_set_follows_the_flags_vendor_and_family(flags, vendor, family, precision, expected):
    assert instruction_set(flags, vendor, precision, family) == expected


def test_peak_and_fraction():
    peak, key = peak_flops({"avx2", "avx512f"}, "AuthenticAMD", "fp32", cores=2, ghz=2.0, family=25)
    assert (peak, key) == (2 * 2.0e9 * 32, "avx512-half")
    assert fraction_of_peak(100.0, 1.28e9, peak) == pytest.approx(1.0)
    assert peak_flops({"avx2"}, "AuthenticAMD", "bf16", cores=2, ghz=2.0) is None


@pytest.mark.parametrize("clock", [{"cpu MHz": "2000.000"}, {}], ids=["clock", "no clock"])
def test_the_summary_reads_the_packaged_model_and_rates_each_throughput_row(monkeypatch, clock):
    from nexus_sli.bench.compute_limit import encoder_shape, summary
    from nexus_sli.exporter.export.source import resolve_model
    from nexus_sli.exporter.targets import cpu

    # an AVX2 machine's /proc/cpuinfo, with and without the clock (many virtual machines report none)
    monkeypatch.setattr(cpu, "cpuinfo", lambda: {"vendor_id": "AuthenticAMD", "cpu family": "23", **clock})
    monkeypatch.setattr(cpu, "cpu_flags", lambda: {"avx2", "fma"})
    path = resolve_model(None).path
    assert encoder_shape(path) == MINILM  # all-MiniLM-L6-v2, read through its family handler
    rows = [{"path": "triton", "precision": "fp32", "protocol": "grpc", "mode": "batch32", "texts_per_s": 37.0},
            {"path": "triton", "precision": "fp32", "protocol": "grpc", "mode": "latency1", "texts_per_s": 50.0}]
    limit = summary(path, [20, 40], rows, ("batch32",))
    assert limit["flops_per_text"] == round(mean_flops(MINILM, [20, 40]))
    if not clock:  # no peak to compare with: no share is made up
        assert (limit["clock_ghz"], limit["peaks"], limit["rows"]) == (None, {}, [])
        return
    assert limit["clock_ghz"] == 2.0 and list(limit["peaks"]) == ["fp32"]
    assert [r["mode"] for r in limit["rows"]] == ["batch32"]
    row = limit["rows"][0]
    # a fraction kept to 4 decimals: exact to half its last digit, however small it is on a machine of many cores
    assert row["share_of_peak"] == pytest.approx(
        37.0 * limit["flops_per_text"] / limit["peaks"]["fp32"]["flops"], abs=5e-5)


def test_bench_precision_labels_map_to_their_arithmetic():
    assert [number_format(p) for p in ("fp32", "int8", "openvino-bf16", "bf16 autocast", "openvino-int8", "fp16")] \
        == ["fp32", "int8", "bf16", "bf16", "int8", "fp16"]
