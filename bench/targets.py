"""The bench's targets, judged on the default export with paired per-repetition ratios.

Every speed target compares the served default configuration (what ``auto``
exports on this machine) with a reference measured in the same repetition:
repetition r's ratio is the path's figure in repetition r over the reference's
figure in repetition r, so a machine that slows down between repetitions slows
both sides of each ratio alike.  A target is *met* when every repetition (two
at least) meets its bound, or when the median of those ratios meets it **and**
their spread is under :data:`SPREAD_LIMIT`; otherwise it is *not met* (with the
gap), *not settled* (the median meets the bound, but some repetition does not
and the repetitions disagree), or *not measured* (no peer, no default row).  The
spread is reported either way, as the measurement's quality.

Spread: the interquartile range of the per-repetition values over the absolute
value of their median.  Unlike (max - min), a single repetition disturbed by a
neighbour's process does not dominate it once there are five or more repetitions,
so adding repetitions can settle a target (the range only ever grows).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .compute_limit import fraction_of_peak, number_format
from .measure import (
    BATCH32, CONCURRENT16, GATEWAY_PATH, GATEWAY_PROTOCOL, LATENCY1, OPENAI_PLAIN_PROTOCOL, PAIRED32,
    SHORT32, in_process_precision)

#: fidelity the default configuration needs before its speed counts (cosine to the reference)
QUALIFYING = {"cosine_mean": 0.995, "cosine_min": 0.98}
#: a target is settled when the spread of its per-repetition values is under this share of their median
SPREAD_LIMIT = 0.10
FP32_SERVED_COSINE_MIN = 0.99999

SERVED = "triton"
IN_PROCESS = "in-process"
PEER_KINDS = ("in-process", "server")

#: the status of one comparison
MET, NOT_MET, NOT_SETTLED, NOT_MEASURED = "met", "not met", "not settled", "not measured"


@dataclass(frozen=True)
class Bound:
    """``value op bound``: ``>=`` for speed-ups, ``<=`` for latency ratios and milliseconds."""

    op: str
    value: float
    unit: str = "x"

    def holds(self, value: float) -> bool:
        return value >= self.value if self.op == ">=" else value <= self.value

    def text(self) -> str:
        return f"{self.op} {self._fmt(self.value)}"

    def _fmt(self, value: float) -> str:
        if self.unit == "%":  # a share: values are fractions
            return f"{value:.0%}"
        return f"{value:.2f}{self.unit}" if self.unit == "x" else f"{value:.2f} {self.unit}"

    def gap(self, median: float) -> str:
        """How far ``median`` is from the bound, in the bound's terms."""
        if self.unit == "%":
            return f"{self._fmt(median)} measured, {self.text()} needed"
        if self.unit != "x":
            return f"{self._fmt(median)} measured, {self._fmt(abs(median - self.value))} over"
        if self.op == ">=":
            return f"{self._fmt(median)} measured, {self.text()} needed: {self.value / median:.2f}x short"
        return f"{self._fmt(median)} measured, {self.text()} allowed: {median / self.value - 1:.0%} over"


# --- fidelity --------------------------------------------------------------------------------------

def _nan_first(value: float) -> tuple[bool, float]:
    return (value == value, value)  # NaN != NaN: (False, nan) sorts before every number


def lowest_cosine(cosines) -> float:
    """The lowest of ``cosines``, NaN (a path's output that was not finite) before any number: Python's
    ``min`` keeps or skips a NaN depending on where it stands."""
    return min(cosines, key=_nan_first)


# --- paired arithmetic -----------------------------------------------------------------------------

def paired_ratios(values: list[float | None], reference: list[float | None]) -> list[float]:
    """``values[r] / reference[r]`` for every repetition both have a figure for."""
    return [v / r for v, r in zip(values, reference) if v is not None and r is not None and r > 0]


def paired_differences(values: list[float | None], reference: list[float | None]) -> list[float]:
    """``values[r] - reference[r]`` for every repetition both have a figure for."""
    return [v - r for v, r in zip(values, reference) if v is not None and r is not None]


def spread(values: list[float]) -> float | None:
    """Interquartile range over ``|median|`` (module docstring); None below two repetitions."""
    if len(values) < 2:
        return None
    median = float(np.median(values))
    q25, q75 = np.percentile(values, [25, 75])
    return float(q75 - q25) / abs(median) if median else float("inf")


# --- one comparison --------------------------------------------------------------------------------

