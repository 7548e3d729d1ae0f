"""The results as ``latest.json``, a Markdown page, a plot, and ``BENCHMARKS.md``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from . import cpu_classes
from .stack_ceiling import RECORD as STACK_RECORD
from .stack_ceiling import section as stack_section
from .measure import (
    BATCH32, CONCURRENT16, GATEWAY_PATH, GATEWAY_PROTOCOL, LATENCY1, OPENAI_PLAIN_PROTOCOL, PAIRED32,
    SEQ_LEN, SHORT32, TEI_PROTOCOL)
from .targets import (
    GRPC_OVER_GRAPH, OPENAI_BATCHES, OPENAI_OVER_GRPC, Rows, judge, median_text, openai_batches,
    paired_differences, paired_ratios, plain_batches, sdk_share)

MODE_TEXT = {BATCH32: "batches of 32", CONCURRENT16: "16 concurrent clients, 1 text each",
             LATENCY1: "sequential single short queries",
             SHORT32: "batches of 32 short texts (<= 16 tokens, arrival order)",
             PAIRED32: "batches of 32, gRPC and the OpenAI route in turn"}


def _num(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _threads(row: dict) -> str:
    count = row.get("threads")
    return "" if count is None else f" ({count} torch thread{'s' if count > 1 else ''})"


def _label(row: dict) -> str:
    protocol = "" if row["protocol"] == "in-process" else f" {row['protocol']}"
    return f"{row['path']} {row['precision']}{protocol}{_threads(row)}"


def rows_table(rows: list[dict]) -> list[str]:
    lines = ["| path | precision | protocol | mode | texts/s | tokens/s | p50 ms | p99 ms | cosine mean | cosine min "
             "| vs baseline |", "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["mode"] == SEQ_LEN:
            continue
        name = f"**{r['path']}{_threads(r)}** (baseline)" if r["baseline"] else f"{r['path']}{_threads(r)}"
        if r.get("peer"):
            name = f"*{name}* (peer, {'server' if r['peer'] == 'server' else 'in-process library'})"
        lines.append(
            f"| {name} | {r['precision']} | {r['protocol']} | {MODE_TEXT.get(r['mode'], r['mode'])} "
            f"| {_num(r['texts_per_s'], 1)} | {_num(r['tokens_per_s'], 0)} | {_num(r['p50_ms'], 2)} "
            f"| {_num(r['p99_ms'], 2)} | {_num(r['cosine_mean'], 6)} | {_num(r['cosine_min'], 6)} "
            f"| {_num(r['ratio_vs_baseline'], 2)}x |")
    return lines


def sweep_table(rows: list[dict]) -> list[str]:
    sweep = [r for r in rows if r["mode"] == SEQ_LEN]
    lengths = sorted({r["seq_len"] for r in sweep})
    if not lengths:
        return []
    lines = ["| path | " + " | ".join(f"{n} tokens" for n in lengths) + " |",
             "|---|" + "---:|" * len(lengths)]
    for label in dict.fromkeys(_label(r) for r in sweep):
        by_len = {r["seq_len"]: r for r in sweep if _label(r) == label}
        cells = [f"{by_len[n]['texts_per_s']:.1f} / {by_len[n]['tokens_per_s']:.0f} ({by_len[n]['ratio_vs_baseline']:.2f}x)"
                 if n in by_len else "-" for n in lengths]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def _status(target: dict) -> str:
    status = target["status"]
    if status == "not settled":
        return f"not settled: spread {target['spread']:.0%}" if target["spread"] is not None else "not settled"
    return status if status == "met" else f"**{status}**"


def targets_table(targets: list[dict]) -> list[str]:
    lines = ["| target | comparison | bound | median | spread | reps | status | configuration | gap |",
             "|---|---|---|---:|---:|---:|---|---|---|"]
    for t in targets:
        spread = "-" if t["spread"] is None else f"{t['spread']:.1%}"
        lines.append(f"| {t['target']} | {t['comparison']} | {t['required']} | {median_text(t)} | {spread} "
                     f"| {t['repetitions'] or '-'} | {_status(t)} | {t['config'] or '-'} | {t['gap'] or '-'} |")
    return lines


def cpu_line(machine: dict) -> str:
    """The CPU and the instruction sets that decide which configuration is fastest on it."""
    names = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_vnni": "VNNI", "avx512_bf16": "AVX-512 bf16",
             "amx_tile": "AMX", "amx_int8": "AMX-INT8", "amx_bf16": "AMX-BF16"}
    flags = machine["flags"]
    has = [names.get(f, f) for f, on in flags.items() if on]
    lacks = [names.get(f, f) for f, on in flags.items() if not on]
    return (f"CPU: {machine['cpu_model']}, {machine.get('usable_cores', machine['cores'])} usable cores; "
            f"instruction sets: {', '.join(has) or 'none of those checked'}"
            + (f"; without {', '.join(lacks)}" if lacks else "") + ".")


def default_line(default: dict | None) -> str:
    if not default:
        return ("The default configuration is unknown (the bench's auto export failed or is missing), "
                "so no speed target could be judged.")
    timed = [r for r in default["measured"] if r.get("timings_ms")]
    table = "; ".join(f"{r['backend']} {r['precision']} {r['graph']} "
                      + ", ".join(f"{name} {ms:.1f} ms" for name, ms in r["timings_ms"].items()) for r in timed)
    return (f"Judged on the default export: {default['backend']} {default['precision']} ({default['graph']} graph), "
            f"the configuration `auto` (what `make export` runs) kept on this machine by measuring "
            f"for `{default.get('optimize', 'balanced')}` (its validation.json, the median time of each workload "
            f"for each configuration that passed: {table}). "
            f"Served rows of it are labelled `{default['label']}`."
            + (f" The bench's own export of it kept the {default['served_graph']} graph, not {default['graph']}: "
               "the figures are of that graph." if default.get("served_graph") not in (None, default["graph"])
               else ""))


def limit_line(results: dict) -> str:
    """The share of the compute limit the default configuration's served rows reach."""
    default, limit = results.get("default_configuration"), results.get("compute_limit") or {}
    if not default:
        return ""
    shares = [f"{MODE_TEXT[r['mode']]} over {r['protocol']} {r['share_of_peak']:.1%}"
              for r in limit.get("rows", []) if r["path"] == "triton" and r["precision"] == default["label"]]
    return ("Share of the estimated compute limit the default configuration reaches served (see the "
            "compute-limit section): " + "; ".join(shares) + ".") if shares else ""


