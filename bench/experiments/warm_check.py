"""OpenVINO: one query's first run at lengths 4-16 against its repeats, with and without the warm-up of lengths 1..32."""
import sys, time, numpy as np, openvino as ov
sys.path.insert(0, "/work/main/exporter/serving/backends")
from openvino_properties import compile_properties
for label, path in (("fp32", "/tmp/ovrepo/all_minilm_l6_v2_encoder/1/model.onnx"), ("int8", "/tmp/ovrepo8/all_minilm_l6_v2_encoder/1/model.xml")):
  for warm in (0, 32):
    core = ov.Core()
    comp = core.compile_model(core.read_model(path), "CPU", compile_properties({"PERFORMANCE_HINT": "LATENCY"}))
    req = comp.create_infer_request()
    names = [p.get_any_name() for p in comp.inputs]
    t = time.perf_counter()
    for l in range(1, warm + 1):
        req.infer({n: np.full((1, l), 0 if n == "token_type_ids" else 1, dtype=np.int64) for n in names})
    wt = time.perf_counter() - t
    def run(l):
        f = {n: np.random.randint(1, 1000, (1, l)).astype(np.int64) if n == "input_ids" else np.full((1, l), 0 if n == "token_type_ids" else 1, dtype=np.int64) for n in names}
        t = time.perf_counter(); req.infer(f); return (time.perf_counter() - t) * 1e3
    r = []
    for l in range(4, 17):
        f = run(l); a = float(np.median([run(l) for _ in range(5)])); r.append(f / a)
    print(label, "warm", warm, f"({wt:.2f} s)", "first/repeat median", round(float(np.median(r)), 2), "max", round(max(r), 2))
