"""The bench's arithmetic on synthetic numbers whose answers are worked out by hand: per-repetition
rates and their medians, pooled and per-repetition percentiles, which side of a ratio is which, the
targets' status rule, and fidelity when a path's output is not finite.  No server, no model, no clock."""

from __future__ import annotations

import math

import numpy as np
import pytest

from helpers.bench_rows import DEFAULT, by_comparison, run_rows
from nexus_sli.bench import stack_ceiling
from nexus_sli.bench import targets as bench_targets
from nexus_sli.bench.measure import BATCH32, LATENCY1, Measurement, Sample, cosines
from nexus_sli.bench.results import rows as result_rows


def _scripted(path: str, mode: str, texts: list[str], seconds: list[float], latencies: list[list[float]] | None = None,
              vectors=None, reached: int | None = None, **kwargs) -> Measurement:
    """A measurement whose repetition r takes ``seconds[r]`` with ``latencies[r]``, answering ``vectors`` (a
    function of the texts sent; unit vectors by default) for the first ``reached`` texts (a time-boxed run)."""
    script = iter(range(len(seconds)))
    answer = vectors or (lambda batch: np.tile([1.0, 0.0, 0.0], (len(batch), 1)))

    def run(batch: list[str]) -> Sample:
        r = next(script)
        timed = batch[:reached] if reached else batch
        return Sample(seconds[r], list((latencies or [[]] * len(seconds))[r]), np.asarray(answer(timed), dtype=float))
    return Measurement(path, "fp32", kwargs.pop("protocol", "in-process"), mode, texts, kwargs.pop("tokens", [1] * len(texts)),
                       run, **kwargs)


def _timed(measurements: list[Measurement], repetitions: int) -> list[Measurement]:
    for r in range(repetitions):
        for m in measurements:
            m.time_once(r)
    return measurements


TEXTS = ["a", "b", "c", "d"]


# --- rates and percentiles --------------------------------------------------------------------------

def test_texts_and_tokens_per_second_are_medians_of_each_repetitions_rate():
    # 4 texts of 1, 2, 3 and 4 tokens (10 in all) in 1 s, 2 s and 4 s: 4, 2, 1 texts/s and 10, 5, 2.5 tokens/s
    (m,) = _timed([_scripted("x", BATCH32, TEXTS, [1.0, 2.0, 4.0], tokens=[1, 2, 3, 4])], 3)
    assert m.rates() == [4.0, 2.0, 1.0] and m.texts_per_s() == 2.0 and m.tokens_per_s() == 5.0
    assert m.texts_timed() == 12


def test_percentiles_per_repetition_and_pooled_interpolate_linearly():
    # repetition 0 times 1..10 ms, repetition 1 11..20 ms
    first, second = [float(x) for x in range(1, 11)], [float(x) for x in range(11, 21)]
    (m,) = _timed([_scripted("x", LATENCY1, TEXTS, [1.0, 1.0], [first, second])], 2)
    assert m.percentiles_ms(50) == [5.5, 15.5]
    assert m.percentile_ms(50) == 10.5  # pooled over both repetitions, not the median of the two
    # p99 of 20 samples sits 0.99 x 19 = 18.81 positions in: 19 + 0.81 x (20 - 19), under the maximum
    assert m.percentile_ms(99) == pytest.approx(19.81)
    # a repetition that timed no request has no percentile, and keeps its place for the pairing
    (empty,) = _timed([_scripted("y", LATENCY1, TEXTS, [1.0, 1.0], [[], second])], 2)
    assert empty.percentiles_ms(50) == [None, 15.5]


def test_a_single_querys_speed_up_is_the_baselines_p50_over_the_paths():
    baseline = _scripted("sentence-transformers", LATENCY1, TEXTS, [1.0], [[8.0, 8.0, 8.0]], baseline=True)
    served = _scripted("triton", LATENCY1, TEXTS, [1.0], [[4.0, 4.0, 4.0]], protocol="grpc", served=True)
    batches = _scripted("sentence-transformers", BATCH32, TEXTS, [2.0], baseline=True)
    rows = {r["path"] + r["mode"]: r for r in result_rows(_timed([baseline, served, batches], 1))}
    assert rows["tritonlatency1"]["ratio_vs_baseline"] == 2.0  # 8 ms / 4 ms: above 1x is faster
    assert rows["tritonlatency1"]["p50_ms_reps"] == [4.0]


# --- the targets' status rule -----------------------------------------------------------------------

