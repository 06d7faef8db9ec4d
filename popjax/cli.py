"""The ``popjax`` command: generate, convert, bench, eval."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from .convert.default_model import DEFAULT_MODEL


def _enable_compilation_cache() -> None:
    """JAX's persistent compilation cache: a second CLI run skips most XLA compile time."""
    import jax

    from .convert.store import cache_root

    jax.config.update("jax_compilation_cache_dir", str(cache_root() / "jax"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def parse_skip(text: str):
    """--skip: "10" (last 10 layers), "0.33" (a fraction of the layers) or "3,7,12" (a list)."""
    try:
        if "," in text:
            return [int(x) for x in text.split(",") if x]
        return float(text) if "." in text else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--skip {text!r} is not a layer count, a fraction or a comma-separated layer list") from None


def add_method_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--method", default="dense",
                        help="a method name (popjax.METHODS), or prefill-only+NAME for both (default dense)")
    parser.add_argument("--ratio", type=float, default=None, help="global pruning ratio in [0, 1)")
    parser.add_argument("--gamma", type=float, default=None, help="POP candidate band width (default 0.1)")
    parser.add_argument("--aggregate", default=None, help="shared (default) or per_sequence")
    parser.add_argument("--skip", type=parse_skip, default=None, help="prefill-only: layers skipped in prefill (default last third)")
    parser.add_argument("--kv", default=None, help="prefill-only: independent (default), calibrated or none")
    parser.add_argument("--no-boundary", dest="boundary", action="store_false", default=None,
                        help="prefill-only: prefill the last prompt token too")


def method_from_args(args: argparse.Namespace):
    from .methods import make_method

    return make_method(
        args.method, ratio=args.ratio, gamma=args.gamma, aggregate=args.aggregate,
        skip=args.skip, kv=args.kv, boundary=args.boundary,
    )


def _cmd_generate(args: argparse.Namespace) -> None:
    import popjax

    method = method_from_args(args)  # validate before the (slow) load
    model = popjax.load(args.model, dtype=args.dtype, scan_layers=args.scan_layers)
    if getattr(method, "kv", None) == "calibrated":  # fitted once per model and skip set, cached
        from .kv_calibration import calibrate_kv, with_prefill_kv

        model = with_prefill_kv(model, calibrate_kv(model, method.skip))
    options = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        method=method,
        chat=False if args.no_chat else None,
    )
    if len(args.prompts) == 1:  # one prompt: print its tokens as they come
        for piece in popjax.stream(model, args.prompts[0], **options):
            print(piece.text, end="", flush=True)
        print()
        return
    out = popjax.generate(model, args.prompts, **options)
    for prompt, text in zip(args.prompts, out.texts):
        print(f"### {prompt}")
        print(text)


def _cmd_convert(args: argparse.Namespace) -> None:
    from .loading import convert_source

    destination = convert_source(args.source, Path(args.destination), dtype=args.dtype)
    print(f"converted {args.source} -> {destination}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="popjax", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text with an optional pruning method")
    gen.add_argument("prompts", nargs="+", help="one or more prompts (batched together)")
    gen.add_argument("--model", default=DEFAULT_MODEL, help=f"source (default {DEFAULT_MODEL})")
    gen.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: bfloat16 on GPU/TPU, float32 on CPU)")
    gen.add_argument("--scan-layers", action="store_true", help="run the layers under lax.scan: faster compiles, slower CPU decode (docs/performance.md)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    add_method_args(gen)
    gen.set_defaults(run=_cmd_generate)

    conv = sub.add_parser("convert", help="convert a HF directory or GGUF file into a popjax checkpoint")
    conv.add_argument("source", help=f"HF checkpoint directory, .gguf file or {DEFAULT_MODEL}")
    conv.add_argument("destination", help="new directory to write")
    conv.add_argument("--dtype", default="float32")
    conv.set_defaults(run=_cmd_convert)

    for register in _extra_commands():
        register(sub)
    return parser


def _extra_commands():
    """Subcommands defined beside their implementation (bench, eval)."""
    from . import bench, kv_drift, layer_importance, memory_plan
    from .eval import batch_study, frontier
    from .eval import cli as eval_cli
    from .eval import lm_eval_cli

    return [bench.register_cli, eval_cli.register_cli, lm_eval_cli.register_cli, layer_importance.register_cli, kv_drift.register_cli,
            batch_study.register_cli, frontier.register_cli, memory_plan.register_cli]


def main(argv: list[str] | None = None) -> int:
    # transformers' advice that PyTorch is absent is noise here: popjax needs only its tokenizers
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    _enable_compilation_cache()
    from .convert.readers import CheckpointError
    from .methods import MethodError
    from .models.config import ConfigError

    try:
        args.run(args)
    except (CheckpointError, ConfigError, MethodError, FileExistsError, FileNotFoundError, ValueError) as err:
        print(f"popjax: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
