"""On paper: the bench's batches of 32 planned at exact lengths vs at lengths rounded up to 16 buckets (the backend's batching.plan)."""
import sys, numpy as np
sys.path.insert(0, "/work/main"); sys.path.insert(0, "/work/main/exporter/serving/backends"); sys.path.insert(0, "/work/main/exporter/triton/python_models")
from bench.texts import bench_texts
from encoding import load_tokenizer
import batching
tok = load_tokenizer("/tmp/ovrepo/all_minilm_l6_v2_tokenizer/1/tokenizer.json", 256)
lens = np.array([len(e.ids) for e in tok.encode_batch(bench_texts())])
def buckets(max_length):
    out, step, v = [], 8, 8
    while v < max_length:
        out.append(v)
        if v >= 8 * step: step *= 2
        v += step
    return np.array(out + [max_length])
B = buckets(256); print("buckets", B.tolist(), len(B))
def bucket(l): return B[np.searchsorted(B, l)]
def cost_plan(lengths, bucketed):
    groups = batching.plan(bucket(lengths)) if bucketed else batching.plan(lengths)
    comp, runs, shapes = 0, 0, set()
    for g in groups:
        L = int(lengths[g].max()); L = int(bucket(L)) if bucketed else L
        comp += len(g) * L * (1 + L / 600); runs += 1; shapes.add((len(g), L))
    return comp, runs, shapes
for name, sel in (("set, batches of 32", lens), ("short, batches of 32", lens[lens <= 16])):
    for bucketed in (False, True):
        tot, runs, shapes, real = 0, 0, set(), 0
        for i in range(0, len(sel), 32):
            c, r, s = cost_plan(sel[i:i+32], bucketed); tot += c; runs += r; shapes |= s; real += (sel[i:i+32] * (1 + sel[i:i+32] / 600)).sum()
        print(name, "bucketed" if bucketed else "exact   ", f"cost {tot:.0f} (real {real:.0f}, {real/tot:.1%} real), runs {runs}, distinct shapes {len(shapes)}")
