"""``popjax convert``: a HF directory or GGUF file into a popjax checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..convert.default_model import DEFAULT_MODEL
from ..loading import convert_source
from .common import add_weights_arg


def register(sub) -> None:
    conv = sub.add_parser("convert", help="convert a HF directory or GGUF file into a popjax checkpoint")
    conv.add_argument("source", help=f"HF checkpoint directory, .gguf file or {DEFAULT_MODEL}")
    conv.add_argument("destination", help="new directory to write")
    conv.add_argument("--dtype", default="float32")
    add_weights_arg(conv, default="float")
    conv.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    destination = convert_source(args.source, Path(args.destination), dtype=args.dtype, weights=args.weights)
    print(f"converted {args.source} -> {destination}")