def targets_section(results: dict) -> list[str]:
    """The targets: the CPU above the table, what a status means below it."""
    plan = results["settings"].get("repetition_plan") or {}
    stopped = (f" Repetitions: {plan['repetitions']} (at least {plan['minimum']}, at most {plan['maximum']} while "
               f"one more fits in {plan['budget_s']:.0f} s of repetitions; each took "
               f"{', '.join(f'{x:.0f}' for x in plan['repetition_s'])} s); stopped: {plan['stopped']}."
               if plan.get("stopped") else "")
    return [
        "## Targets", "",
        cpu_line(results["machine"]), "",
        default_line(results.get("default_configuration")), "",
        *targets_table(judge(results)), "",
        "Each comparison is paired: repetition r's figure of the default configuration over the compared path's "
        "figure in the same repetition r (texts/s for (a) and (b), against the baseline's batches of 32 for both; "
        "p50 for (c); for the serving overhead the served p50 minus the in-process p50 of the same exported graph "
        "on the same queries, in ms; for (f)'s batches, the OpenAI route's and gRPC's batches of 32 sent in turn, "
        "request by request on the same texts, within the repetition, and their texts/s from each path's summed "
        "request times). `median`: the median of those per-repetition values. `spread`: their "
        "interquartile range over the median's absolute value (robust to one disturbed repetition, so that "
        "added repetitions can settle it). A target is met when every repetition meets the bound, or the median "
        "does and the spread is under 10%; `not settled` when the median meets the bound, some repetition does "
        "not, and the spread is 10% or more; speed "
        "counts only where the default configuration's embeddings keep mean cosine >= 0.995 and min >= 0.98 to "
        "the baseline's. Each target is judged on the client protocol (gRPC or HTTP) on which the default did "
        "best; the peer compared is the fastest of its kind in the same run (for (c), the peer server with the "
        f"lowest p50). `latest.json` keeps every repetition's value.{stopped}", "",
        *([limit_line(results), ""] if limit_line(results) else []),
    ]


