"""A call's chunks sent one after another or at once by ``EncoderClient``, on the real server.

An experiment, not part of the product or of ``make bench``; its finding is in bench/data/tried.md,
"The synchronous client's chunks at once".  It serves a repository with ``nexus-sli serve`` (the
steps joined, as a user runs it) and, over each protocol, times ``EncoderClient.embed`` on calls of
``--texts`` bench texts (the same texts every time; chunks of the model's ``max_batch_size``) and on
one short query, as the client now sends them (``at once``) and as it sent them before
(``one after another``: each chunk sent when the one before was answered, kept here only), the two in
turn call by call, the order reversed every other call.  ``--caps`` adds paths that send at most that
many chunks at once; ``--separate-steps`` serves the steps as exported (each step its own process, so
one chunk's tokenizing can overlap another's encoding, as on a GPU, where joined steps skip the encoder);
``--step-calls`` then runs each path alone and prints each step's time per execution from Triton's
statistics::

    nexus-sli export --out /tmp/h45c/repo
    .venv/bin/python bench/experiments/client_chunks_concurrent.py /tmp/h45c/repo --rounds 6 --calls 6
    .venv/bin/python bench/experiments/client_chunks_concurrent.py /tmp/h45c/repo --rounds 6 --calls 6 \
        --separate-steps --caps 2 --step-calls 4
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import numpy as np
import tritonclient.grpc as grpc
import tritonclient.http as http

from nexus_sli.bench.cpu_classes import cpu_class
from nexus_sli.bench.machine import machine_info
from nexus_sli.bench.texts import bench_texts
from nexus_sli.client import EncoderClient
from nexus_sli.client import fan_out

MODEL = "all_minilm_l6_v2"
QUERY = "how do I reset my password"


class OneAfterAnother(EncoderClient):
    """The client as it sent a call's requests before: each when the one before was answered."""

    def _send_all(self, count, send):
        return [send(index) for index in range(count)]


