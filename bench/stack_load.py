"""One client process of the served stack's load (bench/stack_ceiling.py): threads with a client each,
sending ``embed`` calls back to back over one window of time, as an application process does.

Run by the harness, not by hand::

    python -m nexus_sli.bench.stack_load JOB.json   # {"url", "model", "texts", "batch", "threads",
                                                    #  "offset", "start" (epoch s), "seconds",
                                                    #  "in_flight" (optional: fan_out.IN_FLIGHT)}

It connects (and reads the model's description) before ``start``, sends from ``start`` for ``seconds``
and prints one JSON line: the calls and rows answered within the window, their latencies (ms) and the
CPU seconds this process spent in it (the client's own share of the stack's work).
"""

from __future__ import annotations

import json
import sys
import threading
import time


def _worker(client, model: str, texts: list[str], batch: int, offset: int, stop: float, out: list) -> None:
    position = offset
    while time.time() < stop:
        chunk = [texts[(position + i) % len(texts)] for i in range(batch)]
        position += batch
        began = time.perf_counter()
        client.embed(chunk, model=model)
        ended = time.time()
        if ended <= stop:  # a call that ends past the window is not counted
            out.append((time.perf_counter() - began) * 1e3)


def run(job: dict) -> dict:
    from nexus_sli.client import EncoderClient, fan_out

    if job.get("in_flight"):  # before the clients are made: each sizes its workers by it
        fan_out.IN_FLIGHT = job["in_flight"]
    clients = [EncoderClient(job["url"], protocol=job.get("protocol", "grpc")) for _ in range(job["threads"])]
    for client in clients:
        client.info(job["model"])
    start, stop = job["start"], job["start"] + job["seconds"]
    latencies: list[list[float]] = [[] for _ in clients]
    threads = [threading.Thread(target=_worker, args=(client, job["model"], job["texts"], job["batch"],
                                                      (job.get("offset", 0) + n) * job["batch"], stop, latencies[n]))
               for n, client in enumerate(clients)]
    time.sleep(max(0.0, start - time.time()))
    cpu = time.process_time()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    cpu = time.process_time() - cpu
    for client in clients:
        client.close()
    calls = [x for per_thread in latencies for x in per_thread]
    return {"calls": len(calls), "rows": len(calls) * job["batch"], "latencies_ms": calls, "cpu_s": cpu}


if __name__ == "__main__":
    with open(sys.argv[1]) as job_file:
        print(json.dumps(run(json.load(job_file))), flush=True)