def _settings_line(settings: dict) -> str:
    threads = settings["torch_threads"]
    calibration = ", ".join(f"{k} thread(s) {v:.3f} s" for k, v in threads["calibration_s"].items())
    slices = (settings.get("repetition_plan") or {}).get("slices", settings["repetitions"])
    return (f"Batches and concurrent clients: repetition r of the {settings['repetitions']} times one text in "
            f"{slices} of the set (slice r mod {slices}, the same for every path); any {slices} consecutive "
            f"repetitions cover the set once. PyTorch peers ran with {threads['peers']} torch thread(s), the faster for the baseline on "
            f"{threads['calibration_texts']} warm-up texts ({calibration}). Single queries: up to "
            f"{settings['latency_queries']} per path and repetition, at most {settings['latency_budget_s']:.0f} s "
            "(rows list how many were timed in the JSON, `texts_timed`).")


def machine_line(machine: dict) -> str:
    flags = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in machine["flags"].items())
    return (f"{machine['cpu_model']}, {machine['cores']} cores, {machine['memory_gb']} GB; {flags}; "
            f"load average at start {machine['load_average_at_start']}")


def _range(values: list[float]) -> str:
    if not values:
        return "-"
    low, high = f"{min(values):.2f}", f"{max(values):.2f}"
    return f"{low}x" if low == high else f"{low}-{high}x"


def observations(results: dict) -> str:
    """Where the served path's throughput goes: equal-length batches against the mixed set."""
    rows = results["rows"]
    lines = []
    for precision in dict.fromkeys(r["precision"] for r in rows if r["path"] == "triton"):
        at_length = [r["ratio_vs_baseline"] for r in rows
                     if r["path"] == "triton" and r["precision"] == precision and r["mode"] == SEQ_LEN]
        mixed = [r["ratio_vs_baseline"] for r in rows
                 if r["path"] == "triton" and r["precision"] == precision and r["mode"] == BATCH32]
        lines.append(f"served {precision}: {_range(at_length)} the baseline on batches of equal length, "
                     f"{_range(mixed)} on batches of the mixed set")
    share = results["text_set"]["served_batch32_real_token_share"]
    return ("; ".join(lines) + f". In batches of the mixed set {share:.0%} of the tokens the served encoder "
            "computes are real (it runs each batch in length groups); the baseline sorts the whole set by length "
            "before batching." + gateway_overhead(rows))


#: the modes the gateway's OpenAI route is set against gRPC direct in, in the page's words
GATEWAY_MODE_TEXT = {PAIRED32: "batches of 32 sent in turn with gRPC's", BATCH32: "batches of 32 in blocks",
                     CONCURRENT16: MODE_TEXT[CONCURRENT16], LATENCY1: "single queries"}


def gateway_overhead(rows: list[dict]) -> str:
    """The HTTP gateway's rows against the direct gRPC rows of the same model, mode by mode."""
    served = next((r["precision"] for r in rows if r["path"] == GATEWAY_PATH), None)

    def row(path: str, protocol: str, mode: str) -> dict | None:
        return next((r for r in rows if (r["path"], r["precision"], r["protocol"], r["mode"])
                     == (path, served, protocol, mode)), None)

    parts = []
    for mode, what in GATEWAY_MODE_TEXT.items():
        gateway, direct = row(GATEWAY_PATH, GATEWAY_PROTOCOL, mode), row("triton", "grpc", mode)
        if gateway is None or direct is None:
            continue
        if mode == LATENCY1:
            parts.append(f"{what} p50 {gateway['p50_ms']:.2f} ms against {direct['p50_ms']:.2f} ms")
        else:
            parts.append(f"{what} {gateway['texts_per_s']:.1f} texts/s against "
                         f"{direct['texts_per_s']:.1f} ({gateway['texts_per_s'] / direct['texts_per_s']:.2f}x)")
    if not parts:
        return ""
    return (" Through the HTTP gateway (OpenAI's API with the openai SDK, base64 vectors, token counts included) "
            f"against the client over gRPC direct, {served}: " + "; ".join(parts) + ".")


