"""``popjax eval --suite piqa-bbh`` (the table of `popjax.eval.benchmark_table`) and
``popjax eval --render JSON[,JSON...]`` (its markdown, plot and docs section again, from the JSON
alone, without a model)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path
from typing import Any, Callable

from .. import distributed
from ..eval import bbh
from ..eval.benchmark_report import markdown, plot, update_section
from ..eval.benchmark_table import SUITE, TableSettings, candidate_tasks, run_table
from ..eval.frontier import configurations
from ..files import write_json_atomic
from .common import command_line


def add_table_args(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group(f"the {SUITE} table (docs/benchmarks.md)")
    group.add_argument("--docs", default=None,
                       help=f"--suite {SUITE} / --render: write the table into this markdown file's section for the model "
                            "(e.g. docs/benchmarks.md; the rest of the file is kept)")
    group.add_argument("--render", default=None, type=lambda s: [x for x in s.split(",") if x],
                       help=f"JSON files of --suite {SUITE} runs: remake their markdown (--docs), plot and report (--out), run nothing")


def _section_key(model: str) -> str:
    """The docs section of a model: its name without folders."""
    return Path(str(model).rstrip("/")).name or str(model)


def write_results(result: dict[str, Any], docs: str | None, out: str | None) -> str:
    """The markdown of ``result``, written into ``docs``' section and, with ``out``, report.md and
    the plot -> the markdown."""
    body = markdown(result)
    key = _section_key(result.get("model", "model"))
    if out:
        directory = Path(out)
        plots = plot(result, directory)
        lines = [f"# PIQA and BIG-Bench Hard ({SUITE}): `{result.get('model')}`", "",
                 f"Generated {datetime.date.today()}.", "", body, ""] + [f"![{p.stem}]({p.name})" for p in plots]
        (directory / "report.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
        if docs:  # the docs link the plot where report.md sits
            where = Path(docs).resolve().parent
            body += "".join(f"\n\n![{p.stem}]({Path(os.path.relpath(p.resolve(), where)).as_posix()})" for p in plots)
    if docs:
        update_section(Path(docs), key, body, f"{key}: PIQA and BIG-Bench Hard, paired against dense")
    return body


def table_command(args: argparse.Namespace, names: list[str], own_tasks_given: bool, load_model: Callable[[], Any]) -> None:
    """``--suite piqa-bbh``: validate every file, load, run, print; write JSON, docs, report, plot."""
    others = [n for n in names if not n.startswith(bbh.PREFIX)]
    if own_tasks_given or others:
        raise ValueError(f"--suite {SUITE} takes BBH tasks only in --tasks (bbh:NAME; PIQA is always in); got {others or 'own tasks'}")
    if args.data_dir is None:
        raise ValueError(f"--suite {SUITE} needs --data-dir DIR with piqa/ and bbh/ (see docs/benchmarks.md for where to get them)")
    if args.shots:
        raise ValueError(f"--shots {args.shots}: the {SUITE} table is zero-shot; --bbh-fewshot adds BBH's own three exemplars")
    settings = TableSettings(limit=args.limit, fewshot=args.bbh_fewshot, batch_size=args.batch_size, seed=args.seed)
    tasks = candidate_tasks(args.data_dir, names, args.bbh_fewshot)
    configurations(args.methods, args.ratios)  # a bad method spec fails here, before the (slow) load
    result = {"command": command_line(args.argv), "model": args.model,
              **run_table(load_model(), args.methods, args.ratios, tasks, settings)}
    if not distributed.is_main():
        return
    if args.json:
        write_json_atomic(Path(args.json), result)
    print(write_results(result, args.docs, args.out))


def render_command(args: argparse.Namespace) -> None:
    """``--render``: each JSON's section into ``--docs`` and, with one JSON, ``--out``'s report and plot."""
    if args.out and len(args.render) > 1:
        raise ValueError(f"--out {args.out} takes one --render JSON; got {len(args.render)}")
    for name in args.render:
        path = Path(name)
        if not path.is_file():
            raise FileNotFoundError(f"--render {name}: no such JSON (a --suite {SUITE} run writes it with --json)")
        result = json.loads(path.read_text(encoding="utf-8"))
        if "comparisons" not in result:
            raise ValueError(f"--render {name} is not a --suite {SUITE} result (it has no 'comparisons')")
        print(write_results(result, args.docs, args.out))
