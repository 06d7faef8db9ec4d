"""``popjax eval``: the evaluation sweep from the command line, writing JSON, a table, plots and a report."""

from __future__ import annotations

import argparse

from ..convert.default_model import DEFAULT_MODEL
from ..data import load_play, load_text_file
from ..eval.digits_vlm import digits_vlm
from ..eval.harness import EvalSettings, check_tasks, evaluate, markdown_table, plot_records, sweep_methods
from ..eval.tasks import CodeNLLSettings, FidelitySettings, HumanEvalSettings, NLLSettings
from ..loading import load
from .common import add_distributed_args, add_weights_arg, comma_list, mesh_from_args, write_outputs


def register(sub) -> None:
    p = sub.add_parser("eval", help="evaluate pruning methods on real data (NLL, fidelity, HumanEval)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"source (default {DEFAULT_MODEL}); digits-vlm: the small VLM trained here (task digits_vqa)")
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: bfloat16 on GPU/TPU, float32 on CPU)")
    add_weights_arg(p)
    p.add_argument("--scan-layers", action="store_true", help="run the layers under lax.scan: faster compiles, slower CPU decode (docs/performance.md)")
    p.add_argument("--methods", type=comma_list(str), default=["dense", "static", "pop", "dynamic"])
    p.add_argument("--ratios", type=comma_list(float), default=[0.2, 0.4])
    p.add_argument("--gamma", type=float, default=0.1, help="POP's candidate band (default 0.1)")
    p.add_argument("--aggregate", default="per_sequence", help="per_sequence (default) or shared")
    p.add_argument("--tasks", type=comma_list(str), default=["nll", "fidelity", "humaneval"])
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
    add_distributed_args(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    check_tasks(args.tasks)  # validate before the (slow) load
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
    if args.model == "digits-vlm":  # the small VLM trained here (cached), for the digits_vqa task
        model = digits_vlm()
    else:
        model = load(args.model, dtype=args.dtype, scan_layers=args.scan_layers, weights=args.weights, mesh=mesh_from_args(args))
    records = evaluate(model, methods, args.tasks, text, settings)
    source = args.text_file or f"Shakespeare, {args.play}"
    write_outputs(args, records, markdown_table(records), plot_records, "popjax evaluation", f"Model `{args.model}`, NLL text: {source}.")
