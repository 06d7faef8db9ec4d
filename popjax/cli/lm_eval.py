"""``popjax lm-eval``: lm-evaluation-harness's ``simple_evaluate`` over the popjax model of
`popjax.eval.lm_eval_adapter`, with popjax's method flags and local task directories."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from ..convert.default_model import DEFAULT_MODEL
from ..eval.lm_eval_adapter import (
    ADAPTER_ARGS, DEFAULT_BATCH_SIZE, IGNORED_ARGS, build_method, require_lm_eval, task_manager_for,
)
from .. import distributed
from ..files import write_json_atomic
from .common import add_distributed_args, add_method_args, add_weights_arg, command_line, mesh_from_args
from .eval_bigbench import add_lm_eval_args, lm_eval_bigbench


def _limit(value: str) -> int | float:
    number = float(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"--limit {value} must be > 0 (a count, or a fraction below 1)")
    return int(number) if number >= 1 and number.is_integer() else number


def register(sub) -> None:
    p = sub.add_parser("lm-eval", help="score a method on lm-evaluation-harness tasks (popjax[eval])")
    p.add_argument("--tasks", required=True, type=lambda s: [t for t in s.split(",") if t],
                   help="comma-separated lm-eval task names (built-in or from --include-path), or bigbench:NAME")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"source (default {DEFAULT_MODEL})")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on GPU/TPU, float32 on CPU")
    add_weights_arg(p)
    before = {action.dest for action in p._actions}
    add_method_args(p)  # the method flags every command shares; their values become model_args
    p.set_defaults(method_flags=[a.dest for a in p._actions if a.dest not in before])
    for action in p._actions:  # this command's default differs from generate's (see build_method)
        if action.dest == "aggregate":
            action.help = "default here: per_sequence (per_token for teal/cats), so a score never depends on its batch"
    p.add_argument("--model-args", default="", help="more model_args, e.g. max_length=1024 or a method's hyper-parameters")
    p.add_argument("--include-path", default=None, help="directory of extra task YAMLs (local tasks)")
    p.add_argument("--no-builtin-tasks", action="store_true",
                   help="index only --include-path, not lm-eval's built-in tasks (faster, offline)")
    p.add_argument("--limit", type=_limit, default=None, help="documents per task (count, or fraction < 1)")
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    p.add_argument("--apply-chat-template", action="store_true")
    p.add_argument("--bootstrap-iters", type=int, default=100000, help="0 skips bootstrapped stderrs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write lm-eval's results here")
    add_lm_eval_args(p)
    add_distributed_args(p)
    p.set_defaults(run=run)


def model_args_from_cli(args: argparse.Namespace) -> dict[str, Any]:
    """The ``model_args`` of ``PopjaxLM``: the flags that were given, then ``--model-args``."""
    from lm_eval.utils import simple_parse_args_string  # optional: lm-evaluation-harness (popjax[eval])

    given = {"source": args.model, "dtype": args.dtype, "weights": args.weights, "batch_size": args.batch_size, "seed": args.seed}
    given |= {name: getattr(args, name) for name in args.method_flags}  # method, ratio, gamma, ...
    return {k: v for k, v in given.items() if v is not None} | simple_parse_args_string(args.model_args)


def run(args: argparse.Namespace) -> None:
    require_lm_eval()
    # optional: lm-evaluation-harness (popjax[eval]); require_lm_eval has said how to install it
    import lm_eval
    from lm_eval.utils import handle_non_serializable, make_table  # optional: as above

    model_args = model_args_from_cli(args)
    mesh = mesh_from_args(args)
    if mesh is not None:  # an object, not a string: lm-eval passes a dict's values to PopjaxLM as they are
        model_args["mesh"] = mesh
    hyper = {k: v for k, v in model_args.items() if k not in ADAPTER_ARGS + IGNORED_ARGS}
    method = build_method(model_args["method"], hyper)
    bigbench_dir = tempfile.TemporaryDirectory(prefix="popjax-bigbench-")  # removed when the run returns
    lm_eval_bigbench(args, bigbench_dir.name)  # bigbench:NAME -> a local task (BIG-bench's prompts, offline)
    task_manager = task_manager_for(args.tasks, args.include_path, not args.no_builtin_tasks)  # before the load
    results = lm_eval.simple_evaluate(
        model="popjax", model_args=model_args, tasks=args.tasks, num_fewshot=args.num_fewshot,
        limit=args.limit, task_manager=task_manager, apply_chat_template=args.apply_chat_template,
        bootstrap_iters=args.bootstrap_iters, log_samples=False, random_seed=args.seed,
    )
    if not distributed.is_main():  # every process scored the same documents; process 0 reports
        return
    print(make_table(results))
    if args.json:
        payload = {"command": command_line(args.argv), "model_args": model_args, "method": repr(method), **results}
        write_json_atomic(Path(args.json), json.loads(json.dumps(payload, default=handle_non_serializable)))