def _result(target: str, comparison: str, bound: Bound, values: list[float], config: str | None,
            unqualified: str = "", missing: str = "not measured in this run", context: str = "") -> dict:
    """The verdict on one comparison's per-repetition ``values`` (``missing``: why there are none;
    ``unqualified``: why the configuration's fidelity keeps its speed from counting; ``context``:
    a figure of the same run that puts a miss in proportion, added to the gap)."""
    base = {"target": target, "comparison": comparison, "required": bound.text(), "config": config,
            "per_repetition": [round(v, 6) for v in values], "repetitions": len(values),
            "qualifies": not unqualified}
    if not values:
        return {**base, "median": None, "spread": None, "status": NOT_MEASURED, "met": False, "gap": missing}
    median, dispersion = float(np.median(values)), spread(values)
    if unqualified:
        status, gap = NOT_MET, unqualified
    elif not bound.holds(median):
        status, gap = NOT_MET, bound.gap(median)
        if dispersion is not None and dispersion >= SPREAD_LIMIT:
            gap += f" (spread {dispersion:.0%}: the gap itself is uncertain)"
    elif dispersion is None:
        status, gap = NOT_SETTLED, "one repetition: no spread to judge"
    elif all(bound.holds(v) for v in values):  # however noisy, no repetition missed it
        status, gap = MET, ""
    elif dispersion >= SPREAD_LIMIT:
        status, gap = NOT_SETTLED, f"spread {dispersion:.0%} >= {SPREAD_LIMIT:.0%}"
    else:
        status, gap = MET, ""
    if gap and context:
        gap += f"; {context}"
    return {**base, "median": round(median, 6), "spread": None if dispersion is None else round(dispersion, 6),
            "status": status, "met": status == MET, "gap": gap}


def _no_peer(target: str, comparison: str, bound: Bound, config: str | None, kind: str) -> dict:
    return _result(target, comparison, bound, [], config, missing=f"no {kind} was measured in this run")


def _missing_served(rows: "Rows", mode: str) -> str:
    if rows.default is None:
        return "the default configuration is unknown (no auto export to read it from)"
    return f"no served {rows.default['label']} row in this mode"


# --- the rows a target reads -----------------------------------------------------------------------

@dataclass
class Rows:
    """The rows of one run that the targets compare, looked up once."""

    rows: list[dict]
    default: dict | None

    def served(self, mode: str, protocol: str) -> dict | None:
        if self.default is None:
            return None
        return next((r for r in self.rows if r["path"] == SERVED and r.get("peer") is None and r["mode"] == mode
                     and r["precision"] == self.default["label"] and r["protocol"] == protocol), None)

    def gateway(self, mode: str, protocol: str) -> dict | None:
        """The default configuration through the HTTP gateway's route ``protocol`` (bench/paths.py)."""
        if self.default is None:
            return None
        return next((r for r in self.rows if r["path"] == GATEWAY_PATH and r["mode"] == mode
                     and r["precision"] == self.default["label"] and r["protocol"] == protocol), None)

    def protocols(self) -> list[str]:
        if self.default is None:
            return []
        return list(dict.fromkeys(r["protocol"] for r in self.rows if r["path"] == SERVED
                                  and r.get("peer") is None and r["precision"] == self.default["label"]))

    def reference(self, mode: str) -> dict | None:
        """The baseline's reference row (sentence-transformers, or its fallback) of ``mode``."""
        return next((r for r in self.rows if r.get("baseline") and r["mode"] == mode), None)

    def peers(self, mode: str, kinds: tuple[str, ...]) -> list[dict]:
        return [r for r in self.rows if r.get("peer") in kinds and r["mode"] == mode]

    def in_process_graph(self, mode: str) -> dict | None:
        """The default configuration's exported graph run in process (GraphEncoder)."""
        if self.default is None:
            return None
        return next((r for r in self.rows if r["protocol"] == IN_PROCESS and r.get("peer") is None
                     and not r.get("baseline") and r["mode"] == mode and r["path"] == self.default["backend"]
                     and r["precision"] == in_process_precision(self.default["label"])), None)

    def unqualified(self) -> str:
        """Why the default configuration's fidelity does not qualify it ("" when it does)."""
        measured = [r for r in (self.served(m, p) for m in (BATCH32, CONCURRENT16) for p in self.protocols()) if r]
        if not measured:
            return "the default configuration's fidelity was not measured"
        mean = lowest_cosine(r["cosine_mean"] for r in measured)
        low = lowest_cosine(r["cosine_min"] for r in measured)
        if mean >= QUALIFYING["cosine_mean"] and low >= QUALIFYING["cosine_min"]:
            return ""
        return (f"does not qualify: cosine mean {mean:.4f} (>= {QUALIFYING['cosine_mean']} needed), "
                f"min {low:.4f} (>= {QUALIFYING['cosine_min']} needed)")


