"""The multiple-choice part of ``popjax eval``: ``--tasks bigbench:NAME,...`` (scored as BIG-bench
scores it: `popjax.eval.bigbench`), ``bbh:NAME`` (BIG-Bench Hard's files: `popjax.eval.bbh`) and
``piqa`` (PIQA's files, scored as lm-eval scores it: `popjax.eval.piqa`), ``--shots``, ``--limit``,
``--list-bigbench`` and ``--suite bigbench-mc`` (`popjax.eval.bigbench_suite`); and of
``popjax lm-eval``: the same task names, written as local lm-eval tasks."""

from __future__ import annotations

import argparse
import datetime
import logging
from pathlib import Path
from typing import Any, Callable

from .. import distributed
from ..eval import bbh, piqa
from ..eval.bigbench import PREFIX, list_tasks, load_task
from ..eval.bigbench_score import evaluate_task, write_lm_eval_task
from ..eval.benchmark_table import SUITE as TABLE_SUITE
from ..eval.bigbench_suite import SUITE, SuiteSettings, candidate_tasks, markdown, plot_suite, run_suite, summarize
from ..files import write_json_atomic
from ..methods import sweep
from ..methods.base import ROW_AGGREGATES
from .common import command_line

log = logging.getLogger(__name__)
DEFAULT_TASKS = ["nll", "fidelity", "humaneval"]


