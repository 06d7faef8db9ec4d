"""``popjax device-check``: one command for a lent GPU or TPU (at most 8 minutes on one H100):
the device and its versions, decode-step time, GB/s and the kernel-vs-XLA difference of every
kernel-served method at Llama-3.1-8B shapes (random weights made on the device), and the
row-gather microbenchmark, written as at most 8 JSON files under ``--out`` as they are measured
(`popjax.bench.device_check`; the exact device call: docs/performance.md)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
from pathlib import Path

import jax

from ..bench.device_check import DEVICE_PLAN, DRY_PLAN, METHOD_NAMES, run_device_check
from ..files import write_json_atomic
from ..kernels import compiling_for
from .common import comma_list, command_line

DEFAULT_BUDGET_S = 420.0  # of an 8-minute window: a measurement started just before the end still finishes in it


def register(sub) -> None:
    p = sub.add_parser("device-check", help="measure the kernels on this device (versions, decode steps vs XLA, row gathers) into JSON files")
    p.add_argument("--out", required=True, help="the folder for the JSON files (created; at most 8 files)")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help=f"seconds of measurements; checked between them, then what exists is written (default {DEFAULT_BUDGET_S:.0f})")
    p.add_argument("--dry-run", action="store_true",
                   help="the same code on this machine's CPU at tiny shapes, the Pallas kernels in interpret mode")
    p.add_argument("--layers", type=int, default=None, help=f"layers of the synthetic Llama-3.1-8B (default {DEVICE_PLAN.layers})")
    p.add_argument("--methods", type=comma_list(str), default=list(METHOD_NAMES),
                   help=f"a subset of {','.join(n.replace(' ', '-') for n in METHOD_NAMES)} (dense always runs; default all)")
    p.add_argument("--weights", type=comma_list(str), default=list(DEVICE_PLAN.weights), help="float, int8 or float,int8 (default both)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int | None:
    if not math.isfinite(args.budget_s) or args.budget_s <= 0:
        raise ValueError(f"--budget-s {args.budget_s} is invalid; give the seconds the check may take, > 0 (e.g. 420)")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a folder for the JSON files")
    plan = DRY_PLAN if args.dry_run else DEVICE_PLAN
    if args.layers is not None and args.layers < 1:
        raise ValueError(f"--layers {args.layers} is invalid; give an integer ≥ 1 (default {plan.layers})")
    methods = tuple(m.replace("-", " ") for m in args.methods)  # "block-static" on the command line
    plan = dataclasses.replace(plan, layers=args.layers or plan.layers, methods=methods, weights=tuple(args.weights))
    # a dry run is the CPU's, kernels in interpret mode, on any machine (a GPU one too)
    where = (jax.default_device(jax.devices("cpu")[0]), compiling_for("cpu")) if args.dry_run else ()
    with contextlib.ExitStack() as stack:
        for context in where:
            stack.enter_context(context)
        summary = run_device_check(out, args.budget_s, plan)
    summary["command"] = command_line(args.argv)
    write_json_atomic(out / "check.json", summary)
    print(f"device-check: {len(summary['files']) + 1} files in {out} after {summary['elapsed_s']:.0f} s"
          f"{' (stopped by the budget)' if summary['stopped_by_budget'] else ''}")
    return None
