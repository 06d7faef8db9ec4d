"""``popjax bench``: decode speed of the methods against the memory roofline and transformers
(the measurements: `popjax.bench.runner`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..bench.runner import BenchSettings, format_suites, format_table, run_bench
from .. import distributed
from ..analysis.memory_plan import published_configs
from ..files import write_json_atomic
from .common import add_distributed_args, add_model_arg, mesh_from_args

DEFAULTS = BenchSettings()


def register(sub) -> None:
    p = sub.add_parser("bench", help="decode speed of the methods vs the roofline and transformers")
    add_model_arg(p)
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: bfloat16 on GPU/TPU, float32 on CPU)")
    p.add_argument("--weights", type=lambda s: [w for w in s.split(",") if w], default=list(DEFAULTS.weights),
                   help="weight formats to measure, each its own model in the one run: float, int8 or float,int8")
    p.add_argument("--scan-layers", action="store_true", help="run the layers under lax.scan (docs/performance.md)")
    p.add_argument("--methods", type=lambda s: s.split(","), default=list(DEFAULTS.methods))
    p.add_argument("--ratios", type=lambda s: [float(x) for x in s.split(",")], default=list(DEFAULTS.ratios))
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=list(DEFAULTS.batches))
    p.add_argument("--max-new-tokens", type=int, default=DEFAULTS.max_new_tokens)
    p.add_argument("--repeats", type=int, default=DEFAULTS.repeats)
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    p.add_argument("--suites", type=lambda s: s.split(","), default=list(DEFAULTS.suites),
                   help="any of decode (methods × batches), lengths (TTFT by prompt length), capacity, stream, memory")
    p.add_argument("--prompt-lengths", type=lambda s: [int(x) for x in s.split(",")], default=list(DEFAULTS.prompt_lengths))
    p.add_argument("--length-methods", type=lambda s: s.split(","), default=list(DEFAULTS.length_methods),
                   help="methods of the lengths suite besides dense (first --ratios value)")
    p.add_argument("--length-new-tokens", type=int, default=DEFAULTS.length_new_tokens)
    p.add_argument("--synthetic", default=None, metavar="MODEL",
                   help=f"random weights of a shipped config ({', '.join(published_configs())}) or a config.json, drawn on the "
                        "device in --dtype and each --weights format: no checkpoint, download or tokenizer (random token ids; "
                        "offline methods get placeholder fits, noted in the JSON)")
    p.add_argument("--layers", type=int, default=None, help="with --synthetic: the model's first N layers (default all)")
    p.add_argument("--json", default=None, help="write the results here")
    add_distributed_args(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    settings = BenchSettings(  # validates every value before the (slow) load
        model=args.model, dtype=args.dtype, weights=args.weights, scan_layers=args.scan_layers, methods=args.methods, ratios=args.ratios,
        batches=args.batches, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
        transformers=not args.no_transformers, suites=args.suites, prompt_lengths=args.prompt_lengths,
        length_methods=args.length_methods, length_new_tokens=args.length_new_tokens, mesh=mesh_from_args(args),
        synthetic=args.synthetic, layers=args.layers,
    )
    result = run_bench(settings)
    if not distributed.is_main():  # every process measured the same run; process 0 reports it
        return
    if result["records"]:
        print(format_table(result))
    print(format_suites(result["suites"]))
    if args.json:
        write_json_atomic(Path(args.json), result)
