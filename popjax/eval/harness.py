"""The evaluation sweep: methods × ratios × tasks -> JSON records, a markdown table and plots.

A record is ``{"method", "ratio", "task", <metrics by name>, "ffn_flops_overhead_vs_static"}``.
Pruning methods run with ``aggregate="per_sequence"`` by default: each sequence gets its own
partition, which equals the paper's batch-1 setting while still batching for speed.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from ..analysis.flops import flops_report
from ..loaded import LoadedModel
from ..methods import Method, method_label, sweep
from . import tasks as T
from ..data import INSTRUCTIONS, humaneval_problems
from .digits_vqa import digits_task
from .local_tasks import next_line_accuracy, write_next_line_task

log = logging.getLogger(__name__)
TASKS = ("nll", "code_nll", "fidelity", "next_line", "humaneval", "digits_vqa")
METRICS = {  # what the table and the ratio plots show, per task
    "nll": ("nll", "ppl"),
    "code_nll": ("code_nll",),
    "fidelity": ("agreement_prefix", "agreement", "kl"),
    "next_line": ("next_line_acc", "next_line_acc_norm"),  # the local lm-eval task (local_tasks.py)
    "humaneval": ("pass_at_1",),
    "digits_vqa": ("digits_accuracy", "digits_answer_nll"),  # image questions: the digits VLM trained here (digits_vqa.py)
}


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    nll: T.NLLSettings = T.NLLSettings()
    code_nll: T.CodeNLLSettings = T.CodeNLLSettings()
    fidelity: T.FidelitySettings = T.FidelitySettings()
    humaneval: T.HumanEvalSettings = T.HumanEvalSettings()
    fidelity_instructions: int = len(INSTRUCTIONS)  # instructions through the chat template
    fidelity_humaneval_prompts: int = 8  # HumanEval prompts added to the instructions
    next_line_play: str = "coriolanus"  # the play of the local lm-eval task
    next_line_documents: int = 48
    digits_images: int | None = None  # held-out digits of the digits_vqa task (None: all 297)


def check_tasks(task_names: list[str]) -> None:
    unknown = sorted(set(task_names) - set(TASKS))
    if unknown:
        raise ValueError(f"unknown tasks {unknown}; valid tasks: {list(TASKS)}")


def sweep_methods(specs: list[str], ratios: list[float], gamma: float, aggregate: str) -> list[Method]:
    """Each method spec in the order given (``name`` or ``name:key=value:...``, see
    ``parse_method_spec``): once if it takes no ratio (dense, prefill-only), else at each ratio,
    with ``gamma`` and ``aggregate`` passed to the methods that take them."""
    return [method for _, method in sweep(specs, ratios, gamma=gamma, aggregate=aggregate)]


def fidelity_prompts(model: LoadedModel, n_instructions: int, n_humaneval: int) -> list[list[int]]:
    """The first instructions through the chat template, plus the first raw HumanEval prompts."""
    tok = model.tokenizer
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        for text in INSTRUCTIONS[:n_instructions]
    ]
    prompts += [p["prompt"] for p in humaneval_problems(n_humaneval)]
    return [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]


def evaluate(
    model: LoadedModel, methods: list[Method], task_names: list[str], text: str, settings: EvalSettings
) -> list[dict[str, Any]]:
    """Runs every task for every method; returns one record per (method, ratio, task)."""
    check_tasks(task_names)
    records = []
    reference = prompts = problems = None
    if "fidelity" in task_names:
        prompts = fidelity_prompts(model, settings.fidelity_instructions, settings.fidelity_humaneval_prompts)
        reference = T.dense_reference(model, prompts, settings.fidelity)
    if "humaneval" in task_names:
        problems = humaneval_problems(settings.humaneval.subset)
    code_problems = humaneval_problems(settings.code_nll.subset) if "code_nll" in task_names else None
    task_dir = None
    if "next_line" in task_names:
        task_tmp = tempfile.TemporaryDirectory(prefix="popjax-next-line-")  # removed when the sweep returns
        task_dir = task_tmp.name
        write_next_line_task(task_dir, settings.next_line_play, settings.next_line_documents)
    jobs = [(m, t) for m in methods for t in task_names]
    for method, task in tqdm(jobs, desc="eval", unit="run"):
        method = method.prepare(model)  # offline methods calibrate once (cached on disk)
        if task == "nll":
            metrics = T.online_nll(model, method, text, settings.nll)
        elif task == "code_nll":
            metrics = T.code_nll(model, method, code_problems, settings.code_nll)
        elif task == "fidelity":
            metrics = T.fidelity(model, method, prompts, reference, settings.fidelity)
        elif task == "next_line":
            metrics = next_line_accuracy(model, method, task_dir)
        elif task == "digits_vqa":
            metrics = digits_task(model, method, settings.digits_images)
        else:
            metrics = T.humaneval(model, method, problems, settings.humaneval)
        records.append({
            "method": method.name,
            "label": method_label(method, exclude=("ratio",)),
            **method.reported(),
            "task": task,
            **metrics,
            "ffn_flops_overhead_vs_static": flops_report(model.config, method)["overhead_vs_static_of_dense"],
        })
    return records


def markdown_table(records: list[dict[str, Any]]) -> str:
    """One row per (method, ratio) with every metric found, plus the FFN FLOPs overhead."""
    rows: dict[tuple, dict[str, Any]] = {}
    for r in records:
        row = rows.setdefault((r["label"], r["ratio"]), {"overhead": r["ffn_flops_overhead_vs_static"]})
        for metric in METRICS[r["task"]]:
            row[metric] = r[metric]
    columns = [m for task in TASKS for m in METRICS[task] if any(m in row for row in rows.values())]
    lines = [
        "| method | ratio | " + " | ".join(columns) + " | FFN FLOPs over static (% of dense) |",
        "|---|---|" + "---|" * (len(columns) + 1),
    ]
    order = {method: i for i, (method, _) in enumerate(rows)}  # the sweep's own order
    for (method, ratio), row in sorted(rows.items(), key=lambda kv: (kv[0][1], order[kv[0][0]])):
        cells = [f"{row[c]:.4f}" if c in row else "" for c in columns]
        lines.append(f"| {method} | {ratio:.2f} | " + " | ".join(cells) + f" | {100 * row['overhead']:.2f} |")
    return "\n".join(lines)


def plot_records(records: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """NLL by decode position per method, and each metric against the ratio. Returns PNG paths."""
    import matplotlib  # optional: plots need the eval extra (matplotlib)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: see above

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    nll = [r for r in records if r["task"] == "nll"]
    if nll:
        fig, ax = plt.subplots(figsize=(7, 4))
        for r in nll:
            curve = np.asarray(r["nll_by_position"])
            bins = max(1, len(curve) // 16)
            smooth = curve[: len(curve) // bins * bins].reshape(-1, bins).mean(1)
            label = r["label"] if not r["ratio"] else f"{r['label']} {r['ratio']:.0%}"
            ax.plot(np.arange(len(smooth)) * bins + bins / 2, smooth, label=label, ls="-" if r["ratio"] <= 0.2 else "--")
        ax.set(xlabel="decode position (tokens after the prefilled context)", ylabel="NLL (nats, binned)",
               title="Online teacher-forced NLL by decode position")
        ax.legend(fontsize=8, ncol=2)
        fig.tight_layout()
        paths.append(out_dir / "nll_by_position.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    for task, metrics in METRICS.items():
        for metric in metrics:
            rows = [r for r in records if r["task"] == task and metric in r]
            if not rows:
                continue
            fig, ax = plt.subplots(figsize=(5, 3.5))
            for label in dict.fromkeys(r["label"] for r in rows if r["method"] != "dense"):
                pts = sorted((r["ratio"], r[metric]) for r in rows if r["label"] == label)
                ax.plot(*zip(*pts), marker="o", label=label)
            for r in rows:
                if r["method"] == "dense":
                    ax.axhline(r[metric], color="gray", ls=":", label="dense")
            ax.set(xlabel="global pruning ratio", ylabel=metric, title=f"{metric} ({task})")
            ax.legend(fontsize=8)
            fig.tight_layout()
            paths.append(out_dir / f"{metric}_vs_ratio.png")
            fig.savefig(paths[-1], dpi=120)
            plt.close(fig)
    return paths
