"""``popjax kv-drift``: cosine drift of the skipped layers' K/V from the full model, before and
after KV calibration (the report: `popjax.eval.kv_drift`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..eval.kv_drift import format_drift, kv_drift, plot_drift, prefill_nll
from ..loading import load
from ..methods.prefill_only.calibrate import calibrate_kv
from ..methods.prefill_only.kv_calibration import METHODS
from .common import add_kv_calibration_args, add_weights_arg, kv_calibration_options, parse_skip


def register(sub) -> None:
    p = sub.add_parser("kv-drift", help="cosine drift of skipped layers' K/V vs the full model, before/after calibration")
    add_kv_calibration_args(p, (*METHODS, "none"))
    add_weights_arg(p)
    p.add_argument("--skip", type=parse_skip, action="append", default=None, help="a skip set (repeatable; default the last third and 0.5)")
    p.add_argument("--windows", type=int, default=8, help="dev-play windows for the drift (default 8)")
    p.add_argument("--window", type=int, default=256, help="tokens per window; the first half is the prompt")
    p.add_argument("--nll-windows", type=int, default=0, help="also measure online NLL on the held-out play with this many windows")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--plot", default=None, help="write the plot (PNG) here")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    model = load(args.model, weights=args.weights)
    skips = args.skip or [None, 0.5]  # None: PrefillOnly's default, the last ⌊L/3⌋ layers
    reports, nll = [], {}
    for skip in skips:
        cal = None if args.method == "none" else calibrate_kv(model, skip, **kv_calibration_options(args))
        report = kv_drift(model, skip, calibration=cal, windows=args.windows, window=args.window)
        report["skip_arg"] = skip
        if cal is not None:
            report["fit"] = cal.fit
        reports.append(report)
        print(f"\nskip={'last third' if skip is None else skip}: {len(report['skip'])} layers, {report['tokens']} prompt / {report['later_tokens']} later tokens")
        print(format_drift(report))
        if args.nll_windows:
            out = nll[str(skip)] = prefill_nll(model, skip, cal, args.nll_windows, nll.get("dense"))
            print("online NLL (held-out play, %d windows): %s" % (args.nll_windows, ", ".join(f"{k} {v:.4f}" for k, v in out.items())))
            nll.setdefault("dense", nll[str(skip)]["dense"])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"model": args.model, "calibration": kv_calibration_options(args),
                                               "drift": reports, "nll": nll}, indent=1))
    if args.plot:
        plot_drift(reports, args.plot, f"{args.model}: prefill-only KV drift ({args.method})")
