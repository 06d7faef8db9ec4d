"""Paired comparison of two configurations of one frontier run, window by window (each record's
``nll_by_window``). Usage: python benchmarks/paired_nll.py RUN.json SPEC_A SPEC_B
-> per ratio: mean NLL(A) − NLL(B), its standard error over windows, and how many windows A wins."""
import json
import sys

import numpy as np

path, spec_a, spec_b = sys.argv[1:4]
records = {(r["spec"], r["ratio"]): r for r in json.load(open(path))["records"]}
for ratio in sorted({r for _, r in records if r > 0}):
    if (spec_a, ratio) not in records or (spec_b, ratio) not in records:
        continue
    a = np.asarray(records[(spec_a, ratio)]["nll_by_window"])
    b = np.asarray(records[(spec_b, ratio)]["nll_by_window"])
    diff = a - b
    print(f"ratio {ratio:.2f}: {spec_a} − {spec_b} = {diff.mean():+.4f} ± {diff.std(ddof=1) / np.sqrt(len(diff)):.4f} nats "
          f"(s.e. over {len(diff)} windows); {spec_a} lower on {(diff < 0).sum()} of them")
