"""``popjax digits-vqa``: the digits VLM trained here (cached), its answer accuracy and answer NLL
under each pruning method, and the partition overlaps of POP's scoring-token choices
(`popjax.eval.digits_vqa`; docs/vlm.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..eval.digits_vlm import digits_vlm
from ..eval.digits_vqa import digits_vqa, markdown, plot_accuracy
from ..files import write_json_atomic


def register(sub) -> None:
    p = sub.add_parser("digits-vqa", help="train (once, cached) the digits VLM and measure each method's answer accuracy")
    p.add_argument("--ratios", default="0.2,0.4,0.6", help="global pruning ratios (default 0.2,0.4,0.6)")
    p.add_argument("--limit", type=int, default=None, help="use the first N held-out digits (default all 297)")
    p.add_argument("--json", default=None, help="write the results here (JSON)")
    p.add_argument("--out", default=None, help="write the table (table.md) and the plot (accuracy.png) into this directory")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    try:
        ratios = tuple(float(r) for r in args.ratios.split(","))
    except ValueError:
        raise SystemExit(f"popjax digits-vqa: --ratios {args.ratios!r} is not a comma-separated list of numbers") from None
    result = digits_vqa(digits_vlm(), ratios, args.limit)
    result["command"] = "popjax digits-vqa " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                                                        if k in ("ratios", "limit") and v is not None)
    table = markdown(result)
    print(table)
    if args.json:
        write_json_atomic(Path(args.json), result)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "table.md").write_text(table + "\n")
        plot_accuracy(result, out / "accuracy.png")
