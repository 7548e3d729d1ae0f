"""First run at a new input shape vs immediate repeats, OpenVINO CPU, served properties (fp32 and int8 IR).

Needs /tmp/ovrepo (openvino fp32 export) and /tmp/ovrepo8 (nexus-sli export --backend openvino --precision int8 --allow-degraded --out /tmp/ovrepo8)."""
import sys, time, random
import numpy as np, openvino as ov
sys.path.insert(0, "/work/main/exporter/serving/backends")
from openvino_properties import compile_properties
def measure(path, label):
    core = ov.Core()
    compiled = core.compile_model(core.read_model(path), "CPU", compile_properties({"HINT_BF16": "NO", "PERFORMANCE_HINT": "LATENCY"}))
    req = compiled.create_infer_request()
    names = [p.get_any_name() for p in compiled.inputs]
    def run(rows, length):
        feeds = {n: np.ones((rows, length), dtype=np.int64) for n in names}
        t = time.perf_counter(); req.infer(feeds); return (time.perf_counter() - t) * 1e3
    run(1, 16)
    rng = random.Random(1)
    seen=set(); extra=[]; firsts=[]; agains=[]
    while len(seen) < 40:
        s = (rng.choice([1, 2, 4, 7, 11, 16, 24, 32]), rng.randint(5, 40))
        if s in seen: continue
        seen.add(s)
        f = run(*s); a = float(np.median([run(*s) for _ in range(3)]))
        firsts.append(f); agains.append(a); extra.append(f - a)
    print(label, "new shapes", len(seen), "first total ms", round(sum(firsts),1), "repeat total ms", round(sum(agains),1),
          "extra per new shape median ms", round(float(np.median(extra)),2), "first/repeat median", round(float(np.median(np.array(firsts)/np.array(agains))),2))
measure("/tmp/ovrepo/all_minilm_l6_v2_encoder/1/model.onnx", "fp32")
measure("/tmp/ovrepo8/all_minilm_l6_v2_encoder/1/model.xml", "int8")
