"""The ``popjax`` command: generate, convert, bench, eval."""

# One module per command, each with ``register(sub)`` (its argparse subcommand, whose ``run``
# default is the command's body) and ``run(args)``; ``common`` holds the flags several share.
# The commands import the library below them and nothing imports this package.

from __future__ import annotations

import argparse
import logging
import os
import sys

import jax

from ..cache import cache_root
from ..convert.readers import CheckpointError
from ..methods import MethodError
from ..models.config import ConfigError
from . import (
    analyze_layers, batch_study, bench, cache, calibrate_kv, compile, convert, device_check, digits_vqa, eval, frontier, generate, kv_drift,
    lm_eval, plan,
)
from .common import add_method_args, method_from_args, parse_skip, start_distributed

# in the order `popjax --help` lists them
COMMANDS = (generate, convert, bench, eval, lm_eval, analyze_layers, calibrate_kv, kv_drift, batch_study, frontier, plan, compile,
            cache, digits_vqa, device_check)

__all__ = ["COMMANDS", "add_method_args", "build_parser", "main", "method_from_args", "parse_skip"]


def _enable_compilation_cache() -> None:
    """JAX's persistent compilation cache: a second CLI run skips most XLA compile time. A folder
    the user chose (JAX_COMPILATION_CACHE_DIR, or jax.config) is kept; else POPJAX_CACHE/jax.
    Programs that compiled in a second or more are stored, unless the user set the threshold
    (JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS): a `main` called in-process (a notebook, the
    tests) leaves the caller's setting alone."""
    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", str(cache_root() / "jax"))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="popjax", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    parser.set_defaults(argv=None)  # main() records the arguments it parsed (report.md, JSON, plan's re-run)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # transformers' advice that PyTorch is absent is noise here: popjax needs only its tokenizers
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    _enable_compilation_cache()
    try:
        if getattr(args, "multihost_flags", False):  # before anything touches the devices
            start_distributed(args)
        code = args.run(args)
    except (CheckpointError, ConfigError, MethodError, FileExistsError, FileNotFoundError, ValueError) as err:
        print(f"popjax: error: {err}", file=sys.stderr)
        return 2
    except jax.errors.JaxRuntimeError as err:
        if jax.process_count() == 1:
            raise
        # a multi-host run: another process failed or a wait on it timed out; one line, not a stack
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"popjax: error: process {jax.process_index()} of {jax.process_count()}: {first}", file=sys.stderr)
        return 2
    return code or 0