@pytest.mark.parametrize("served, status", [
    ((240, 286, 262.6), "met"),           # 2.4x, 2.6x, 2.6x: median 2.6x, spread 3.8%: one miss, yet met
    ((200, 286, 323.2), "not settled"),   # 2.0x, 2.6x, 3.2x: the median clears 2.5x, spread 23%
    ((240, 269.5, 303), "not met"),       # 2.4x, 2.45x, 3.0x: the median misses
])
def test_batches_of_32_are_judged_on_the_median_of_paired_ratios_and_their_spread(served, status):
    # the baseline's repetitions: 100, 110, 101 texts/s
    batch = by_comparison(bench_targets.evaluate(run_rows(served_batch=served), DEFAULT))[
        ("(a)", "vs sentence-transformers encode(batch_size=32)")]
    assert batch["status"] == status and batch["met"] == (status == "met")


def test_one_repetition_is_never_settled_however_far_past_the_bound():
    rows = [{**r, **{key: r[key][:1] for key in ("texts_per_s_reps", "p50_ms_reps", "p99_ms_reps")}}
            for r in run_rows()]
    batch = by_comparison(bench_targets.evaluate(rows, DEFAULT))[("(a)", "vs sentence-transformers encode(batch_size=32)")]
    assert batch["per_repetition"] == [3.0] and batch["status"] == "not settled" and batch["spread"] is None


# --- fidelity when an output is not finite ----------------------------------------------------------

def test_a_vector_that_is_not_finite_is_a_nan_cosine_never_a_row_left_out():
    a = np.array([[1.0, 0.0], [np.nan, np.nan], [np.inf, 1.0], [0.0, 2.0]])
    b = np.array([[2.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    found = cosines(a, b)
    assert len(found) == 4 and found[0] == 1.0 and found[3] == 1.0
    assert math.isnan(found[1]) and math.isnan(found[2]) and math.isnan(found.min())


def test_fidelity_covers_the_texts_both_timed_and_counts_a_broken_output():
    def broken(batch):  # NaN for text "c": an fp16 overflow, say
        return np.array([[np.nan] * 3 if text == "c" else [1.0, 0.0, 0.0] for text in batch])

    baseline = _scripted("sentence-transformers", BATCH32, TEXTS, [1.0], baseline=True)
    nan_path = _scripted("triton", BATCH32, TEXTS, [1.0], vectors=broken, protocol="grpc", served=True)
    time_boxed = _scripted("onnxruntime", BATCH32, TEXTS, [1.0], reached=2)  # texts "a" and "b" only
    rows = {r["path"]: r for r in result_rows(_timed([baseline, nan_path, time_boxed], 1))}
    assert math.isnan(rows["triton"]["cosine_min"]) and math.isnan(rows["triton"]["cosine_mean"])
    assert rows["onnxruntime"]["cosine_min"] == 1.0 and rows["onnxruntime"]["texts_timed"] == 2
    assert time_boxed.reached().tolist() == [True, True, False, False]


def _with_cosine(rows: list[dict], mode: str, value: float) -> list[dict]:
    """``rows`` with the served default's row of ``mode`` at cosine mean and min ``value``."""
    return [{**r, "cosine_mean": value, "cosine_min": value} if (r["path"], r["mode"]) == ("triton", mode)
            and r["precision"] == DEFAULT["label"] else r for r in rows]


def test_a_broken_output_disqualifies_the_default_and_fails_fp32_fidelity_wherever_its_row_stands():
    # the concurrent clients' row, after the batches' row: min() over the two would skip its NaN
    rows = _with_cosine(run_rows(cosine=(1.0, 1.0)), "concurrent16", float("nan"))
    results = bench_targets.evaluate(rows, DEFAULT)
    batch = by_comparison(results)[("(a)", "vs sentence-transformers encode(batch_size=32)")]
    assert batch["status"] == "not met" and "does not qualify" in batch["gap"] and "nan" in batch["gap"]
    (fidelity,) = [t for t in results if "fidelity" in t["target"]]
    assert fidelity["status"] == "not met" and math.isnan(fidelity["median"]) and "concurrent16" in fidelity["config"]
    assert math.isnan(bench_targets.lowest_cosine([0.999, float("nan"), 0.5]))
    assert bench_targets.lowest_cosine([0.999, 0.5, 0.7]) == 0.5


# --- the served stack's CPU time ----------------------------------------------------------------------

def test_cpu_seconds_are_user_and_system_ticks_after_the_command_name(monkeypatch):
    # /proc/<pid>/stat: a command name may hold ") ", so fields are counted after the last ")";
    # utime and stime are fields 14 and 15 (250 and 150 ticks of 1/100 s: 4 s)
    stat = "42 (a) b) S 1 2 3 4 5 6 7 8 9 10 250 150 0 0 20 0 1 0"
    monkeypatch.setattr(stack_ceiling, "Path", lambda _: type("Stat", (), {"read_text": lambda self: stat})())
    monkeypatch.setattr(stack_ceiling.os, "sysconf", lambda name: 100)
    assert stack_ceiling.cpu_seconds(42) == 4.0
