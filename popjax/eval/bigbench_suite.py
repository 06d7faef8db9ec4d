"""``popjax eval --suite bigbench-mc``: the papers' kind of table on BIG-bench's multiple-choice
tasks: dense and the methods at their ratios, per task with 95% intervals, the mean accuracy
and the mean rank per configuration.

**Which tasks.** A first pass runs dense on every candidate task (default: all tasks with
multiple-choice examples) over the same ``limit`` examples the table uses; a task enters the
table when dense's 95% Wilson interval of ``multiple_choice_grade`` lies above BIG-bench's chance
level (its lower bound > chance). Dense's first-pass records are its table entries, so its
numbers on the selected tasks lean high (they were chosen for it); every method is scored on the
same examples, so comparisons between methods are paired. Fewer than ``min_tasks`` selected
tasks is reported, not hidden (a warning and ``enough_tasks: false``).

**Ranks.** Per task, configurations are ranked by accuracy (1 = best, ties share the mean of
their ranks); the mean rank averages over the selected tasks.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from tqdm.auto import tqdm

from ..loaded import LoadedModel
from .bigbench import PREFIX, Task, list_tasks, load_task
from .bigbench_score import compile_counts, evaluate_task
from .frontier import configurations
from .paired import average_ranks

log = logging.getLogger(__name__)

SUITE = "bigbench-mc"
RULE = ("dense's 95% Wilson lower bound of multiple_choice_grade, over the first pass's examples, "
        "above BIG-bench's chance level (mean over examples of the mean target score)")


@dataclasses.dataclass(frozen=True)
class SuiteSettings:
    limit: int | None = 40  # examples per task (BIG-bench's seeded draw); None: all
    shots: int = 0
    seed: int = 42
    batch_size: int = 8
    min_tasks: int = 8


def candidate_tasks(names: Sequence[str] | None, root: str | Path | None = None) -> list[Task]:
    """The tasks named (``bigbench:`` optional), else every task with multiple-choice examples."""
    return [load_task(n, root) for n in (names or list_tasks(root))]


def run_suite(model: LoadedModel, specs: Sequence[str], ratios: Sequence[float], tasks: list[Task],
              settings: SuiteSettings = SuiteSettings()) -> dict[str, Any]:
    """First pass, selection, then every configuration on the selected tasks -> {"rule",
    "selection", "records", "summary", "enough_tasks", "seconds", "compiles"}."""
    configs = configurations(specs, ratios)  # dense first; per-row aggregates (batch-independent)
    start, before = time.perf_counter(), compile_counts()
    run = lambda method, task: evaluate_task(model, method, task, settings.shots, settings.limit, settings.seed, settings.batch_size)
    dense = configs[0][1].prepare(model)
    selection, records = [], []
    for task in tqdm(tasks, desc="bigbench first pass (dense)", unit="task"):
        try:
            record = run(dense, task)
        except ValueError as err:  # too few examples for the shots, a limit below its subtasks
            selection.append({"task": task.label, "selected": False, "why": str(err)})
            continue
        chosen = record["acc_ci"][0] > task.chance
        selection.append({"task": record["task"], "selected": chosen, "examples": record["examples"], "chance": task.chance,
                          "acc": record["acc"], "acc_ci": record["acc_ci"]})
        if chosen:
            records.append(record)
    selected = [t for t, s in zip(tasks, selection) if s["selected"]]
    log.info("BIG-bench: %d of %d tasks above chance for dense", len(selected), len(tasks))
    if len(selected) < settings.min_tasks:
        log.warning("only %d tasks pass the rule (%s); the suite wants %d", len(selected), RULE, settings.min_tasks)
    jobs = [(m, t) for _, m in configs[1:] for t in selected]
    prepared = {}
    for method, task in tqdm(jobs, desc="bigbench methods", unit="run"):
        key = repr(method)
        prepared.setdefault(key, method.prepare(model))  # offline methods calibrate once (cached on disk)
        records.append(run(prepared[key], task))
    after = compile_counts()
    return {
        "rule": RULE,
        "settings": dataclasses.asdict(settings),
        "selection": selection,
        "records": records,
        "summary": summarize(records),
        "enough_tasks": len(selected) >= settings.min_tasks,
        "seconds": time.perf_counter() - start,
        "compiles": {k: after[k] - before[k] for k in after},
    }


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per configuration (label, ratio), in sweep order: mean accuracy, mean acc_norm, mean rank
    over the tasks every configuration ran, tasks counted."""
    configs = list(dict.fromkeys((r["label"], r["ratio"]) for r in records))
    tasks = list(dict.fromkeys(r["task"] for r in records))
    table = {(r["label"], r["ratio"], r["task"]): r for r in records}
    common = [t for t in tasks if all((c[0], c[1], t) in table for c in configs)]
    ranks = {c: [] for c in configs}
    for task in common:
        for c, rank in zip(configs, average_ranks([table[(*c, task)]["acc"] for c in configs])):
            ranks[c].append(rank)
    out = []
    for c in configs:
        rows = [table[(*c, t)] for t in common]
        out.append({"label": c[0], "ratio": c[1], "tasks": len(rows),
                    "mean_acc": float(np.mean([r["acc"] for r in rows])) if rows else float("nan"),
                    "mean_acc_norm": float(np.mean([r["acc_norm"] for r in rows])) if rows else float("nan"),
                    "mean_rank": float(np.mean(ranks[c])) if rows else float("nan"),
                    "examples_per_s": float(np.mean([r["examples_per_s"] for r in rows])) if rows else float("nan")})
    return out


