"""OpenVINO: first run of one query at a new length vs its repeats, and what warming lengths 1..64 costs."""
import sys, time, numpy as np, openvino as ov
sys.path.insert(0, "/work/main/exporter/serving/backends")
from openvino_properties import compile_properties
for label, path in (("fp32", "/tmp/ovrepo/all_minilm_l6_v2_encoder/1/model.onnx"), ("int8", "/tmp/ovrepo8/all_minilm_l6_v2_encoder/1/model.xml")):
    core = ov.Core()
    req = core.compile_model(core.read_model(path), "CPU", compile_properties({"PERFORMANCE_HINT": "LATENCY"})).create_infer_request()
    names = [p.get_any_name() for p in req.model_inputs]
    def run(r, l):
        f = {n: np.ones((r, l), dtype=np.int64) for n in names}
        t = time.perf_counter(); req.infer(f); return (time.perf_counter() - t) * 1e3
    run(8, 16)
    extra = []
    for l in range(4, 40):
        f = run(1, l); a = float(np.median([run(1, l) for _ in range(5)])); extra.append((f - a, f / a, a))
    e = np.array(extra); print(label, "rows=1 new length: extra ms median", round(float(np.median(e[:,0])),2), "first/repeat", round(float(np.median(e[:,1])),2), "repeat ms median", round(float(np.median(e[:,2])),2))
    t = time.perf_counter()
    for l in range(1, 65): run(1, l)
    print(label, "warming (1, L) for L=1..64 after those:", round(time.perf_counter() - t, 2), "s")