#: the layers of the request path, from the graph alone to the gateway's routes: (protocol, what it is)
REQUEST_PATH = (
    ("in-process", "the exported graph in process (tokenizers + the runtime)"),
    ("grpc", "Triton over gRPC, `EncoderClient`"),
    ("http", "Triton over HTTP, `EncoderClient`"),
    (GATEWAY_PROTOCOL, "gateway, OpenAI `/v1/embeddings` (the `openai` SDK)"),
    (OPENAI_PLAIN_PROTOCOL, "gateway, OpenAI `/v1/embeddings` (plain HTTP, the SDK's JSON body)"),
    (TEI_PROTOCOL, "gateway, TEI `/embed`"),
)


#: the section of bench/data/tried.md on the request path
REQUEST_PATH_TRIED = "A short query, layer by layer, and the gateway's HTTP stack"


def _median_ms(values: list[float]) -> str:
    return f"{float(np.median(values)):+.2f} ms"


def route_split(rows: Rows) -> str:
    """The OpenAI route's single-query gap to gRPC split into the route's own cost (plain HTTP) and
    the SDK's work in the caller; "" where a run did not time the route from a plain HTTP client."""
    grpc, sdk = rows.served(LATENCY1, "grpc"), rows.gateway(LATENCY1, GATEWAY_PROTOCOL)
    plain, share = rows.gateway(LATENCY1, OPENAI_PLAIN_PROTOCOL), sdk_share(rows)
    if not (grpc and sdk and plain and share):
        return ""
    route = paired_differences(plain["p50_ms_reps"], grpc["p50_ms_reps"])
    whole = paired_differences(sdk["p50_ms_reps"], grpc["p50_ms_reps"])
    return ("The OpenAI route's single-query p50 over gRPC's, split (medians over repetitions of the paired "
            f"differences): the route itself, its p50 from a plain HTTP client minus gRPC's, {_median_ms(route)}; "
            f"the `openai` SDK's own work in the caller, the SDK's p50 minus plain HTTP's, {_median_ms(share)}; "
            f"the two together, what target (f) bounds, {_median_ms(whole)}.{sdk_reach(route, share)}")


def sdk_reach(route: list[float], share: list[float]) -> str:
    """How much room the SDK's share leaves the gateway under (f)'s single-query bound."""
    allowed, sdk, own = OPENAI_OVER_GRPC.value, float(np.median(share)), float(np.median(route))
    if not OPENAI_OVER_GRPC.holds(sdk):
        return (f" The SDK's share alone is over the {allowed:g} ms the bound allows: through the SDK the bound "
                "is out of the gateway's reach on this machine.")
    if OPENAI_OVER_GRPC.holds(sdk + own):
        return ""
    return (f" Under the bound's {allowed:g} ms, the SDK's share leaves the route {allowed - sdk:.2f} ms over "
            f"gRPC; its own cost was {own:.2f} ms.")


def paired_batches(rows: Rows) -> str:
    """Target (f)'s batches of 32, the OpenAI route against gRPC sent in turn: each side's texts/s and
    their ratio by repetition; "" for a run from before they were sent in turn."""
    _, openai, grpc = openai_batches(rows)
    if not (openai and grpc and openai["mode"] == PAIRED32):
        return ""
    ratios = paired_ratios(openai["texts_per_s_reps"], grpc["texts_per_s_reps"])
    return ("Batches of 32 over gRPC and through the OpenAI route (the SDK), sent in turn on the same texts: "
            "every batch to both, the path that goes first changing from batch to batch and from one repetition "
            "to the next, each path's time the sum of its own requests' (bench/paired.py): "
            f"{openai['texts_per_s']:.1f} texts/s through the route against {grpc['texts_per_s']:.1f} over gRPC; "
            f"the route over gRPC by repetition {', '.join(f'{r:.2f}x' for r in ratios)} (median "
            f"{float(np.median(ratios)):.2f}x), what target (f)'s batch bound judges."
            f"{plain_route_batches(rows, ratios)} "
            "The throughput table's batches of 32 are timed as blocks, one path after the other: their ratio "
            "also carries which path sent to the model first in the repetition.")


