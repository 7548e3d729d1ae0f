"""Single short queries on a freshly loaded server: the first pass over the bench's query set vs the second.

Run: .venv/bin/python bench/experiments/first_queries.py REPO [REPO ...]; a REPO with WARMUP_QUERY_TOKENS "0"
written into its encoder's config.pbtxt parameters is the unwarmed variant."""
import sys, time
import numpy as np
sys.path.insert(0, "/work/main")
from bench.texts import bench_texts
from nexus_sli.exporter.serving import server
from nexus_sli.client import EncoderClient
sys.path.insert(0, "/work/main/exporter/triton/python_models")
from encoding import load_tokenizer
name = "all_minilm_l6_v2"
for repo in sys.argv[1:]:
    tok = load_tokenizer(f"{repo}/{name}_tokenizer/1/tokenizer.json", 256)
    texts = bench_texts()
    queries = [t for t, e in zip(texts, tok.encode_batch(texts)) if len(e.ids) <= 16][:100]
    t0 = time.perf_counter()
    proc = server.start(repo, http_port=18000, grpc_port=18001, metrics_port=18002, supervise=False,
                        stdout=open("/tmp/server.log", "w"), stderr=open("/tmp/server.err", "w"))
    load_s = time.perf_counter() - t0
    try:
        c = EncoderClient("127.0.0.1:18001", model=name)
        c.embed(["warm the client and the tokenizer"])  # a 7-token query: one shape
        passes = []
        for _ in range(2):
            ms = []
            for q in queries:
                t = time.perf_counter(); c.embed([q]); ms.append((time.perf_counter() - t) * 1e3)
            passes.append(ms)
        lengths = [len(e.ids) for e in tok.encode_batch(queries)]
        seen, new = {7}, []
        for i, l in enumerate(lengths):
            new.append(l not in seen); seen.add(l)
        d = np.array(passes[0]) - np.array(passes[1]); new = np.array(new)
        print(repo, f"first-of-length queries ({new.sum()}): pass1-pass2 mean {d[new].mean():+.2f} ms; others ({(~new).sum()}): {d[~new].mean():+.2f} ms")
        print(repo, f"server ready in {load_s:.1f} s;", "; ".join(
            f"pass {i + 1}: p50 {np.percentile(m, 50):.2f} ms p99 {np.percentile(m, 99):.2f} ms p99/p50 {np.percentile(m, 99) / np.percentile(m, 50):.2f} mean {np.mean(m):.2f}"
            for i, m in enumerate(passes)))
        c.close()
    finally:
        server.stop(proc)
