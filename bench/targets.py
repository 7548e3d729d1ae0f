"""The speed and fidelity targets of issue 6, checked against one run's rows.

Every target is a ratio to the sentence-transformers fp32 baseline measured in
the same run, so the figures hold on a noisy, shared machine.
"""

from __future__ import annotations

from .measure import BATCH32, CONCURRENT16, LATENCY1

#: fidelity a served configuration needs before its speed counts
QUALIFYING = {"cosine_mean": 0.995, "cosine_min": 0.98}
BATCH32_SPEEDUP = 3.0
CONCURRENT16_SPEEDUP = 2.0
LATENCY_P50_VS_BASELINE = 1.0
P99_VS_P50 = 1.5
FP32_SERVED_COSINE_MIN = 0.99999

SERVED = "triton"


def _served_configs(rows: list[dict]) -> dict[tuple[str, str], dict[str, dict]]:
    configs: dict[tuple[str, str], dict[str, dict]] = {}
    for row in rows:
        if row["path"] == SERVED and row["mode"] in (BATCH32, CONCURRENT16, LATENCY1):
            configs.setdefault((row["precision"], row["protocol"]), {})[row["mode"]] = row
    return configs


def _qualifies(modes: dict[str, dict]) -> bool:
    """Fidelity on the full text set (the batch and concurrent rows) meets the bar."""
    measured = [modes[m] for m in (BATCH32, CONCURRENT16) if m in modes]
    return bool(measured) and all(
        r["cosine_mean"] is not None and r["cosine_mean"] >= QUALIFYING["cosine_mean"]
        and r["cosine_min"] >= QUALIFYING["cosine_min"] for r in measured)


def _name(config: tuple[str, str]) -> str:
    return f"served {config[0]} over {config[1]}"


def _result(target: str, required: str, measured: float | None, met: bool, config: str | None, gap: str) -> dict:
    return {"target": target, "required": required, "measured": None if measured is None else round(measured, 6),
            "met": met, "config": config, "gap": "" if met else gap}


def _speedup(configs, qualifying, mode: str, required: float, target: str) -> dict:
    candidates = [(modes[mode]["ratio_vs_baseline"], config) for config, modes in configs.items()
                  if config in qualifying and mode in modes]
    if not candidates:
        return _result(target, f">= {required:.1f}x", None, False, None, "no served configuration qualifies")
    ratio, config = max(candidates)
    return _result(target, f">= {required:.1f}x", ratio, ratio >= required, _name(config),
                   f"{ratio:.2f}x measured, {required:.1f}x needed: {required / ratio:.2f}x short")


def _latency(configs, qualifying, rows: list[dict]) -> list[dict]:
    latency = [(modes[LATENCY1], config) for config, modes in configs.items()
               if config in qualifying and LATENCY1 in modes]
    baseline = next((r for r in rows if r.get("baseline") and r["mode"] == LATENCY1), None)
    if not latency or baseline is None:
        return []
    row, config = min(latency, key=lambda item: item[0]["p50_ms"])
    ratio, spread = row["p50_ms"] / baseline["p50_ms"], row["p99_ms"] / row["p50_ms"]
    return [
        _result("(c) served batch-1 p50 vs baseline batch-1 p50", f"<= {LATENCY_P50_VS_BASELINE:.1f}x", ratio,
                ratio <= LATENCY_P50_VS_BASELINE, _name(config),
                f"{row['p50_ms']:.2f} ms served vs {baseline['p50_ms']:.2f} ms baseline: "
                f"{ratio:.2f}x, {row['p50_ms'] - baseline['p50_ms']:.2f} ms over"),
        _result("(c) served batch-1 p99 vs served p50", f"<= {P99_VS_P50:.1f}x", spread, spread <= P99_VS_P50,
                _name(config), f"p99 {row['p99_ms']:.2f} ms = {spread:.2f}x p50 {row['p50_ms']:.2f} ms"),
    ]


def _fp32_fidelity(rows: list[dict]) -> list[dict]:
    fp32 = [r for r in rows if r["path"] == SERVED and r["precision"] == "fp32" and r["cosine_min"] is not None]
    if not fp32:
        return []
    worst = min(fp32, key=lambda r: r["cosine_min"])
    return [_result("fp32 served fidelity: min cosine to sentence-transformers fp32", f">= {FP32_SERVED_COSINE_MIN}",
                    worst["cosine_min"], worst["cosine_min"] >= FP32_SERVED_COSINE_MIN,
                    f"served fp32 over {worst['protocol']}, {worst['mode']}",
                    f"min cosine {worst['cosine_min']:.6f} < {FP32_SERVED_COSINE_MIN}")]


def evaluate(rows: list[dict]) -> list[dict]:
    """Each target: required, measured, met, the configuration it was judged on, and the gap."""
    configs = _served_configs(rows)
    qualifying = {config for config, modes in configs.items() if _qualifies(modes)}
    return [
        _speedup(configs, qualifying, BATCH32, BATCH32_SPEEDUP,
                 "(a) fastest qualifying served config, client batches of 32, vs baseline encode(batch_size=32)"),
        _speedup(configs, qualifying, CONCURRENT16, CONCURRENT16_SPEEDUP,
                 "(b) fastest qualifying served config, 16 concurrent single-text clients, vs baseline"),
        *_latency(configs, qualifying, rows),
        *_fp32_fidelity(rows),
    ]