def plain_route_batches(rows: Rows, sdk: list[float]) -> str:
    """The same batches through the OpenAI route from a plain HTTP client, sent in turn with the other
    two: the route's own cost beside the SDK's (``sdk``: the route's ratios over gRPC through the SDK);
    "" for a run from before the route was paired so."""
    plain, ratios = rows.gateway(PAIRED32, OPENAI_PLAIN_PROTOCOL), plain_batches(rows)
    if not (plain and ratios):
        return ""
    return (" The same batches through the route from a plain HTTP client (the SDK's JSON body), sent in turn with "
            f"both: {plain['texts_per_s']:.1f} texts/s; over gRPC by repetition "
            f"{', '.join(f'{r:.2f}x' for r in ratios)} (median {float(np.median(ratios)):.2f}x), the route's own "
            f"cost, the rest of the SDK's gap its own work in the caller.{batch_reach(sdk, ratios)}")


def batch_reach(sdk: list[float], plain: list[float]) -> str:
    """Where the route meets (f)'s batch bound from plain HTTP (``plain``: its ratios over gRPC) and not
    through the SDK (``sdk``): the SDK's work is what misses it."""
    if OPENAI_BATCHES.holds(float(np.median(sdk))) or not OPENAI_BATCHES.holds(float(np.median(plain))):
        return ""
    return (f" So the route meets the bound's {OPENAI_BATCHES.value:g}x from plain HTTP and misses it through the "
            "SDK: what misses it is the SDK's work in the caller, out of the gateway's reach.")


def request_path_section(results: dict) -> list[str]:
    """A short query through each layer in front of the default graph, side by side (the same
    queries, interleaved), with target (f)'s bounds beside the figures they judge."""
    default = results.get("default_configuration")
    if not default:
        return []
    rows = Rows(results["rows"], default)
    found = {"in-process": rows.in_process_graph(LATENCY1),
             **{p: rows.served(LATENCY1, p) for p in ("grpc", "http")},
             **{p: rows.gateway(LATENCY1, p) for p in (GATEWAY_PROTOCOL, OPENAI_PLAIN_PROTOCOL, TEI_PROTOCOL)}}
    graph = found["in-process"]
    lines = ["## A short query, layer by layer", "",
             f"The default configuration ({default['label']}), the same single short queries on every path, "
             "interleaved; `vs in process`: the median over repetitions of this path's p50 over the graph's "
             "in the same repetition. The OpenAI route is timed through the `openai` SDK, as its users call it, "
             "and with the same JSON body from a plain HTTP client (one kept connection, as for TEI's route), so "
             "that the route's own cost and the SDK's read apart. Target (f) (below) bounds gRPC at "
             f"{GRPC_OVER_GRAPH.value:g}x the graph in process and the OpenAI route through the SDK at gRPC + "
             f"{OPENAI_OVER_GRPC.value:g} ms; its batches of 32 at {OPENAI_BATCHES.value:g}x the client's over "
             "gRPC, the two sent in turn.", "",
             "| path (single short query) | p50 ms | p99 ms | vs in process |", "|---|---:|---:|---:|"]
    for protocol, what in REQUEST_PATH:
        row = found[protocol]
        if row is None:
            continue
        ratios = paired_ratios(row["p50_ms_reps"], graph["p50_ms_reps"]) if graph else []
        ratio = f"{float(np.median(ratios)):.2f}x" if ratios else "-"
        lines.append(f"| {what} | {_num(row['p50_ms'], 2)} | {_num(row['p99_ms'], 2)} | {ratio} |")
    figures = [text for text in (route_split(rows), paired_batches(rows)) if text]
    return [*lines, "", *(line for text in figures for line in (text, "")),
            f"Where a short query's time goes on each layer, and what was tried to cut it: "
            f"[bench/data/tried.md](bench/data/{TRIED.name}), \"{REQUEST_PATH_TRIED}\".", ""]