def serve(repository: str, port: int, separate: bool) -> subprocess.Popen:
    server = subprocess.Popen([sys.executable, "-m", "nexus_sli.cli.main", "serve", "--model-repository", repository,
                               "--grpc-port", str(port), "--http-port", str(port + 1), "--metrics-port",
                               str(port + 2), "--gateway-port", "0", *(["--separate-steps"] if separate else [])],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    probe = grpc.InferenceServerClient(f"127.0.0.1:{port}")
    deadline = time.time() + 600
    while time.time() < deadline:
        try:
            if probe.is_model_ready(MODEL):
                return server
        except Exception:  # noqa: BLE001, S110 - not up yet
            pass
        time.sleep(1)
    server.terminate()
    raise SystemExit("the server did not get ready within 10 minutes")


#: "at once": the bound measured (the client sends one at a time unless ``fan_out.IN_FLIGHT`` is raised)
AT_ONCE = 8


def capped(client: EncoderClient, cap: int):
    """``client.embed`` sending at most ``cap`` requests of a call at once."""
    def embed(texts):
        kept, fan_out.IN_FLIGHT = fan_out.IN_FLIGHT, cap
        try:
            return client.embed(texts, model=MODEL)
        finally:
            fan_out.IN_FLIGHT = kept
    return embed


def paired(paths: dict, payload, calls: int) -> dict[str, list[float]]:
    """Each path's call times (s), the paths in turn call by call, their order reversed every other call."""
    times = {name: [] for name in paths}
    order = list(paths.items())
    for index in range(calls):
        for name, send in order[::-1] if index % 2 else order:
            started = time.perf_counter()
            send(payload)
            times[name].append(time.perf_counter() - started)
    return times


def report(title: str, by_round: dict[str, list[float]], unit: str, base: str) -> None:
    """Each path's figure by round, and each path's ratio to ``base`` round by round."""
    print(title)
    for name, values in by_round.items():
        print(f"  {name}: by round {', '.join(f'{v:.2f}' for v in values)} {unit}; "
              f"median {statistics.median(values):.2f}")
    for name, values in by_round.items():
        if name != base:
            ratios = [v / b for v, b in zip(values, by_round[base])]
            print(f"  {name} / {base}, by round: {', '.join(f'{r:.3f}' for r in ratios)}; median "
                  f"{statistics.median(ratios):.3f}; above 1 in {sum(r > 1 for r in ratios)}/{len(ratios)}")


def step_times(url: str) -> dict[str, tuple[int, int, int]]:
    """Triton's count per model: (executions, nanoseconds computing (inputs in, run, outputs out), queued)."""
    stats = http.InferenceServerClient(url).get_inference_statistics()["model_stats"]
    return {m["name"]: (int(m["execution_count"]),
                        sum(int(m["inference_stats"][part]["ns"]) for part in ("compute_input", "compute_infer",
                                                                                "compute_output")),
                        int(m["inference_stats"]["queue"]["ns"])) for m in stats}


def per_step(paths: dict, payload, calls: int, url: str) -> None:
    """Each path alone for ``calls`` calls: each step's compute and queue time per execution (Triton's
    statistics), to see whether chunks at once make a step's own work slower (CPU contention)."""
    for name, send in paths.items():
        before, started = step_times(url), time.perf_counter()
        for _ in range(calls):
            send(payload)
        took, after = time.perf_counter() - started, step_times(url)
        cells = [f"{took / calls * 1e3:.0f} ms a call"]
        for model, (runs, compute, queued) in sorted(after.items()):
            runs_then, compute_then, queued_then = before.get(model, (0, 0, 0))
            if runs > runs_then:
                executions = runs - runs_then
                cells.append(f"{model} {executions} runs, compute {(compute - compute_then) / executions / 1e6:.1f} ms"
                             f" + queued {(queued - queued_then) / executions / 1e6:.1f} ms a run")
        print(f"  {name}: {'; '.join(cells)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("repository")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--calls", type=int, default=10, help="calls of --texts per round and path")
    parser.add_argument("--queries", type=int, default=200, help="single queries per round and path")
    parser.add_argument("--caps", default="", help="comma-separated: more paths, at most this many chunks at once")
    parser.add_argument("--protocols", default="grpc,http")
    parser.add_argument("--step-calls", type=int, default=0, help="then this many calls of each path alone, with "
                        "each step's compute time per execution from Triton's statistics")
    parser.add_argument("--separate-steps", action="store_true", help="serve the steps as exported, each its own "
                        "process (an NGC container's layout), not joined")
    parser.add_argument("--port", type=int, default=48271)
    args = parser.parse_args()
    machine = machine_info()
    print(f"{machine['cpu_model']}, {machine['cores']} cores, {cpu_class(machine['flags'])}, load "
          f"{machine['load_average_at_start']}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    texts = bench_texts()[:args.texts]
    caps = [int(c) for c in args.caps.split(",") if c]
    server = serve(args.repository, args.port, args.separate_steps)
    try:
        for protocol in args.protocols.split(","):
            url = f"127.0.0.1:{args.port if protocol == 'grpc' else args.port + 1}"
            kept, fan_out.IN_FLIGHT = fan_out.IN_FLIGHT, max([AT_ONCE, *caps])  # workers for every cap
            try:
                now, before = EncoderClient(url, protocol=protocol), OneAfterAnother(url, protocol=protocol)
            finally:
                fan_out.IN_FLIGHT = kept
            paths = {"one after another": lambda t: before.embed(t, model=MODEL),
                     "at once": capped(now, AT_ONCE),
                     **{f"at most {cap} at once": capped(now, cap) for cap in caps}}
            answers = [send(texts) for send in paths.values()]
            assert all(np.allclose(a, answers[0], atol=1e-5) for a in answers), "the paths answer differently"
            for _ in range(3):
                paired(paths, texts, 1)
                paired(paths, [QUERY], 50)
            calls = {name: [] for name in paths}
            queries = {name: [] for name in paths if name in ("one after another", "at once")}
            for _ in range(args.rounds):
                for name, values in paired(paths, texts, args.calls).items():
                    calls[name].append(len(texts) / statistics.median(values))
                single = {name: paths[name] for name in queries}
                for name, values in paired(single, [QUERY], args.queries).items():
                    queries[name].append(float(np.percentile(values, 50)) * 1e3)
            report(f"{protocol}: calls of {len(texts)} texts, texts/s (median call of each round)", calls,
                   "texts/s", "one after another")
            report(f"{protocol}: one short query, p50", queries, "ms", "one after another")
            if args.step_calls:
                print(f"{protocol}: each path alone, {args.step_calls} calls of {len(texts)} texts")
                per_step(paths, texts, args.step_calls, f"127.0.0.1:{args.port + 1}")
            now.close()
            before.close()
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
