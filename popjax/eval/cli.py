"""``popjax eval``: the evaluation sweep from the command line, writing JSON, a table, plots and a report."""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
from pathlib import Path

from ..convert.default_model import DEFAULT_MODEL
from .harness import EvalSettings, check_tasks, evaluate, markdown_table, plot_records, sweep_methods
from .tasks import CodeNLLSettings, FidelitySettings, HumanEvalSettings, NLLSettings


def _csv(kind):
    return lambda s: [kind(x) for x in s.split(",") if x]


def register_cli(sub) -> None:
    p = sub.add_parser("eval", help="evaluate pruning methods on real data (NLL, fidelity, HumanEval)")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: bfloat16 on GPU/TPU, float32 on CPU)")
    p.add_argument("--scan-layers", action="store_true", help="run the layers under lax.scan: faster compiles, slower CPU decode (docs/performance.md)")
    p.add_argument("--methods", type=_csv(str), default=["dense", "static", "pop", "dynamic"])
    p.add_argument("--ratios", type=_csv(float), default=[0.2, 0.4])
    p.add_argument("--gamma", type=float, default=0.1, help="POP's candidate band (default 0.1)")
    p.add_argument("--aggregate", default="per_sequence", help="per_sequence (default) or shared")
    p.add_argument("--tasks", type=_csv(str), default=["nll", "fidelity", "humaneval"])
    p.add_argument("--play", default="hamlet", help="Shakespeare play for the NLL task (see popjax.eval.data)")
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
    p.set_defaults(run=_cmd_eval)


def _cmd_eval(args: argparse.Namespace) -> None:
    from ..loading import load
    from .data import load_play, load_text_file

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
    model = load(args.model, dtype=args.dtype, scan_layers=args.scan_layers)
    records = evaluate(model, methods, args.tasks, text, settings)
    source = args.text_file or f"Shakespeare, {args.play}"
    write_outputs(args, records, markdown_table(records), plot_records, "popjax evaluation", f"Model `{args.model}`, NLL text: {source}.")


def write_outputs(args: argparse.Namespace, records: list, table: str, plot, title: str, intro: str) -> None:
    """Prints the table; writes the records as JSON (``--json``) and, with ``--out``, the plots
    and a report.md that names the command which produced them."""
    from ..bench import write_json_atomic

    print(table)
    if args.json:
        write_json_atomic(Path(args.json), {"command": command_line(), "records": records})
    if args.out:
        out = Path(args.out)
        plots = plot(records, out)
        lines = [f"# {title}", "", f"{intro} Generated {datetime.date.today()} by", "", f"```bash\n{command_line()}\n```", "", table, ""]
        lines += [f"![{p.stem}]({p.name})" for p in plots]
        (out / "report.md").write_text("\n".join(lines) + "\n")


def command_line() -> str:
    """The popjax command that is running, shell-quoted (recorded in result JSON)."""
    return "popjax " + " ".join(shlex.quote(a) for a in sys.argv[1:])