def compute_limit_section(limit: dict | None) -> list[str]:
    """How far each throughput row is from the CPU's peak: an estimate, said to be one."""
    if not limit or not limit["rows"]:
        return []
    peaks = "; ".join(f"{p} {v['flops'] / 1e9:.0f} GFLOP/s ({v['instruction_set']})" for p, v in limit["peaks"].items())
    lines = ["## Compute limit (an estimate)", "",
             f"The model's matmuls cost {limit['flops_per_text'] / 1e9:.2f} GFLOP per text on average over the set "
             f"(attention included, embeddings and normalisations left out). Peak of the {limit['cores']} cores at "
             f"the {limit['clock_ghz']:.2f} GHz /proc/cpuinfo reports ({limit['vendor']}; a virtual machine often "
             f"reports its nominal clock): {peaks}. `bench/compute_limit.py` says what each figure assumes.", "",
             "| path | precision | protocol | mode | texts/s | GFLOP/s | share of peak |",
             "|---|---|---|---|---:|---:|---:|"]
    for r in limit["rows"]:
        lines.append(f"| {r['path']} | {r['precision']} | {r['protocol']} | {MODE_TEXT.get(r['mode'], r['mode'])} "
                     f"| {r['texts_per_s']:.1f} | {r['gflops']:.1f} | {r['share_of_peak']:.1%} |")
    return [*lines, ""]


def plan_lines(plan: dict | None) -> list[str]:
    """What a run sized for its model measured less of, and why (nothing for a small model's plan)."""
    if not plan or not plan.get("reduced"):
        return []
    return [f"Plan: {plan['name']}, chosen from the model's size: {plan['why']}. So this run measured less than "
            "a small model's: " + "; ".join(plan["reduced"]) + ". The workloads, the targets table and the peers "
            "are the same." + (f" Note: {plan['warning']}." if plan.get("warning") else ""), ""]


def markdown(results: dict, stack: dict | None = None) -> str:
    """The run's page; ``stack``: the served stack's ceiling, a record of its own (bench/stack_ceiling.py)."""
    text, memory = results["text_set"], results["server_memory"]
    lines = [
        f"# nexus-sli bench: {results['model']}", "",
        f"{results['created']} · {'quick' if results['quick'] else 'full'} run · "
        f"{results['settings']['repetitions']} repetition(s), medians · {results['duration_s']:.0f} s", "",
        f"Machine: {machine_line(results['machine'])}.", "",
        f"Command: `{results['command']}`", "",
        *plan_lines(results["settings"].get("plan")),
        "## Throughput, latency, fidelity", "",
        *rows_table(results["rows"]), "",
        "`vs baseline`: throughput over the baseline's `encode(batch_size=32)` throughput (for the concurrent "
        "mode too); for single queries, the baseline's batch-1 p50 over this row's p50. Above 1x is faster. "
        "The baseline is timed with torch's default thread count and with 1 thread; the faster of the two, per "
        "mode, is the reference (bold). Cosines: each path's embeddings against the reference's on the same "
        "texts. p50/p99: per request (a batch of 32, or one text); none for in-process batch runs. "
        f"{_settings_line(results['settings'])}", "",
        "## Cost by sequence length", "",
        "texts/s / tokens/s (vs baseline at that length); client batches of 32 over gRPC for the served rows.", "",
        *sweep_table(results["rows"]), "",
        "## Server memory", "",
        f"Triton and its python backend stubs ({memory['processes']} processes, both precisions loaded): "
        f"{memory['idle_mb']} MB RSS idle; under load median {memory['load_median_mb']} MB, "
        f"peak {memory['load_peak_mb']} MB ({memory['samples_under_load']} samples).", "",
        "## Text set", "",
        f"{text['texts']} texts; tokens per text after truncation at {text['max_length']}: mean "
        f"{text['tokens_mean']}, {', '.join(f'{k} {v}' for k, v in text['tokens_percentiles'].items())}; "
        f"{text['truncated']} truncated. By tokens before truncation: "
        f"{', '.join(f'{k}: {v}' for k, v in text['histogram'].items())}. "
        f"Of the tokens the served encoder computes for client batches of 32 sent in set order, "
        f"{text['served_batch32_real_token_share']:.0%} are real (each batch runs in length groups).", "",
        *compute_limit_section(results.get("compute_limit")),
        *stack_section(stack),
        *request_path_section(results),
        *targets_section(results),
        observations(results), "",
    ]
    if results["skipped"]:
        lines += ["Not measured: " + "; ".join(f"{s['path']}, {s['mode']} ({s['reason']})"
                                             for s in results["skipped"]) + ".", ""]
    return "\n".join(lines)


