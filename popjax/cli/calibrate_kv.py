"""``popjax calibrate-kv``: fit prefill-only K/V projections for the skipped layers (cached;
the fit: `popjax.methods.prefill_only.calibrate`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..loading import load
from ..methods.prefill_only.calibrate import calibrate_kv
from ..methods.prefill_only.kv_calibration import METHODS
from ..methods.prefill_only.kv_store import save_kv_calibration
from .common import add_kv_calibration_args, add_weights_arg, kv_calibration_options, parse_skip


def register(sub) -> None:
    p = sub.add_parser("calibrate-kv", help="fit prefill-only KV projections for skipped layers (cached)")
    add_kv_calibration_args(p, METHODS)
    add_weights_arg(p)
    p.add_argument("--skip", type=parse_skip, default=None, help="skipped layers (default last third)")
    p.add_argument("--save", default=None, help="also save the calibration into this new directory")
    p.add_argument("--json", default=None, help="write what it was fitted for and the fit diagnostics here")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    model = load(args.model, weights=args.weights)
    cal = calibrate_kv(model, args.skip, **kv_calibration_options(args))
    print(f"calibrated layers {list(cal.skip)} ({cal.key['method']}, {cal.fit['tokens']} tokens)")
    if "layers" in cal.fit:
        print("layer  K err before → after   V err before → after  (relative squared error)")
        for l, f in cal.fit["layers"].items():
            print(f"{l:>5}  {f['k_err_before']:.4f} → {f['k_err_after']:.4f}        {f['v_err_before']:.4f} → {f['v_err_after']:.4f}")
    else:
        print(f"later-query attention loss {cal.fit['loss_before']:.4f} → {cal.fit['loss_after']:.4f}")
    if args.save:
        print(f"saved to {save_kv_calibration(cal, args.save)}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"model": args.model, "skip": list(cal.skip), "key": cal.key, "fit": cal.fit}, indent=1))