def _rates(row: dict) -> list[float | None]:
    return row.get("texts_per_s_reps") or []


def _p50s(row: dict) -> list[float | None]:
    return row.get("p50_ms_reps") or []


def _config(rows: Rows, protocol: str | None) -> str | None:
    if rows.default is None:
        return None
    d = rows.default
    over = f" over {protocol}" if protocol else ""
    return f"served {d['label']} ({d['backend']} {d['precision']}, the default export){over}"


def _best_protocol(rows: Rows, mode: str, score) -> str | None:
    """The client protocol on which the default configuration did best in ``mode`` (median figure)."""
    found = [(score(row), p) for p in rows.protocols() if (row := rows.served(mode, p)) is not None]
    return max(found)[1] if found else None


# --- the targets -----------------------------------------------------------------------------------

def _throughput(rows: Rows, target: str, mode: str, st_bound: float, peer_bound: float | None,
                peer_kinds: tuple[str, ...], peer_name: str, reference_mode: str = BATCH32) -> list[dict]:
    """``mode``'s texts/s against the baseline's batches of 32 (on ``reference_mode``'s texts) and, unless
    ``peer_bound`` is None, against the fastest peer of ``peer_kinds``."""
    protocol = _best_protocol(rows, mode, lambda r: r["texts_per_s"])
    served = rows.served(mode, protocol) if protocol else None
    config, unqualified = _config(rows, protocol), rows.unqualified() if served else ""
    reference = rows.reference(reference_mode)
    values = paired_ratios(_rates(served), _rates(reference)) if served and reference else []
    name = reference["path"] if reference else "sentence-transformers"
    missing = _missing_served(rows, mode) if served is None else "no baseline row"
    results = [_result(target, f"vs {name} encode(batch_size=32)", Bound(">=", st_bound), values, config,
                       unqualified, missing)]
    if peer_bound is None:
        return results
    peers = rows.peers(mode, peer_kinds)
    if not peers:
        results.append(_no_peer(target, f"vs the fastest {peer_name}", Bound(">=", peer_bound), config, peer_name))
        return results
    fastest = max(peers, key=lambda r: r["texts_per_s"])
    values = paired_ratios(_rates(served), _rates(fastest)) if served else []
    results.append(_result(target, f"vs the fastest {peer_name}: {fastest['path']} ({fastest['peer']})",
                           Bound(">=", peer_bound), values, config, unqualified, _missing_served(rows, mode)))
    return results


def _latency(rows: Rows) -> list[dict]:
    """(c): the single short query's p50 against the baseline's and every peer server's, its
    p99 against its p50, and the serving overhead over the same graph run in process."""
    target = "(c) single short query"
    protocol = _best_protocol(rows, LATENCY1, lambda r: -(r["p50_ms"] or float("inf")))
    served = rows.served(LATENCY1, protocol) if protocol else None
    config, unqualified = _config(rows, protocol), rows.unqualified() if served else ""
    reference = rows.reference(LATENCY1)
    name = reference["path"] if reference else "sentence-transformers"
    p50s = _p50s(served) if served else []
    missing = _missing_served(rows, LATENCY1) if served is None else "no baseline row"
    results = [_result(target, f"p50 vs {name}'s batch-1 p50", Bound("<=", 0.9),
                       paired_ratios(p50s, _p50s(reference)) if reference else [], config, unqualified, missing)]
    missing = _missing_served(rows, LATENCY1)
    peers = rows.peers(LATENCY1, ("server",))
    if peers:
        # "<= every peer server's": the peer server with the lowest p50 decides
        fastest = min(peers, key=lambda r: r["p50_ms"] if r["p50_ms"] is not None else float("inf"))
        results.append(_result(target, f"p50 vs every peer server's (lowest: {fastest['path']})", Bound("<=", 1.0),
                               paired_ratios(p50s, _p50s(fastest)), config, unqualified, missing))
    else:
        results.append(_no_peer(target, "p50 vs every peer server's", Bound("<=", 1.0), config, "peer server"))
    p99s = (served.get("p99_ms_reps") or []) if served else []
    graph = rows.in_process_graph(LATENCY1)
    # The graph's own tail in process, on the same queries in the same repetitions: what is left
    # of p99 / p50 with no server in the way (the machine's and the runtime's jitter).
    own_tail = paired_ratios(graph.get("p99_ms_reps") or [], _p50s(graph)) if graph else []
    context = (f"the same graph in process: p99 {float(np.median(own_tail)):.2f}x its p50 in this run"
               if own_tail else "")
    results.append(_result(target, "p99 vs its own p50", Bound("<=", 1.5), paired_ratios(p99s, p50s), config,
                           unqualified, missing, context))
    overhead = paired_differences(p50s, _p50s(graph)) if graph else []
    comparison = ("serving overhead: served p50 minus the same graph's in-process p50 "
                  f"({graph['path']} {graph['precision']})" if graph else
                  "serving overhead: no in-process single-query row of the default graph")
    results.append(_result(target, comparison, Bound("<=", 2.0, "ms"), overhead, config, unqualified,
                           missing if graph else "the default graph was not run in process on single queries"))
    return results


