"""The markdown and the plot of a ``--suite piqa-bbh`` table (`popjax.eval.benchmark_table`), made
from its JSON alone, and the section of docs/benchmarks.md that holds it.

The section sits between ``<!-- piqa-bbh:KEY begin -->`` and ``<!-- piqa-bbh:KEY end -->`` (KEY:
the model), so regenerating replaces exactly that text and leaves the hand-written rest alone.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from .benchmark_table import SUITE, configuration
from .piqa import NAME as PIQA

WITHIN = 0.01  # "within a point of dense": the paired interval of the difference inside ±0.01


def _name(label: str, ratio: float) -> str:
    return label if label == "dense" else f"{label} {ratio:.0%}"


def _acc(r: dict[str, Any]) -> str:
    lo, hi = r["acc_ci"]
    return f"{r['acc']:.3f} [{lo:.2f}, {hi:.2f}]"


def _diff(c: dict[str, Any]) -> str:
    lo, hi = c["diff_ci"]
    return f"{c['diff']:+.3f} [{lo:+.3f}, {hi:+.3f}] p={c['p']:.2g}"


def _short(task: str) -> str:
    return task.removeprefix("bbh:")


def verdicts(result: dict[str, Any], task: str = PIQA) -> list[str]:
    """Sentences per ratio on ``task``: which methods are within a point of dense by their paired
    interval, which differ from dense by McNemar's test at 5%, and the largest drop."""
    comparisons = [c for c in result["comparisons"] if c["task"] == task]
    lines = []
    for ratio in sorted({c["ratio"] for c in comparisons}):
        rows = [c for c in comparisons if c["ratio"] == ratio]
        within = [c["label"] for c in rows if c["diff_ci"][0] > -WITHIN and c["diff_ci"][1] < WITHIN]
        differ = [f"{c['label']} ({c['diff']:+.3f}, p={c['p']:.2g})" for c in rows if c["p"] < 0.05]
        worst = min(rows, key=lambda c: c["diff"])
        drop = f"largest drop: {worst['label']}, {worst['diff']:+.3f}" if worst["diff"] < 0 else "no method below dense"
        lines.append(f"- **{ratio:.0%}, {task}:** within {WITHIN:.0%} of dense by the paired 95% interval: "
                     f"{', '.join(within) or 'none'}. Different from dense by McNemar's test (p < 0.05): "
                     f"{', '.join(differ) or 'none'}; {drop}.")
    return lines


def markdown(result: dict[str, Any]) -> str:
    """The section's body: how it was made, the task selection, accuracy per task and
    configuration with mean accuracy and mean rank, differences from dense, and the verdicts."""
    records, settings = result["records"], result["settings"]
    tasks = list(dict.fromkeys(r["task"] for r in records))
    table = {(*configuration(r), r["task"]): r for r in records}
    lines = [f"Model `{result.get('model', '?')}`. Made by", "", f"```bash\n{result.get('command', '?')}\n```", "",
             f"Data: {'; '.join(result['sources'].values())}. Questions per task: {settings['limit'] or 'all'}; "
             f"BBH {'3-shot (answer-only exemplars)' if settings['fewshot'] else '0-shot'}. "
             f"{result['seconds'] / 60:.1f} min wall, {result['examples_per_s']:.2f} examples/s over the run "
             f"(compiles and calibrations included).", "", f"Tasks: {result['rule']}.", "",
             "| task | questions | chance | dense acc [95% CI] | in the table |", "|---|---|---|---|---|"]
    for s in result["selection"]:
        lines.append(f"| {_short(s['task'])} | {s['examples']} | {s['chance']:.3f} | {_acc(s)} | {'yes' if s['selected'] else 'no'} |")
    head = ["method", "ratio"] + [_short(t) for t in tasks] + ["mean acc", "mean rank", "examples/s"]
    lines += ["", "Accuracy [95% Wilson interval]; mean rank: 1 = best per task, ties share.", "",
              "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in result["summary"]:
        cells = [_acc(table[(s["label"], s["ratio"], t)]) if (s["label"], s["ratio"], t) in table else "" for t in tasks]
        lines.append(f"| {s['label']} | {s['ratio']:.2f} | " + " | ".join(cells)
                     + f" | {s['mean_acc']:.3f} | {s['mean_rank']:.2f} | {s['examples_per_s']:.2f} |")
    if result["comparisons"]:
        diffs = {(c["label"], c["ratio"], c["task"]): c for c in result["comparisons"]}
        lines += ["", "Difference from dense on the same questions: accuracy(method) − accuracy(dense) "
                  "[Newcombe's paired 95% interval], McNemar's exact p.", "",
                  "| method | ratio | " + " | ".join(_short(t) for t in tasks) + " |", "|---|---|" + "---|" * len(tasks)]
        for s in result["summary"]:
            if s["label"] == "dense":
                continue
            cells = [_diff(diffs[(s["label"], s["ratio"], t)]) if (s["label"], s["ratio"], t) in diffs else "" for t in tasks]
            lines.append(f"| {s['label']} | {s['ratio']:.2f} | " + " | ".join(cells) + " |")
        lines += [""] + verdicts(result)
    return "\n".join(lines)


def update_section(doc: Path, key: str, body: str, title: str) -> None:
    """Replaces the ``key`` section of ``doc`` with ``body`` (under ``title``), or appends it."""
    begin, end = f"<!-- {SUITE}:{key} begin -->", f"<!-- {SUITE}:{key} end -->"
    section = f"{begin}\n### {title}\n\n{body}\n{end}"
    text = doc.read_text(encoding="utf-8") if doc.is_file() else ""
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text)
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + section + "\n"
    doc.write_text(text, encoding="utf-8")


