"""Which dimension's novelty costs: new row count at a seen length, new length at a seen row count (OpenVINO int8 IR, fp32 ONNX)."""
import sys, time
import numpy as np, openvino as ov
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
    out = {}
    for kind, shapes in (("new rows, length 16 seen", [(r, 16) for r in (3, 5, 6, 7, 9, 10, 11, 12, 13, 14)]),
                         ("new length, rows 8 seen", [(8, l) for l in (17, 18, 19, 20, 21, 22, 23, 24, 25, 26)])):
        if kind.startswith("new rows"):
            run(8, 16)
        extra = []
        for s in shapes:
            f = run(*s); a = float(np.median([run(*s) for _ in range(5)])); extra.append((f - a, f / a))
        e = np.array(extra)
        out[kind] = f"extra ms median {np.median(e[:,0]):.2f}, first/repeat median {np.median(e[:,1]):.2f}"
    print(label, out)
