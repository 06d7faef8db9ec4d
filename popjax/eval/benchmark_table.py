"""``popjax eval --suite piqa-bbh``: the papers' kind of accuracy table on public benchmarks, with
paired statistics: PIQA and BIG-Bench Hard's fixed-answer tasks, dense and every method at every
ratio, each question's correctness kept so that methods are compared on the same questions.

**Tasks.** PIQA (`popjax.eval.piqa`) is always in the table. A BBH task (`popjax.eval.bbh`) enters
when dense's 95% Wilson lower bound of accuracy is above the task's chance level, over the same
questions the table uses (a first pass of dense on every candidate). Dense's first-pass records are
its table entries, so dense leans high on the BBH tasks chosen for it; the methods are compared to
those same records question by question.

**Statistics** (`popjax.eval.paired`): per cell, accuracy with its 95% Wilson interval; per method
and task, the difference from dense with Newcombe's paired 95% interval, the discordant counts and
McNemar's exact p-value; per configuration, the mean accuracy and mean rank over the table's tasks.

**Throughput.** Each question's prompt is prefilled once for all its choices and questions are
batched (`bigbench_score.choice_logprobs`); each record holds its examples/s (wall, compiles
included).
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
from . import bbh
from .bigbench_score import compile_counts, evaluate_task
from .frontier import configurations
from .paired import mean_accuracy, mean_ranks, paired_comparison
from .piqa import NAME as PIQA, PiqaTask

log = logging.getLogger(__name__)

SUITE = "piqa-bbh"
RULE = ("PIQA always; a BBH task when dense's 95% Wilson lower bound of accuracy, over the table's questions, "
        "is above its chance level (the mean over questions of 1 / its number of choices)")
SOURCES = {"piqa": "github:ybisk/ybisk.github.io piqa/data/valid.jsonl + valid-labels.lst (AFL 3.0)",
           "bbh": "github:suzgunmirac/BIG-Bench-Hard bbh/NAME.json, cot-prompts/NAME.txt (MIT)"}


@dataclasses.dataclass(frozen=True)
class TableSettings:
    limit: int | None = None  # questions per task (None: all); PIQA's first N, BBH's BIG-bench seeded draw
    fewshot: bool = False  # BBH: its three answer-only exemplars before each question
    batch_size: int = 8
    seed: int = 42


def candidate_tasks(data_dir: str | Path, bbh_names: Sequence[str] | None = None, fewshot: bool = False) -> list[Any]:
    """PIQA, then the BBH tasks named (``bbh:`` optional), else every fixed-answer BBH task under
    ``data_dir``. Every file is read here, so a missing one fails before the model loads."""
    names = list(bbh_names) if bbh_names else bbh.fixed_answer_tasks(data_dir)
    if not names:
        raise FileNotFoundError(f"no BBH tasks under {Path(data_dir) / 'bbh'}; they come from {bbh.SOURCE} (folder bbh/)")
    return [PiqaTask.load(data_dir)] + [bbh.load_task(n, data_dir, fewshot) for n in names]


def run_table(model: LoadedModel, specs: Sequence[str], ratios: Sequence[float], tasks: list[Any],
              settings: TableSettings = TableSettings()) -> dict[str, Any]:
    """First pass (dense on every task), selection, then every configuration on the kept tasks ->
    {"rule", "settings", "selection", "records" (with per-question "grades"), "comparisons",
    "summary", "seconds", "examples_per_s", "compiles"}."""
    configs = configurations(specs, ratios)  # dense first; per-row aggregates (batch-independent)
    start, before = time.perf_counter(), compile_counts()
    run = lambda method, task: evaluate_task(model, method, task, 0, settings.limit, settings.seed, settings.batch_size)
    dense = configs[0][1].prepare(model)
    selection, records, kept = [], [], []
    for task in tqdm(tasks, desc="first pass (dense)", unit="task"):
        record = run(dense, task)
        chosen = task.label == PIQA or record["acc_ci"][0] > task.chance
        selection.append({"task": task.label, "selected": chosen, "examples": record["examples"], "chance": task.chance,
                          "acc": record["acc"], "acc_ci": record["acc_ci"]})
        if chosen:
            records.append(record)
            kept.append(task)
    log.info("%d of %d tasks kept (%s)", len(kept), len(tasks), RULE)
    prepared = {}
    for _, method in tqdm(configs[1:], desc="methods", unit="configuration"):
        key = repr(method)
        prepared.setdefault(key, method.prepare(model))  # offline methods calibrate once (cached on disk)
        records += [run(prepared[key], task) for task in kept]
    after, seconds = compile_counts(), time.perf_counter() - start
    examples = sum(r["examples"] for r in records) + sum(s["examples"] for s in selection if not s["selected"])
    return {
        "rule": RULE,
        "sources": SOURCES,
        "settings": dataclasses.asdict(settings),
        "selection": selection,
        "records": records,
        "comparisons": compare_to_dense(records),
        "summary": summarize(records),
        "seconds": seconds,
        "examples_per_s": examples / max(seconds, 1e-9),
        "compiles": {k: after[k] - before[k] for k in after},
    }


def configuration(record: dict[str, Any]) -> tuple[str, float]:
    """A record's configuration: (label, ratio)."""
    return record["label"], record["ratio"]


def compare_to_dense(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per non-dense record: its `paired.paired_comparison` against dense's record of the same
    task (the same questions, in the same order)."""
    dense = {r["task"]: r for r in records if r["method"] == "dense"}
    out = []
    for r in records:
        if r["method"] == "dense" or r["task"] not in dense:
            continue
        if len(r["grades"]) != len(dense[r["task"]]["grades"]):
            raise ValueError(f"{r['label']} on {r['task']}: {len(r['grades'])} grades, dense has "
                             f"{len(dense[r['task']]['grades'])}; a paired comparison needs the same questions")
        out.append({"label": r["label"], "ratio": r["ratio"], "task": r["task"],
                    **paired_comparison(dense[r["task"]]["grades"], r["grades"])})
    return out


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per configuration, in sweep order: mean accuracy and mean rank over the tasks every
    configuration ran, their number, and examples/s over all its records."""
    configs = list(dict.fromkeys(configuration(r) for r in records))
    tasks = list(dict.fromkeys(r["task"] for r in records))
    table = {(*configuration(r), r["task"]): r for r in records}
    common = [t for t in tasks if all((*c, t) in table for c in configs)]
    if not common:
        return [{"label": c[0], "ratio": c[1], "tasks": 0, "mean_acc": float("nan"), "mean_rank": float("nan"),
                 "examples_per_s": float("nan")} for c in configs]
    accuracy = np.array([[table[(*c, t)]["acc"] for t in common] for c in configs])
    means, ranks = mean_accuracy(accuracy), mean_ranks(accuracy)
    out = []
    for c, acc, rank in zip(configs, means, ranks):
        own = [r for r in records if configuration(r) == c]
        speed = sum(r["examples"] for r in own) / max(sum(r["seconds"] for r in own), 1e-9)
        out.append({"label": c[0], "ratio": c[1], "tasks": len(common), "mean_acc": float(acc), "mean_rank": float(rank),
                    "examples_per_s": speed})
    return out
