"""Merges frontier runs made with the same settings (one dense reference) into one front, table
and plot set. Usage: python tools/merge_frontier.py OUT_DIR RUN.json [RUN.json ...]"""
import json
import sys
from pathlib import Path

from popjax.eval.frontier import mark_fronts, markdown_table
from popjax.eval.frontier_plot import plot_frontier

out, runs = Path(sys.argv[1]), sys.argv[2:]
records, seen = [], set()
for path in runs:
    for r in json.load(open(path))["records"]:
        key = (r["spec"], r["ratio"])
        if key not in seen:
            seen.add(key)
            records.append(r)
mark_fronts(records)
out.mkdir(parents=True, exist_ok=True)
(out / "frontier.json").write_text(json.dumps({"runs": runs, "records": records}, indent=1))
plot_frontier(records, out)
(out / "table.md").write_text(markdown_table(records) + "\n")
print(markdown_table(records))
