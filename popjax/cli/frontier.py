"""``popjax frontier``: online NLL and KL against FFN weight bytes per decode token, with the
Pareto front (the sweep: `popjax.eval.frontier`)."""

from __future__ import annotations

import argparse

from ..data import DEV_PLAY, load_play, load_text_file
from ..eval.frontier import (
    GAMMAS, FrontierSettings, attach_bench, configurations, default_specs, frontier, mark_fronts, markdown_table, read_bench,
)
from ..eval.frontier_plot import plot_frontier
from ..eval.tasks import NLLSettings
from ..loading import load
from .common import add_distributed_args, add_model_arg, add_weights_arg, comma_list, mesh_from_args, write_outputs


def register(sub) -> None:
    p = sub.add_parser("frontier", help="online NLL and KL against FFN weight bytes per decode token, with the Pareto front")
    add_model_arg(p)
    p.add_argument("--dtype", default="float32", help="float32 (CPU default) or bfloat16 (GPU/TPU)")
    add_weights_arg(p)
    p.add_argument("--methods", type=comma_list(str), default=None,
                   help=f"method specs (name or name:key=value:...); default: dense, γ in {GAMMAS} for every method with a band, "
                        "every other ratio method")
    p.add_argument("--ratios", type=comma_list(float), default=[0.2, 0.4], help="global pruning ratios (docs/methods.md §1)")
    p.add_argument("--play", default=DEV_PLAY, help="Shakespeare play for the text (see popjax.data)")
    p.add_argument("--text-file", default=None, help="use this UTF-8 text instead of a play")
    p.add_argument("--nll-prompt-tokens", type=int, default=256)
    p.add_argument("--nll-decode-tokens", type=int, default=128)
    p.add_argument("--nll-windows", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8, help="windows per teacher-forced call")
    p.add_argument("--max-bytes-fraction", type=float, default=None, help="keep configurations reading at most this fraction of dense FFN bytes")
    p.add_argument("--no-xla", dest="xla", action="store_false", help="skip compiling a decode step per configuration for XLA's bytes")
    p.add_argument("--bench", default=None, help="a `popjax bench --json` file: measured decode tok/s for the NLL-vs-speed plot")
    p.add_argument("--bench-batch", type=int, default=1, help="the bench batch size whose speeds are used (default 1)")
    p.add_argument("--json", default=None, help="write the records here")
    p.add_argument("--out", default=None, help="directory for report.md and the plots")
    add_distributed_args(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    skipped = {}
    if args.methods is None:
        args.methods, skipped = default_specs()
    configurations(args.methods, args.ratios)  # validate before the (slow) load
    bench = read_bench(args.bench) if args.bench else None
    text = load_text_file(args.text_file) if args.text_file else load_play(args.play)
    settings = FrontierSettings(NLLSettings(args.nll_prompt_tokens, args.nll_decode_tokens, args.nll_windows, args.batch_size),
                                args.xla, args.max_bytes_fraction)
    model = load(args.model, dtype=args.dtype, weights=args.weights, mesh=mesh_from_args(args))
    records = frontier(model, args.methods, args.ratios, text, settings)
    notes = []
    if bench is not None:
        matched = attach_bench(records, bench, args.bench_batch)
        mark_fronts(records)
        notes.append(f"Decode speed: `{args.bench}` at batch {args.bench_batch} ({matched} of {len(records)} configurations measured).")
    if skipped:
        notes.append("Not in the default sweep: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()) + ".")
    s = settings.nll
    source = args.text_file or f"Shakespeare, {args.play}"
    intro = (f"Model `{args.model}` ({args.dtype}), text: {source}, {s.windows} windows of {s.prompt_tokens} prompt + "
             f"{s.decode_tokens} teacher-forced decode tokens. " + " ".join(notes))
    write_outputs(args, records, markdown_table(records), plot_frontier, "popjax frontier: quality per FFN byte", intro)
