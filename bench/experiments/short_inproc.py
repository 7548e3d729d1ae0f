"""In-process encoder time on the bench's short batches: OpenVINO fp32 vs ONNX Runtime fp32, planned groups vs one group.

Needs /tmp/ovrepo (nexus-sli export --backend openvino --precision fp32 --out /tmp/ovrepo) and
/tmp/ortrepo (nexus-sli export --backend onnxruntime --precision fp32 --out /tmp/ortrepo)."""
import sys, time
import numpy as np
sys.path.insert(0, "/work/main"); sys.path.insert(0, "/work/main/exporter/serving/backends")
from bench.texts import bench_texts
from batching import plan, real_lengths
from openvino_properties import compile_properties
from tokenizers import Tokenizer
import openvino as ov, onnxruntime as ort
name = "all_minilm_l6_v2"
tok = Tokenizer.from_file(f"/tmp/ovrepo/{name}_tokenizer/1/tokenizer.json")
texts = bench_texts()
enc = [tok.encode(t) for t in texts]
short = [e for e in enc if sum(e.attention_mask) <= 16]
batches = []
for i in range(0, len(short) - 31, 32):
    b = short[i:i + 32]
    feeds = {"input_ids": np.array([e.ids for e in b], dtype=np.int64), "attention_mask": np.array([e.attention_mask for e in b], dtype=np.int64),
             "token_type_ids": np.array([e.type_ids for e in b], dtype=np.int64)}
    batches.append(feeds)
lens = np.concatenate([real_lengths(b["attention_mask"]) for b in batches])
print("real lengths of short texts: mean", lens.mean().round(1), "min", lens.min(), "max", lens.max())
print("groups per batch:", [len(plan(real_lengths(b["attention_mask"]))) for b in batches])
core = ov.Core()
ovm = core.compile_model(core.read_model(f"/tmp/ovrepo/{name}_encoder/1/model.onnx"), "CPU", compile_properties({"PERFORMANCE_HINT": "LATENCY"}))
ovr = ovm.create_infer_request()
so = ort.SessionOptions(); so.intra_op_num_threads = 2
orts = ort.InferenceSession(f"/tmp/ortrepo/{name}_encoder/1/model.onnx", so, providers=["CPUExecutionProvider"])
def ov_run(f): ovr.infer(f)
def ort_run(f): orts.run(["EMBEDDING"], f)
def planned(run, b):
    L = real_lengths(b["attention_mask"])
    for rows in plan(L):
        n = int(L[rows].max()); run({k: np.ascontiguousarray(v[rows, :n]) for k, v in b.items()})
def one(run, b):
    n = int(real_lengths(b["attention_mask"]).max()); run({k: np.ascontiguousarray(v[:, :n]) for k, v in b.items()})
cases = {"ov planned": lambda b: planned(ov_run, b), "ov one group": lambda b: one(ov_run, b),
         "ort planned": lambda b: planned(ort_run, b), "ort one group": lambda b: one(ort_run, b)}
for f in cases.values():
    for b in batches: f(b)
res = {k: [] for k in cases}
for _ in range(5):
    for k, f in cases.items():
        for b in batches:
            t = time.perf_counter(); f(b); res[k].append((time.perf_counter() - t) * 1e3)
for k, v in res.items(): print(f"{k}: p50 {np.median(v):.2f} ms")