def _throughput_panel(axis, rows: list[dict]) -> None:
    throughput = [r for r in rows if r["mode"] in (BATCH32, CONCURRENT16)]
    baseline = next(r for r in throughput if r["baseline"])
    colors = ["tab:gray" if r["path"] == baseline["path"] else "tab:green" if r.get("peer")
              else "tab:blue" if r["path"] in ("triton", GATEWAY_PATH) else "tab:orange"
              for r in throughput]
    axis.barh(range(len(throughput)), [r["texts_per_s"] for r in throughput], color=colors)
    axis.set_yticks(range(len(throughput)),
                    [f"{_label(r)} · {'batch 32' if r['mode'] == BATCH32 else '16 clients'}" for r in throughput],
                    fontsize=8)
    axis.invert_yaxis()
    axis.axvline(baseline["texts_per_s"], color="black", linestyle="--", linewidth=1, label="baseline")
    axis.set_xlabel("texts/s (median)")
    axis.set_title("Throughput by path (gray: baseline, orange: in-process, blue: served, green: peers)")
    axis.legend(loc="lower right")


def _sweep_panel(axis, rows: list[dict]) -> None:
    sweep = [r for r in rows if r["mode"] == SEQ_LEN]
    for label in dict.fromkeys(_label(r) for r in sweep):
        points = sorted((r["seq_len"], r["texts_per_s"]) for r in sweep if _label(r) == label)
        axis.plot(*zip(*points), marker="o", label=label)
    axis.set_xscale("log", base=2)
    lengths = sorted({r["seq_len"] for r in sweep})
    axis.set_xticks(lengths, [str(n) for n in lengths])
    axis.set_yscale("log")
    axis.set_xlabel("tokens per text")
    axis.set_ylabel("texts/s (median)")
    axis.set_title("Throughput against sequence length (batches of 32)")
    axis.legend()


def plot(results: dict, target: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(14, 6), gridspec_kw={"width_ratios": [1.2, 1]})
    _throughput_panel(left, results["rows"])
    _sweep_panel(right, results["rows"])
    figure.suptitle(f"{results['model']} · {results['machine']['cpu_model']}, {results['machine']['cores']} cores · "
                    f"{results['created']}", fontsize=10)
    figure.tight_layout()
    figure.savefig(target, dpi=110)
    plt.close(figure)


