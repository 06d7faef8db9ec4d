"""The paper-ordered comparison table of docs/evaluation.md from `popjax eval` records, with each
method's analytic FFN FLOPs per decode token (docs/methods.md §2), and with ``--int8 QUALITY.json``
(benchmarks/int8_quality.py) an int8 column: the held-out Δ NLL of the int8 model against fp32 under the
same method (int8 activations / weight-only). Usage:
python tools/comparison_table.py results/eval/table.json [results/eval/next_line.json] [--int8 results/int8/quality.json]"""
import json
import sys

import popjax
from popjax.analysis.flops import flops_report
from popjax.methods import make_method

ORDER = ["dense", "wanda-sp", "flap", "probe", "griffin", "static", "pop", "dynamic"]  # the POP paper's order
COLUMNS = [("nll", "prose NLL"), ("code_nll", "code NLL"), ("kl", "KL(dense‖m)"), ("agreement", "greedy agreement"),
           ("next_line_acc", "next-line acc")]

args = sys.argv[1:]
int8 = {}
if "--int8" in args:
    i = args.index("--int8")
    for q in json.load(open(args[i + 1]))["rows"]:
        int8.setdefault((q["method"], q["ratio"]), {})[q["weights"]] = q["delta_nll"]
    args = args[:i] + args[i + 2 :]
INT8_KINDS = ("int8 (int8 activations)", "int8 (weight-only)")
records = [r for path in args for r in json.load(open(path))["records"]]
model = popjax.load()
cfg = model.config
rows = {}
for r in records:
    rows.setdefault((r["method"], r["ratio"] or 0.0), {"record": r}).update({k: r[k] for k, _ in COLUMNS if k in r})
present = [c for c in COLUMNS if any(c[0] in row for row in rows.values())]
int8_header = " int8 Δ NLL (int8 act. / weight-only) |" if int8 else ""
print("| ratio | method | " + " | ".join(h for _, h in present) + " | FFN FLOPs / token (% of dense) |" + int8_header)
print("|---|---|" + "---|" * (len(present) + 1 + bool(int8)))
for (name, ratio), row in sorted(rows.items(), key=lambda kv: (kv[0][1], ORDER.index(kv[0][0]) if kv[0][0] in ORDER else 99)):
    r = row["record"]
    hyper = {k: r.get(k) for k in ("ratio", "gamma", "aggregate")}
    method = make_method(name, **{k: v for k, v in hyper.items() if v is not None and (k != "ratio" or name != "dense")})
    f = flops_report(cfg, method.prepare(model))  # calibrated methods: cached on disk
    cells = [f"{row[k]:.3f}" if k in row else "" for k, _ in present]
    q = int8.get((name, float(ratio)), {})
    int8_cell = (" " + " / ".join(f"{q[k]:+.4f}" if k in q else "–" for k in INT8_KINDS) + " |") if int8 else ""
    print(f"| {ratio:.1f} | {name} | " + " | ".join(cells) + f" | {f['ffn_flops_per_token'] / 1e6:.1f} M ({100 * f['ffn_fraction_of_dense']:.1f}%) |" + int8_cell)
