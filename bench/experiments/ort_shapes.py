"""ONNX Runtime: first run of one query at a new length vs its repeats (needs /tmp/ortrepo, an onnxruntime fp32 export)."""
import time, numpy as np, onnxruntime as ort
so = ort.SessionOptions(); so.intra_op_num_threads = 2
s = ort.InferenceSession("/tmp/ortrepo/all_minilm_l6_v2_encoder/1/model.onnx", so, providers=["CPUExecutionProvider"])
names = [i.name for i in s.get_inputs()]
def run(r, l):
    f = {n: np.ones((r, l), dtype=np.int64) for n in names}
    t = time.perf_counter(); s.run(["EMBEDDING"], f); return (time.perf_counter() - t) * 1e3
run(8, 16)
extra = []
for l in range(4, 40):
    f = run(1, l); a = float(np.median([run(1, l) for _ in range(5)])); extra.append((f - a, f / a))
e = np.array(extra); print("ort rows=1 new length: extra ms median", round(float(np.median(e[:,0])),2), "first/repeat", round(float(np.median(e[:,1])),2))
