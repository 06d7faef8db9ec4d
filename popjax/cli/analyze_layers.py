"""``popjax analyze-layers``: prefill vs decode importance of every layer (virtual gates,
docs/methods.md §9; the analysis: `popjax.analysis.layer_importance`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..analysis.layer_importance import (
    DEFAULT_RESPONSE_TOKENS, DEFAULT_SAMPLES, analyze_layers, check_counts, format_table, least_important_prefill_layers,
    plot, qualitative_finding,
)
from ..convert.default_model import DEFAULT_MODEL
from ..loading import load
from .common import add_weights_arg


def register(sub) -> None:
    p = sub.add_parser("analyze-layers", help="prefill vs decode layer importance (virtual gates, docs/methods.md §9)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"source (default {DEFAULT_MODEL})")
    add_weights_arg(p)
    p.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help=f"calibration prompts (default {DEFAULT_SAMPLES})")
    p.add_argument("--response-tokens", type=int, default=DEFAULT_RESPONSE_TOKENS, help="sampled response length at most")
    p.add_argument("--batch-size", type=int, default=4, help="samples per forward-backward")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--boundary", action="store_true", help="gate the last prompt token as decode (as PrefillOnly runs it)")
    p.add_argument("--k", type=int, default=None, help="how many least important prefill layers to list (default ⌊L/3⌋)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="write the plot (PNG) here")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    check_counts(samples=args.samples, response_tokens=args.response_tokens, batch_size=args.batch_size)
    model = load(args.model, weights=args.weights)  # after the checks: loading takes a while
    result = analyze_layers(
        model, args.samples, args.response_tokens, args.seed, batch_size=args.batch_size, boundary=args.boundary
    )
    finding = qualitative_finding(result)
    k = args.k if args.k is not None else result.n_layers // 3
    least = least_important_prefill_layers(result, k)
    print(f"{args.model}: {result.n_samples} samples {result.sources}, responses of ≤ {result.response_tokens} "
          f"sampled tokens (mean {result.mean_response_tokens:.1f}), prompts of {result.mean_prompt_tokens:.1f} tokens")
    print(format_table(result))
    print(finding["statement"])
    print(f"the {k} least important prefill layers: {least}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        record = {"model": args.model, **result.to_dict(), "finding": finding, "k": k, "least_important_prefill_layers": least}
        Path(args.json).write_text(json.dumps(record, indent=1))
    if args.plot:
        plot(result, args.plot, f"{args.model}: gate importance{', boundary' * args.boundary}, {result.n_samples} samples")