def _share_of_peak(rows: Rows, limit: dict | None) -> list[dict]:
    """(e): the default's served batches of 32 as a share of the estimated peak of the arithmetic it
    runs (the int8 peak when it runs int8; bench/compute_limit.py), repetition by repetition."""
    target, comparison = "(e) share of the compute peak", "served batches of 32 over the precision's estimated peak"
    protocol = _best_protocol(rows, BATCH32, lambda r: r["texts_per_s"])
    served = rows.served(BATCH32, protocol) if protocol else None
    config = _config(rows, protocol)
    peak = ((limit or {}).get("peaks") or {}).get(number_format(served["precision"])) if served else None
    if served is None or peak is None:
        why = _missing_served(rows, BATCH32) if served is None else "no peak estimate for its precision in this run"
        return [_result(target, comparison, Bound(">=", 0.35, "%"), [], config, missing=why)]
    shares = [fraction_of_peak(rate, limit["flops_per_text"], peak["flops"]) for rate in _rates(served) if rate]
    return [_result(target, f"{comparison} ({number_format(served['precision'])}, {peak['instruction_set']})",
                    Bound(">=", 0.35, "%"), shares, config, rows.unqualified())]


#: target (f)'s bounds: a short query over gRPC against the same graph in process, the OpenAI route's
#: (through the SDK) against gRPC's, and the OpenAI route's batches of 32 against the client's over gRPC,
#: the two sent in turn
GRPC_OVER_GRAPH, OPENAI_OVER_GRPC, OPENAI_BATCHES = Bound("<=", 1.8), Bound("<=", 1.5, "ms"), Bound(">=", 0.95)


def sdk_share(rows: Rows) -> list[float]:
    """Per repetition, the OpenAI route's single-query p50 through the ``openai`` SDK minus the same
    route's from a plain HTTP client: the SDK's own work in the caller, of the route's gap to gRPC."""
    sdk, plain = rows.gateway(LATENCY1, GATEWAY_PROTOCOL), rows.gateway(LATENCY1, OPENAI_PLAIN_PROTOCOL)
    return paired_differences(_p50s(sdk), _p50s(plain)) if sdk and plain else []


def plain_batches(rows: Rows) -> list[float]:
    """Per repetition, the OpenAI route's batches of 32 from a plain HTTP client over gRPC's, sent in
    turn with the SDK's (bench/paired.py): the route's own cost, without the SDK's work in the caller."""
    plain, grpc = rows.gateway(PAIRED32, OPENAI_PLAIN_PROTOCOL), rows.served(PAIRED32, "grpc")
    return paired_ratios(_rates(plain), _rates(grpc)) if plain and grpc else []


def openai_batches(rows: Rows) -> tuple[str, dict | None, dict | None]:
    """(f)'s batch comparison: its wording, the OpenAI route's row (through the SDK) and gRPC's, with
    the route's own ratio from plain HTTP beside it where a run has it.  The paths sent in turn, request
    by request (bench/paired.py); a run from before they were keeps its blocks, said so."""
    comparison = "OpenAI route batches of 32 vs gRPC's"
    openai, grpc = rows.gateway(PAIRED32, GATEWAY_PROTOCOL), rows.served(PAIRED32, "grpc")
    plain = plain_batches(rows)
    if openai or grpc:
        route = (f"; through the openai SDK; the route from plain HTTP over gRPC: {float(np.median(plain)):.2f}x"
                 if plain else "")
        return f"{comparison} (sent in turn, request by request{route})", openai, grpc
    return (f"{comparison} (in blocks: a run from before they were sent in turn)",
            rows.gateway(BATCH32, GATEWAY_PROTOCOL), rows.served(BATCH32, "grpc"))