def add_bigbench_args(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("multiple choice: BIG-bench, BBH, PIQA (docs/benchmarks.md)")
    group.add_argument("--data-dir", default=None,
                       help=f"folder with piqa/ ({piqa.SOURCE}) and bbh/, cot-prompts/ ({bbh.SOURCE}) for --tasks piqa,bbh:NAME")
    group.add_argument("--bbh-fewshot", action="store_true",
                       help="bbh:NAME tasks: BBH's three exemplars (DIR/cot-prompts/NAME.txt, answer-only) before each question")
    group.add_argument("--shots", type=int, default=0, help="BIG-bench tasks: examples shown before each question (default 0)")
    group.add_argument("--limit", type=int, default=None,
                       help="BIG-bench tasks: examples per task, BIG-bench's seeded draw (default all; the suite: 40)")
    group.add_argument("--seed", type=int, default=42, help="BIG-bench tasks: seed of the shots and the limit's draw (default 42, BIG-bench's)")
    group.add_argument("--bigbench-dir", default=None,
                       help="a folder of BIG-bench task folders (<task>/task.json) instead of the cached bigbench==1.0.0 sdist")
    group.add_argument("--suite", choices=[SUITE, TABLE_SUITE], default=None,
                       help=f"{SUITE}: dense and the methods at --ratios on every BIG-bench multiple-choice task where dense is "
                            f"above chance; {TABLE_SUITE}: the same on PIQA and BBH (--data-dir), with paired statistics")
    group.add_argument("--min-tasks", type=int, default=8, help="the suite: tasks it wants to pass the selection rule (default 8)")
    group.add_argument("--list-bigbench", action="store_true", help="print the BIG-bench tasks with multiple-choice examples and exit")


def is_choice_task(name: str) -> bool:
    """A multiple-choice task of this module: ``bigbench:NAME``, ``bbh:NAME`` or ``piqa``."""
    return name == piqa.NAME or name.startswith((PREFIX, bbh.PREFIX))


def split_tasks(tasks: list[str] | None) -> tuple[list[str], list[str]]:
    """--tasks -> (popjax's own tasks, the multiple-choice task names as given); no --tasks: the
    default own tasks."""
    if tasks is None:
        return list(DEFAULT_TASKS), []
    return [t for t in tasks if not is_choice_task(t)], [t for t in tasks if is_choice_task(t)]


def load_choice_task(name: str, args: argparse.Namespace) -> Any:
    """``bbh:NAME`` and ``piqa`` from --data-dir; any other name (``bigbench:`` optional) is a
    BIG-bench task from --bigbench-dir (or the sdist)."""
    if not (name == piqa.NAME or name.startswith(bbh.PREFIX)):
        return load_task(name, args.bigbench_dir)
    if args.data_dir is None:
        source = piqa.SOURCE if name == piqa.NAME else f"{bbh.SOURCE} (folders bbh/, cot-prompts/)"
        raise ValueError(f"--tasks {name} needs --data-dir DIR holding its files, from {source}")
    if name == piqa.NAME:
        return piqa.PiqaTask.load(args.data_dir)
    return bbh.load_task(name, args.data_dir, args.bbh_fewshot)


def check_bigbench(args: argparse.Namespace, names: list[str]) -> list[Any]:
    """Loads the named tasks and builds their queries once, so a bad name, a missing file, a task
    without multiple-choice examples or too many shots fails before the model loads."""
    if args.shots < 0 or (args.limit is not None and args.limit < 1):
        raise ValueError(f"--shots {args.shots} must be ≥ 0 and --limit {args.limit} ≥ 1")
    tasks = [load_choice_task(name, args) for name in names]
    for task in tasks:
        task.queries(args.shots, args.limit, args.seed)
    return tasks


def bigbench_methods(args: argparse.Namespace) -> list:
    """The sweep with a batch-independent aggregate wherever the method has one (the flag first)."""
    methods = [m for _, m in sweep(args.methods, args.ratios, gamma=args.gamma, aggregate=(args.aggregate, *ROW_AGGREGATES))]
    for m in methods:
        if not m.batch_independent:
            log.warning("%s depends on its batch: its BIG-bench scores depend on the batch size and padding", m.name)
    return methods


def bigbench_records(model, methods: list, tasks: list[Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    records = []
    for method in methods:
        method = method.prepare(model)
        records += [evaluate_task(model, method, t, args.shots, args.limit, args.seed, args.batch_size) for t in tasks]
    return records


def bigbench_table(records: list[dict[str, Any]]) -> str:
    """One row per (method, ratio, task): accuracy and acc_norm with 95% Wilson intervals."""
    lines = ["| method | ratio | task | examples | chance | acc [95% CI] | acc_norm [95% CI] | examples/s | compiles |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        (a, b), (c, d) = r["acc_ci"], r["acc_norm_ci"]
        compiles = sum(r["compiles"].values())
        lines.append(f"| {r['label']} | {r['ratio']:.2f} | {r['task']} | {r['examples']} | {r['chance']:.3f} | {r['acc']:.3f} [{a:.2f}, {b:.2f}] "
                     f"| {r['acc_norm']:.3f} [{c:.2f}, {d:.2f}] | {r['examples_per_s']:.2f} | {compiles} |")
    return "\n".join(lines)


def list_command(args: argparse.Namespace) -> None:
    if distributed.is_main():
        print("\n".join(PREFIX + name for name in list_tasks(args.bigbench_dir)))


def suite_command(args: argparse.Namespace, names: list[str], own_tasks_given: bool, load_model: Callable[[], Any]) -> None:
    """``--suite bigbench-mc``: validate, load, run, print the tables; write JSON, report.md and the plot."""
    if own_tasks_given or any(not n.startswith(PREFIX) for n in names):
        raise ValueError(f"--suite {SUITE} runs BIG-bench tasks only; name them as bigbench:NAME in --tasks, or drop --tasks")
    settings = SuiteSettings(limit=args.limit if args.limit is not None else SuiteSettings.limit, shots=args.shots,
                             seed=args.seed, batch_size=args.batch_size, min_tasks=args.min_tasks)
    tasks = candidate_tasks(names, args.bigbench_dir)
    suite = run_suite(load_model(), args.methods, args.ratios, tasks, settings)
    if not distributed.is_main():
        return
    table = markdown(suite)
    print(table)
    if args.json:
        write_json_atomic(Path(args.json), {"command": command_line(args.argv), "model": args.model, **suite})
    if args.out:
        out = Path(args.out)
        plots = plot_suite(suite, out)
        lines = [f"# BIG-bench multiple choice ({SUITE})", "", f"Model `{args.model}`. Generated {datetime.date.today()} by", "",
                 f"```bash\n{command_line(args.argv)}\n```", "", table, ""] + [f"![{p.stem}]({p.name})" for p in plots]
        (out / "report.md").write_text("\n".join(lines) + "\n")


def plot_bigbench(records: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """The suite's plot for the BIG-bench records of a plain ``--tasks`` run (no selection)."""
    suite = {"records": records, "selection": [{"task": r["task"], "chance": r["chance"]} for r in records],
             "summary": summarize(records)}
    return plot_suite(suite, out_dir)


def add_lm_eval_args(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("BIG-bench tasks (--tasks bigbench:NAME; docs/benchmarks.md)")
    group.add_argument("--bigbench-dir", default=None, help="a folder of BIG-bench task folders instead of the cached sdist")
    group.add_argument("--bigbench-shots", type=int, default=0, help="examples shown before each question, BIG-bench's draw (default 0)")
    group.add_argument("--bigbench-seed", type=int, default=42, help="seed of the shots and of --limit's draw (default 42)")
    group.add_argument("--data-dir", default=None,
                       help=f"--tasks piqa, bbh:NAME: a folder with piqa/ ({piqa.SOURCE}) and bbh/, cot-prompts/ ({bbh.SOURCE})")
    group.add_argument("--bbh-fewshot", action="store_true", help="bbh:NAME: BBH's three answer-only exemplars first")


def lm_eval_bigbench(args: argparse.Namespace, directory: str | Path) -> None:
    """Writes each ``bigbench:NAME`` / ``bbh:NAME`` of ``args.tasks``, and ``piqa`` when
    ``--data-dir`` is given, as a local lm-eval task into ``directory`` and points ``args.tasks`` /
    ``args.include_path`` at them. An integer ``--limit`` is BIG-bench's seeded draw for the first
    two, as in ``popjax eval``, and lm-eval's first N for PIQA (lm-eval's own piqa task, pointed at
    the local files), so both commands score the same documents."""
    local = [t for t in args.tasks if t.startswith((PREFIX, bbh.PREFIX)) or (t == piqa.NAME and args.data_dir is not None)]
    if not local:
        return
    if args.include_path is not None:
        raise ValueError(f"--include-path {args.include_path} and local tasks {local}: run them in separate commands")
    limit = args.limit if isinstance(args.limit, int) else None
    written = {}
    for t in local:
        if t == piqa.NAME:
            written[t] = piqa.write_lm_eval_task(args.data_dir, directory)
            continue
        task = load_choice_task(t, args)
        written[t] = write_lm_eval_task(task, directory, args.bigbench_shots, limit, args.bigbench_seed)
    args.tasks, args.include_path = [written.get(t, t) for t in args.tasks], str(directory)