def _cell(r: dict[str, Any]) -> str:
    lo, hi = r["acc_ci"]
    return f"{r['acc']:.3f} [{lo:.2f}, {hi:.2f}]"


def markdown(suite: dict[str, Any]) -> str:
    """The selection table, then configurations × selected tasks (accuracy [95% CI]) with the
    mean accuracy, mean acc_norm and mean rank."""
    lines = [f"Task selection: {suite['rule']}.", "", "| task | examples | chance | dense acc [95% CI] | selected |", "|---|---|---|---|---|"]
    for s in suite["selection"]:
        if "acc" not in s:
            lines.append(f"| {s['task']} | | | | no: {s['why']} |")
            continue
        lo, hi = s["acc_ci"]
        lines.append(f"| {s['task']} | {s['examples']} | {s['chance']:.3f} | {s['acc']:.3f} [{lo:.2f}, {hi:.2f}] | "
                     f"{'yes' if s['selected'] else 'no'} |")
    records = suite["records"]
    tasks = list(dict.fromkeys(r["task"] for r in records))
    table = {(r["label"], r["ratio"], r["task"]): r for r in records}
    head = ["method", "ratio"] + [t.removeprefix(PREFIX) for t in tasks] + ["mean acc", "mean acc_norm", "mean rank"]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in suite["summary"]:
        cells = [_cell(table[(s["label"], s["ratio"], t)]) if (s["label"], s["ratio"], t) in table else "" for t in tasks]
        lines.append(f"| {s['label']} | {s['ratio']:.2f} | " + " | ".join(cells)
                     + f" | {s['mean_acc']:.3f} | {s['mean_acc_norm']:.3f} | {s['mean_rank']:.2f} |")
    lines += ["", f"Accuracy: BIG-bench's multiple_choice_grade, 95% Wilson intervals; rank 1 = best per task. "
              f"{len(tasks)} tasks, {suite['seconds']:.0f} s wall (compiles included)."]
    if not suite["enough_tasks"]:
        lines.append(f"Fewer than {suite['settings']['min_tasks']} tasks passed the selection rule.")
    return "\n".join(lines)


def plot_suite(suite: dict[str, Any], out_dir: Path) -> list[Path]:
    """Accuracy per task and configuration with 95% intervals (chance marked), and mean
    accuracy per configuration annotated with its mean rank -> the PNG paths."""
    import matplotlib  # optional: plots need the eval extra (matplotlib)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: see above

    out_dir.mkdir(parents=True, exist_ok=True)
    records, summary = suite["records"], suite["summary"]
    if not records:
        return []
    tasks = list(dict.fromkeys(r["task"] for r in records))
    chance = {s["task"]: s["chance"] for s in suite["selection"] if "chance" in s}
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(max(8, 1.1 * len(tasks) + 5), 4.5), gridspec_kw={"width_ratios": [3, 1]})
    width = 0.8 / max(len(summary), 1)
    for i, s in enumerate(summary):
        rows = [(j, r) for j, t in enumerate(tasks) for r in records if r["task"] == t and (r["label"], r["ratio"]) == (s["label"], s["ratio"])]
        x = np.array([j for j, _ in rows]) - 0.4 + width * (i + 0.5)
        acc = np.array([r["acc"] for _, r in rows])
        err = np.array([[r["acc"] - r["acc_ci"][0], r["acc_ci"][1] - r["acc"]] for _, r in rows]).T
        name = s["label"] if s["label"] == "dense" else f"{s['label']} {s['ratio']:.0%}"
        ax.errorbar(x, acc, yerr=err, fmt="o", ms=4, capsize=2, label=name, color=f"C{i % 10}")
        bx.barh(i, s["mean_acc"], color=f"C{i % 10}")
        bx.text(s["mean_acc"], i, f" rank {s['mean_rank']:.1f}", va="center", fontsize=7)
    for j, t in enumerate(tasks):
        ax.hlines(chance.get(t, np.nan), j - 0.45, j + 0.45, colors="gray", linestyles=":")
    ax.set_xticks(range(len(tasks)), [t.removeprefix(PREFIX) for t in tasks], rotation=35, ha="right", fontsize=8)
    ax.set(ylabel="multiple_choice_grade (95% CI)", title="BIG-bench multiple choice (dotted: chance)")
    ax.legend(fontsize=7, ncol=2)
    bx.set_yticks(range(len(summary)), [s["label"] if s["label"] == "dense" else f"{s['label']} {s['ratio']:.0%}" for s in summary], fontsize=7)
    bx.invert_yaxis()
    bx.set_xlim(0, 1.4 * max([s["mean_acc"] for s in summary] + [1e-3]))  # room for the rank labels
    bx.set(xlabel="mean accuracy", title="mean over tasks")
    fig.tight_layout()
    path = out_dir / "bigbench_mc.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]
