"""``popjax batch-study``: NLL and actual FFN density of pruning methods at several batch sizes
(the study: `popjax.eval.batch_study`)."""

from __future__ import annotations

import argparse

from ..convert.default_model import DEFAULT_MODEL
from ..data import HELD_OUT_PLAY, load_play, load_text_file
from ..eval.batch_study import DENSITY_SOURCES, STUDY_METHODS, batch_study, check_batches, markdown_table, plot_study, study_methods
from ..loading import load
from .common import add_weights_arg, write_outputs


def register(sub) -> None:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p = sub.add_parser("batch-study", help="NLL and actual FFN density of pruning methods at several batch sizes")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: bfloat16 on GPU/TPU, float32 on CPU)")
    add_weights_arg(p)
    p.add_argument("--methods", type=lambda s: [x for x in s.split(",") if x], default=list(STUDY_METHODS),
                   help=f"study names {list(STUDY_METHODS)} or method specs (name:key=value)")
    p.add_argument("--ratio", type=float, default=0.4, help="global pruning ratio of every method (docs/methods.md §1)")
    p.add_argument("--batch-sizes", type=ints, default=[1, 4, 8])
    p.add_argument("--windows", type=int, default=8, help="text windows; a multiple of every batch size")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--density-from", default="teacher", choices=DENSITY_SOURCES)
    p.add_argument("--play", default=HELD_OUT_PLAY, help="Shakespeare play (see popjax.data)")
    p.add_argument("--text-file", default=None, help="use this UTF-8 text instead of a play")
    p.add_argument("--json", default=None, help="write the records here")
    p.add_argument("--out", default=None, help="directory for report.md and the plots")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    methods = study_methods(args.methods, args.ratio)  # validate before the (slow) load
    check_batches(args.windows, args.batch_sizes)
    text = load_text_file(args.text_file) if args.text_file else load_play(args.play)
    model = load(args.model, dtype=args.dtype, weights=args.weights)
    records = batch_study(model, methods, text, args.batch_sizes, args.windows, args.prompt_tokens, args.decode_tokens,
                          args.density_from)
    source = args.text_file or f"Shakespeare, {args.play}"
    write_outputs(args, records, markdown_table(records), plot_study, "popjax batch study",
                  f"Model `{args.model}`, text: {source}, global ratio {args.ratio}.")
