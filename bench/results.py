"""The rows of ``latest.json`` from a run's measurements: each path's figures against its
group's reference, and the server's memory and the text set's padding beside them."""

from __future__ import annotations

import numpy as np

from .measure import CONCURRENT16, LATENCY1, Measurement, cosines


def _row(m: Measurement, reference: Measurement, baseline_batch: Measurement) -> dict:
    both = m.reached() & reference.reached()  # time-boxed runs: the texts both timed
    cos = cosines(m.embeddings()[both], reference.embeddings()[both])
    p50, p99 = m.percentile_ms(50), m.percentile_ms(99)
    if m.mode == LATENCY1:
        ratio = reference.percentile_ms(50) / p50 if p50 else None  # speed-up: > 1 is faster
    else:
        against = baseline_batch if m.mode == CONCURRENT16 else reference
        ratio = m.texts_per_s() / against.texts_per_s()
    return {
        "path": m.path, "precision": m.precision, "protocol": m.protocol, "mode": m.mode,
        "seq_len": m.seq_len, "threads": m.threads, "texts": len(m.texts), "texts_timed": m.texts_timed(),
        "repetitions": len(m.samples),
        "texts_per_s": round(m.texts_per_s(), 2), "tokens_per_s": round(m.tokens_per_s(), 1),
        "p50_ms": None if p50 is None else round(p50, 3), "p99_ms": None if p99 is None else round(p99, 3),
        "cosine_mean": round(float(cos.mean()), 7), "cosine_min": round(float(cos.min()), 7),
        "ratio_vs_baseline": None if ratio is None else round(ratio, 3), "baseline": m is reference,
        "peer": m.peer,
        # repetition by repetition, for the targets' paired ratios (bench/targets.py)
        "texts_per_s_reps": [round(x, 3) for x in m.rates()],
        "p50_ms_reps": [None if x is None else round(x, 4) for x in m.percentiles_ms(50)],
        "p99_ms_reps": [None if x is None else round(x, 4) for x in m.percentiles_ms(99)],
    }


def references(measurements: list[Measurement]) -> dict[tuple, Measurement]:
    """Per group of rows, the fastest baseline candidate (highest texts/s; lowest p50 for single queries)."""
    found: dict[tuple, Measurement] = {}
    for m in measurements:
        if not m.baseline:
            continue
        best = found.get(m.group)
        if best is None:
            found[m.group] = m
        elif m.mode == LATENCY1 and m.percentile_ms(50) < best.percentile_ms(50):
            found[m.group] = m
        elif m.mode != LATENCY1 and m.texts_per_s() > best.texts_per_s():
            found[m.group] = m
    return found


def rows(measurements: list[Measurement]) -> list[dict]:
    """The results' rows, one per measurement, each against its group's reference."""
    chosen = references(measurements)
    return [_row(m, chosen[m.group], chosen[("set", None)]) for m in measurements]


def server_memory(idle: list[int], load: list[int], processes: int) -> dict:
    """The served process tree's resident memory, idle and under load, in MB."""
    mb = 2**20
    return {"idle_mb": round(float(np.median(idle)) / mb, 1),
            "load_median_mb": round(float(np.median(load)) / mb, 1) if load else None,
            "load_peak_mb": round(max(load) / mb, 1) if load else None,
            "samples_under_load": len(load), "processes": processes}


def batch_padding(tokens: list[int], facts) -> dict:
    """Real tokens over the tokens the encoder computes when a client sends the set in
    batches of 32 (each batch planned into length groups, as the served encoder does)."""
    from nexus_sli.exporter.serving.backends.batching import length_groups

    real = computed = 0
    for i in range(0, len(tokens), 32):
        lengths = np.minimum(np.array(tokens[i:i + 32]), facts.max_length)
        real += int(lengths.sum())
        computed += sum(len(group) * int(lengths[group].max()) for group in length_groups(lengths))
    return {"served_batch32_real_token_share": round(real / computed, 3)}