BENCHMARKS_INTRO = """\
# {title}

The latest figures of `{make}`: {model} served end to end by this project through the real Triton
server (tokenizing included), against sentence-transformers and other in-process peers, all measured
in one run on one machine.

- Machine: {machine}.
- Command: `{make}`. It exports the model in each configuration it serves into
  `{repository}` when the exporter changed (`nexus-sli bench --export-only
  --reexport`), then runs `{command}`, which wrote this page,
  `{results}/latest.json` (every row, the machine, the settings) and
  `{results}/latest.png` (throughput by path; throughput against sequence
  length). `{make} QUICK=1` is a smoke run into `{quick}/`.

**The machine may be shared and noisy**: other jobs on its cores while the
bench runs move absolute figures from run to run (the load
average at the start is recorded above). The paths are timed interleaved, every
path once per repetition, {repetitions} repetitions, medians, so that the noise
falls on all of them alike: the ratios to the baseline measured side by side in
one run are what count, and the targets pair them repetition by repetition
(each repetition's against that repetition's baseline): met when every one
clears the bound, or the median does and they agree (spread under 10%).

How it measures:
- Baseline: `SentenceTransformer.encode(texts, batch_size=32)`, fp32,
  in-process, timed with torch's default thread count and with 1 thread; the
  faster, per mode, is the reference for every ratio (under load, torch's
  OpenMP threads can be several times slower than one thread, and a crippled
  baseline would flatter the served path). It sorts texts by length before
  batching; the PyTorch and ONNX Runtime peers do the same.
- Served: the exported ensemble (python tokenizer -> encoder, ONNX Runtime or
  OpenVINO as exported, whose graph ends in the pooling and L2 normalisation)
  as `nexus-sli serve` serves it by default (its steps joined in one process,
  docs/serving.md) on `tritonserver` from `nvidia-pytriton`, loopback, through
  `nexus_sli.client.EncoderClient`. Batches of 32 go in the order of the text
  set; the 16 concurrent clients are threads with their own client objects;
  single queries are texts of at most 16 tokens, sent one after another.
- Fidelity: cosine of each path's embeddings to the reference's on the same texts.
- Nothing in the server was tuned for these figures; this page only measures.

"""


#: What was tried for the targets not met: hand-written from experiments on the packaged model
#: (their scripts left the package once recorded; tried.md says where they are).  The pages link
#: it (its table of levers first) instead of carrying it: a BENCHMARKS page is the latest run's
#: results.
TRIED = Path(__file__).with_name("data") / "tried.md"
TRIED_LINK = ("What was tried for the targets, lever by lever: the table at the top of "
              f"[bench/data/tried.md](bench/data/{TRIED.name}), each attempt in full below it with its "
              "command and machine.\n")


def benchmarks_page(results: dict, page: str) -> str:
    """The page beside the README: BENCHMARKS.md for the packaged model, BENCHMARKS-<model>.md for
    another (``results["layout"]``: its folders and make line, bench/layout.py)."""
    from .layout import layout

    where = results.get("layout") or layout(None).record()  # results written before they recorded it
    default = where["short_name"] is None
    intro = BENCHMARKS_INTRO.format(
        title="Benchmarks" if default else f"Benchmarks: {where['short_name']}", make=where["make"],
        model="the packaged all-MiniLM-L6-v2" if default else results["model"], repository=where["repository"],
        results=where["out"], quick=where["quick_out"], machine=machine_line(results["machine"]),
        command=results["command"], repetitions=results["settings"]["repetitions"])
    body = page.split("\n", 1)[1].lstrip("\n")  # the latest.md content without its title
    body = "\n".join(line for line in body.split("\n") if not line.startswith(("Machine: ", "Command: ")))
    latest = "## Latest run\n\n" + re.sub(r"\n{3,}", "\n\n", body).replace("\n## ", "\n### ")
    tried = "\n" + TRIED_LINK
    classes = ""
    if default:
        classes = "\n".join(cpu_classes.section(Path(where["out"]))) + "\n\n"
    else:  # the experiments were made on the packaged model
        default_page = layout(None).page.name
        tried += f"\nThe same bench on the packaged all-MiniLM-L6-v2: [{default_page}]({default_page}).\n"
    return intro + classes + latest.rstrip("\n") + "\n" + tried


def write_all(results: dict, out: Path, benchmarks_md: Path | None = None) -> None:
    """``latest.json``, ``latest.md`` and ``latest.png`` in ``out``, and the page, with the served stack's
    ceiling where ``out`` holds its record; a full run of the packaged model is also its CPU class's latest."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "latest.json").write_text(json.dumps(results, indent=2) + "\n")
    stack = out / STACK_RECORD
    page = markdown(results, json.loads(stack.read_text()) if stack.is_file() else None)
    (out / "latest.md").write_text(page)
    plot(results, out / "latest.png")
    if benchmarks_md is not None:
        if not results.get("quick") and (results.get("layout") or {}).get("short_name") is None:
            cpu_classes.keep(results, out)  # the packaged model's full run: its CPU class's latest
        Path(benchmarks_md).write_text(benchmarks_page(results, page))
