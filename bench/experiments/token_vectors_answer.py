"""What an answer of many vectors costs the gateway: its rendering as JSON, on the event loop's thread.

An experiment, not part of the product or of ``make bench`` (no test runs it); its findings are in
bench/data/tried.md, "An answer of every token's vector".  ``--texts`` arrays of ``--tokens`` x ``--width``
float32 values (an ``/embed_all`` answer; ``--tokens 1``: an ``/embed`` answer of ``--texts`` vectors), rendered
in turn as the routes did before (Starlette's ``JSONResponse``, Python's ``json``, of the arrays' ``tolist()``)
and as they do now (``gateway.answers.answer``, orjson reading the arrays), in this process::

    .venv/bin/python bench/experiments/token_vectors_answer.py --texts 64 --tokens 256 --width 384

It prints each way's seconds per repetition (the order swapped each time), the bodies' sizes, whether both
read back as the same float32 values, and the peak of the memory Python allocated for each (tracemalloc, in a
repetition of its own: tracing slows the rendering).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import tracemalloc

import numpy as np
from starlette.responses import JSONResponse

from nexus_sli.gateway.answers import answer


def as_before(found: list[np.ndarray]) -> bytes:
    return JSONResponse([vectors.tolist() for vectors in found]).body


def as_now(found: list[np.ndarray]) -> bytes:
    return answer(found, "model").body


WAYS = {"json over tolist()": as_before, "orjson (answer)": as_now}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--repeat", type=int, default=4)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    found = [rng.standard_normal((args.tokens, args.width), dtype=np.float32) for _ in range(args.texts)]
    values = args.texts * args.tokens * args.width
    seconds: dict[str, list[float]] = {name: [] for name in WAYS}
    bodies = {}
    for repetition in range(args.repeat):
        for name in (list(WAYS) if repetition % 2 == 0 else list(WAYS)[::-1]):
            started = time.perf_counter()
            bodies[name] = WAYS[name](found)
            seconds[name].append(time.perf_counter() - started)
    same = len({np.asarray(json.loads(body), dtype=np.float32).tobytes() for body in bodies.values()}) == 1
    print(f"{values:,} values; both read back as the same float32 values: {same}")
    for name, way in WAYS.items():
        tracemalloc.start()
        way(found)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        median = statistics.median(seconds[name])
        print(f"{name}: {', '.join(f'{s:.3f}' for s in seconds[name])} s (median {median / values * 1e6:.3f} µs a "
              f"value), {len(bodies[name]) / 2**20:.1f} MiB of JSON, peak allocated {peak / 2**20:.0f} MiB "
              f"({peak / values:.0f} bytes a value)")


if __name__ == "__main__":
    main()
