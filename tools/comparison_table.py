"""The paper-ordered comparison table of docs/evaluation.md from `popjax eval` records, with each
method's analytic FFN FLOPs per decode token (docs/methods.md §2). Usage:
python tools/comparison_table.py results/eval/table.json [results/eval/next_line.json]"""
import json
import sys

import popjax
from popjax.analysis.flops import flops_report
from popjax.methods import make_method

ORDER = ["dense", "wanda-sp", "flap", "probe", "griffin", "static", "pop", "dynamic"]  # the POP paper's order
COLUMNS = [("nll", "prose NLL"), ("code_nll", "code NLL"), ("kl", "KL(dense‖m)"), ("agreement", "greedy agreement"),
           ("next_line_acc", "next-line acc")]

records = [r for path in sys.argv[1:] for r in json.load(open(path))["records"]]
model = popjax.load()
cfg = model.config
rows = {}
for r in records:
    rows.setdefault((r["method"], r["ratio"] or 0.0), {"record": r}).update({k: r[k] for k, _ in COLUMNS if k in r})
present = [c for c in COLUMNS if any(c[0] in row for row in rows.values())]
print("| ratio | method | " + " | ".join(h for _, h in present) + " | FFN FLOPs / token (% of dense) |")
print("|---|---|" + "---|" * (len(present) + 1))
for (name, ratio), row in sorted(rows.items(), key=lambda kv: (kv[0][1], ORDER.index(kv[0][0]) if kv[0][0] in ORDER else 99)):
    r = row["record"]
    hyper = {k: r.get(k) for k in ("ratio", "gamma", "aggregate")}
    method = make_method(name, **{k: v for k, v in hyper.items() if v is not None and (k != "ratio" or name != "dense")})
    f = flops_report(cfg, method.prepare(model))  # calibrated methods: cached on disk
    cells = [f"{row[k]:.3f}" if k in row else "" for k, _ in present]
    print(f"| {ratio:.1f} | {name} | " + " | ".join(cells) + f" | {f['ffn_flops_per_token'] / 1e6:.1f} M ({100 * f['ffn_fraction_of_dense']:.1f}%) |")