def plot(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """Difference from dense per configuration with its paired interval, on PIQA and on the mean
    over the BBH tasks kept; and mean accuracy per configuration -> the PNG paths."""
    import matplotlib  # optional: plots need the eval extra (matplotlib)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: see above

    out_dir.mkdir(parents=True, exist_ok=True)
    summary, comparisons = result["summary"], result["comparisons"]
    rows = [s for s in summary if s["label"] != "dense"]
    if not rows:
        return []
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 0.32 * len(summary) + 1.6), sharey=False)
    for i, s in enumerate(rows):
        own = [c for c in comparisons if (c["label"], c["ratio"]) == (s["label"], s["ratio"])]
        piqa = next((c for c in own if c["task"] == PIQA), None)
        colour = f"C{sorted({r['ratio'] for r in rows}).index(s['ratio'])}"
        if piqa is not None:
            lo, hi = piqa["diff_ci"]
            ax.errorbar(piqa["diff"], i, xerr=[[piqa["diff"] - lo], [hi - piqa["diff"]]], fmt="o" if piqa["p"] < 0.05 else "s",
                        color=colour, mfc=colour if piqa["p"] < 0.05 else "white", capsize=2)
        others = [c["diff"] for c in own if c["task"] != PIQA]
        if others:
            ax.plot(np.mean(others), i, "x", color=colour)
    ax.axvline(0, color="gray", lw=0.8)
    for x in (-WITHIN, WITHIN):
        ax.axvline(x, color="gray", ls=":", lw=0.8)
    ax.set_yticks(range(len(rows)), [_name(s["label"], s["ratio"]) for s in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set(xlabel="accuracy − dense (PIQA: paired 95% CI, filled: McNemar p < 0.05; x: mean over BBH)",
           title="difference from dense, same questions")
    bx.barh(range(len(summary)), [s["mean_acc"] for s in summary], color="C7")
    for i, s in enumerate(summary):
        bx.text(s["mean_acc"], i, f" rank {s['mean_rank']:.1f}", va="center", fontsize=7)
    bx.set_yticks(range(len(summary)), [_name(s["label"], s["ratio"]) for s in summary], fontsize=7)
    bx.invert_yaxis()
    bx.set_xlim(0, 1.25 * max([s["mean_acc"] for s in summary] + [1e-3]))  # room for the rank labels
    bx.set(xlabel="mean accuracy over the table's tasks", title="mean over tasks")
    fig.tight_layout()
    path = out_dir / "piqa_bbh.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]
