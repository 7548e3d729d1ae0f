"""Single short queries and 16 concurrent single-text clients, served, three ways, interleaved:
  ensemble    - the export as it is (tokenizer step -> encoder, encoder queue delay 500 us)
  ensemble_d0 - the same with the encoder's max_queue_delay_microseconds 0
  direct      - the encoder called with the query's token arrays (tokenized in the client, outside
                the timer): the most a step tokenizing inside the encoder's process could save.
100 of the bench's texts of at most 16 tokens, one per request, gRPC (tritonclient), a 2 ms pause between
queries; then the bench's first 320 texts from 16 client threads, one text per request.  The variants take
turns, their order reversed every other round.  The encoder's delay is rewritten in copies of the export.
Run: .venv/bin/python bench/experiments/encoder_delay.py EXPORT_REPO [rounds]  (an export of the packaged
model made before the CPU encoder's delay became 0, whose encoder waits 500 us).  The 10-round run left
the `direct` variant out of `variants`."""
import sys, time, shutil, re, threading
from pathlib import Path
import numpy as np
sys.path.insert(0, "/work/main")
from bench.texts import bench_texts
from nexus_sli.exporter.serving import server
import tritonclient.grpc as tg
import tritonclient.http as th
from tokenizers import Tokenizer

src = Path(sys.argv[1]); rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 4
name = "all_minilm_l6_v2"
repo = Path("/tmp/exp2/hoprepo"); shutil.rmtree(repo, ignore_errors=True); shutil.copytree(src, repo, symlinks=True)
enc = repo / f"{name}_encoder"; nd = repo / f"{name}_encoder_d0"; shutil.copytree(enc, nd)
cfg = (nd / "config.pbtxt").read_text()
cfg = cfg.replace(f'name: "{name}_encoder"', f'name: "{name}_encoder_d0"').replace("max_queue_delay_microseconds: 500", "max_queue_delay_microseconds: 0")
assert "max_queue_delay_microseconds: 0" in cfg; (nd / "config.pbtxt").write_text(cfg)
ens = repo / name; e0 = repo / f"{name}_d0"; shutil.copytree(ens, e0)
cfg = (e0 / "config.pbtxt").read_text().replace(f'name: "{name}"', f'name: "{name}_d0"').replace(f'model_name: "{name}_encoder"', f'model_name: "{name}_encoder_d0"')
(e0 / "config.pbtxt").write_text(cfg)
tok = Tokenizer.from_file(str(repo / f"{name}_tokenizer/1/tokenizer.json"))
texts = bench_texts()
short = [t for t in texts if sum(tok.encode(t).attention_mask) <= 16][:100]
conc_texts = texts[:320]
proc = server.start(str(repo), http_port=18000, grpc_port=18001, metrics_port=18002, supervise=False)

def feeds(text):
    # padded to the one width the tokenizer step pads to (256 here), so Triton merges concurrent requests
    e = tok.encode(text); ins = []
    for key, arr in (("input_ids", e.ids), ("attention_mask", e.attention_mask), ("token_type_ids", e.type_ids)):
        a = np.zeros((1, 256), dtype=np.int64); a[0, :len(arr)] = arr
        x = tg.InferInput(key, [1, 256], "INT64"); x.set_data_from_numpy(a); ins.append(x)
    return ins

def text_in(text):
    x = tg.InferInput("TEXT", [1, 1], "BYTES"); x.set_data_from_numpy(np.array([[text.encode()]], dtype=object)); return [x]

out = [tg.InferRequestedOutput("EMBEDDING")]
variants = {"ensemble": (name, text_in), "ensemble_d0": (f"{name}_d0", text_in), "direct": (f"{name}_encoder", feeds)}
try:
    c = tg.InferenceServerClient("127.0.0.1:18001")
    pre = {k: [f(t) for t in short] for k, (m, f) in variants.items()}
    conc_pre = {k: [f(t) for t in conc_texts] for k, (m, f) in variants.items()}
    ref = c.infer(name, text_in(short[0]), outputs=out).as_numpy("EMBEDDING")
    for k, (m, f) in variants.items():
        for i in range(5): v = c.infer(m, pre[k][i], outputs=out).as_numpy("EMBEDDING")
        print(k, "max |diff| to ensemble on text 4:", float(np.max(np.abs(v - c.infer(name, text_in(short[4]), outputs=out).as_numpy("EMBEDDING")))))
    single = {k: [] for k in variants}; conc = {k: [] for k in variants}
    for r in range(rounds):
        order = list(variants) if r % 2 == 0 else list(variants)[::-1]
        for k in order:
            m = variants[k][0]
            for req in pre[k]:
                t = time.perf_counter(); c.infer(m, req, outputs=out); single[k].append((time.perf_counter() - t) * 1e3)
                time.sleep(0.002)
        for k in order:
            m = variants[k][0]; reqs = conc_pre[k]; nxt = iter(range(len(reqs))); lock = threading.Lock()
            def worker():
                cl = tg.InferenceServerClient("127.0.0.1:18001")
                while True:
                    with lock:
                        i = next(nxt, None)
                    if i is None: return
                    cl.infer(m, reqs[i], outputs=out)
            ths = [threading.Thread(target=worker) for _ in range(16)]
            t = time.perf_counter(); [x.start() for x in ths]; [x.join() for x in ths]
            conc[k].append(len(reqs) / (time.perf_counter() - t))
        print(f"round {r}: " + ", ".join(f"{k} p50 {np.median(single[k][-len(short):]):.2f} ms / conc {conc[k][-1]:.1f} t/s" for k in variants), flush=True)
    for k in variants:
        v = np.array(single[k])
        print(f"{k}: single p50 {np.median(v):.2f} ms, p99 {np.percentile(v, 99):.2f} ms (p99/p50 {np.percentile(v, 99)/np.median(v):.2f}); 16 concurrent {np.median(conc[k]):.1f} texts/s (rounds {[round(x, 1) for x in conc[k]]})")
finally:
    server.stop(proc)
