"""``popjax eval``: the evaluation sweep from the command line, writing JSON, a table, plots and a report."""

from __future__ import annotations

import argparse

from ..data import load_play, load_text_file
from ..eval.harness import EvalSettings, check_tasks, evaluate, markdown_table, plot_records, sweep_methods
from ..eval.tasks import CodeNLLSettings, FidelitySettings, HumanEvalSettings, NLLSettings
from ..loading import load
from .common import add_distributed_args, add_model_arg, add_weights_arg, comma_list, mesh_from_args, write_outputs
from .eval_benchmarks import add_table_args, render_command, table_command
from .eval_bigbench import (
    TABLE_SUITE, add_bigbench_args, bigbench_methods, bigbench_records, bigbench_table, check_bigbench, is_choice_task,
    list_command, plot_bigbench, split_tasks, suite_command,
)


def register(sub) -> None:
    p = sub.add_parser("eval", help="evaluate pruning methods on real data (NLL, fidelity, HumanEval)")
    add_model_arg(p)  # digits-vlm: the small VLM trained here, for the digits_vqa task
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: bfloat16 on GPU/TPU, float32 on CPU)")
    add_weights_arg(p)
    p.add_argument("--scan-layers", action="store_true", help="run the layers under lax.scan: faster compiles, slower CPU decode (docs/performance.md)")
    p.add_argument("--methods", type=comma_list(str), default=["dense", "static", "pop", "dynamic"])
    p.add_argument("--ratios", type=comma_list(float), default=[0.2, 0.4])
    p.add_argument("--gamma", type=float, default=0.1, help="POP's candidate band (default 0.1)")
    p.add_argument("--aggregate", default="per_sequence", help="per_sequence (default) or shared")
    p.add_argument("--tasks", type=comma_list(str), default=None,
                   help="nll, code_nll, fidelity, next_line, humaneval, digits_vqa, bigbench:NAME, bbh:NAME and piqa "
                        "(default nll,fidelity,humaneval)")
    p.add_argument("--play", default="hamlet", help="Shakespeare play for the NLL task (see popjax.data)")
    p.add_argument("--text-file", default=None, help="evaluate NLL on this UTF-8 text instead of a play")
    p.add_argument("--nll-prompt-tokens", type=int, default=256)
    p.add_argument("--nll-decode-tokens", type=int, default=128)
    p.add_argument("--nll-windows", type=int, default=16)
    p.add_argument("--code-subset", type=int, default=64, help="code_nll: first N HumanEval problems")
    p.add_argument("--code-tokens", type=int, default=128, help="code_nll: solution tokens scored at most")
    p.add_argument("--fidelity-tokens", type=int, default=48)
    p.add_argument("--fidelity-instructions", type=int, default=16, help="chat instructions used (max 16)")
    p.add_argument("--fidelity-humaneval", type=int, default=8, help="HumanEval prompts added")
    p.add_argument("--next-line-documents", type=int, default=48,
                   help="next_line: 4-choice documents of the local lm-eval task (from --play)")
    p.add_argument("--humaneval-subset", type=int, default=None, help="first N problems (default all 164)")
    p.add_argument("--humaneval-tokens", type=int, default=192)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--json", default=None, help="write the records here")
    p.add_argument("--out", default=None, help="directory for report.md and the plots")
    add_bigbench_args(p)
    add_table_args(p)
    add_distributed_args(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    own_given = bool(args.tasks) and any(not is_choice_task(t) for t in args.tasks)
    args.tasks, bigbench = split_tasks(args.tasks)
    if args.list_bigbench:
        return list_command(args)
    if args.render:
        return render_command(args)
    if args.suite:
        command = table_command if args.suite == TABLE_SUITE else suite_command
        return command(args, bigbench, own_given, lambda: load(args.model, dtype=args.dtype, scan_layers=args.scan_layers,
                                                              weights=args.weights, mesh=mesh_from_args(args)))
    check_tasks(args.tasks)  # validate before the (slow) load
    bigbench_tasks = check_bigbench(args, bigbench)
    methods = sweep_methods(args.methods, args.ratios, args.gamma, args.aggregate)
    text = load_text_file(args.text_file) if args.text_file else load_play(args.play)
    settings = EvalSettings(
        nll=NLLSettings(args.nll_prompt_tokens, args.nll_decode_tokens, args.nll_windows, args.batch_size),
        code_nll=CodeNLLSettings(args.code_subset, args.code_tokens, args.batch_size),
        fidelity=FidelitySettings(args.fidelity_tokens, args.batch_size),
        humaneval=HumanEvalSettings(args.humaneval_subset, args.humaneval_tokens, args.batch_size),
        fidelity_instructions=args.fidelity_instructions,
        fidelity_humaneval_prompts=args.fidelity_humaneval,
        next_line_play=args.play,
        next_line_documents=args.next_line_documents,
    )
    model = load(args.model, dtype=args.dtype, scan_layers=args.scan_layers, weights=args.weights, mesh=mesh_from_args(args))
    records = evaluate(model, methods, args.tasks, text, settings) if args.tasks else []
    table, plot = markdown_table(records) if records else "", plot_records
    if bigbench_tasks:  # BIG-bench multiple choice: its own table and plot after popjax's tasks
        own = records
        bigbench_part = bigbench_records(model, bigbench_methods(args), bigbench_tasks, args)
        records, table = own + bigbench_part, "\n\n".join(t for t in (table, bigbench_table(bigbench_part)) if t)
        plot = lambda _, out: (plot_records(own, out) if own else []) + plot_bigbench(bigbench_part, out)
    source = args.text_file or f"Shakespeare, {args.play}"
    write_outputs(args, records, table, plot, "popjax evaluation", f"Model `{args.model}`, NLL text: {source}.")