def _request_path(rows: Rows) -> list[dict]:
    """(f): what each layer in front of the default graph adds to a short query, on the served default:
    Triton over gRPC against the same graph in process, the gateway's OpenAI route (through the SDK,
    what its users see) against gRPC direct, with the SDK's own share beside it, and the OpenAI
    route's batches of 32 against the client's over gRPC, sent in turn."""
    target = "(f) the request path"
    graph, grpc = rows.in_process_graph(LATENCY1), rows.served(LATENCY1, "grpc")
    openai_single = rows.gateway(LATENCY1, GATEWAY_PROTOCOL)
    sdk = sdk_share(rows)
    single = "OpenAI route p50 minus gRPC p50" + (
        f" (through the openai SDK; the SDK's own share, its p50 minus plain HTTP's on the route: "
        f"{float(np.median(sdk)):.2f} ms)" if sdk else "")
    batches, openai_paired, grpc_paired = openai_batches(rows)
    config, unqualified = _config(rows, "grpc"), rows.unqualified() if grpc else ""
    comparisons = [
        ("gRPC p50 vs the same graph's in-process p50", GRPC_OVER_GRAPH, grpc, graph, paired_ratios, _p50s),
        (single, OPENAI_OVER_GRPC, openai_single, grpc, paired_differences, _p50s),
        (batches, OPENAI_BATCHES, openai_paired, grpc_paired, paired_ratios, _rates),
    ]
    results = []
    for comparison, bound, measured, reference, pair, figures in comparisons:
        values = pair(figures(measured), figures(reference)) if measured and reference else []
        missing = ("the default configuration is unknown (no auto export to read it from)" if rows.default is None
                   else "a row of this comparison was not measured in this run")
        results.append(_result(target, comparison, bound, values, config, unqualified, missing))
    return results


def _fp32_fidelity(rows: list[dict]) -> list[dict]:
    fp32 = [r for r in rows if r["path"] == SERVED and r["precision"] == "fp32" and r["cosine_min"] is not None]
    if not fp32:
        return []
    worst = min(fp32, key=lambda r: _nan_first(r["cosine_min"]))
    met = worst["cosine_min"] >= FP32_SERVED_COSINE_MIN
    return [{"target": "fp32 served fidelity", "comparison": "min cosine to the reference's embeddings",
             "required": f">= {FP32_SERVED_COSINE_MIN}", "median": worst["cosine_min"], "spread": None,
             "repetitions": worst.get("repetitions"), "per_repetition": [], "qualifies": True,
             "status": MET if met else NOT_MET,
             "met": met, "config": f"served fp32 over {worst['protocol']}, {worst['mode']}",
             "gap": "" if met else f"min cosine {worst['cosine_min']:.6f} < {FP32_SERVED_COSINE_MIN}"}]


def evaluate(rows: list[dict], default: dict | None, limit: dict | None = None) -> list[dict]:
    """Every comparison of targets (a)-(f) and the fp32 fidelity row: required, median and spread of
    the per-repetition values, status, the configuration and the gap.

    ``default``: the configuration ``auto`` exports on this machine, ``{"label", "backend",
    "precision"}`` (``label``: the served rows' precision column); None when unknown, and then
    every speed target is *not measured*.  ``limit``: the run's compute-limit estimate
    (:func:`compute_limit.summary`), for (e); without it (e) is *not measured*."""
    found = Rows(rows, default)
    return [
        *_throughput(found, "(a) client batches of 32", BATCH32, 2.5, 1.3, PEER_KINDS, "peer"),
        *_throughput(found, "(b) 16 concurrent single-text clients", CONCURRENT16, 2.0, 1.5, ("server",),
                     "peer server"),
        *_latency(found),
        *_throughput(found, "(d) client batches of 32 short texts (<= 16 tokens, in arrival order)", SHORT32, 2.5,
                     None, (), "", reference_mode=SHORT32),
        *_share_of_peak(found, limit),
        *_request_path(found),
        *_fp32_fidelity(rows),
    ]


def judge(results: dict) -> list[dict]:
    """A run's comparisons judged by the current targets from its rows' per-repetition figures: a page
    rendered again from a kept run states verdicts that follow the rules it states."""
    return evaluate(results["rows"], results.get("default_configuration"), results.get("compute_limit"))


def unsettled(results: list[dict]) -> list[dict]:
    """The comparisons more repetitions could settle: measured on a qualifying configuration, with a
    spread at or over the limit (an unqualified configuration's speed never counts, however settled)."""
    return [t for t in results if t["qualifies"] and t["status"] != MET and t["spread"] is not None
            and t["spread"] >= SPREAD_LIMIT]


def median_text(target: dict) -> str:
    """A target's median in its bound's terms (x, %, ms, or a cosine)."""
    median = target["median"]
    if median is None:
        return "-"
    if "fidelity" in target["target"]:
        return f"{median:.6f}"
    if target["required"].endswith("%"):
        return f"{median:.1%}"
    return f"{median:.2f} ms" if target["required"].endswith("ms") else f"{median:.2f}x"
