"""``popjax compile``: the engine's programs compiled by the TPU compiler for a TPU slice, on any
machine (libtpu, no TPU): per-device memory against the chip's HBM, compile time, decode-step
FLOPs and bytes, and an estimate of decode tokens/s, for several methods and ratios against dense
(`popjax.analysis.tpu_compile`)."""

from __future__ import annotations

import argparse

from ..analysis.memory_plan import parse_mesh, published_configs
from ..analysis.topologies import EXAMPLES
from ..analysis.tpu_compile import check_fit, tpu_compile, write_report
from ..analysis.tpu_report import format_report, plot_report
from ..kernels.int8 import WEIGHT_FORMATS
from .common import command_line, comma_list


def register(sub) -> None:
    p = sub.add_parser("compile", help="compile the engine's programs for a TPU slice (libtpu, no TPU needed): "
                                       "memory vs HBM, bytes per decode step, estimated tokens/s")
    p.add_argument("--topology", default="v5e:2x4", help=f"a TPU slice libtpu resolves, e.g. {', '.join(EXAMPLES)}")
    p.add_argument("--model", required=True,
                   help=f"a shipped config {published_configs()}, a config.json, a Hugging Face directory holding one, or a .gguf")
    p.add_argument("--method", type=comma_list(str), default=["dense"],
                   help="method specs, comma-separated (e.g. dense,pop,static or pop:gamma=0.2); dense is always compiled too")
    p.add_argument("--ratio", type=comma_list(float), default=[0.4], help="global pruning ratios, comma-separated (e.g. 0.2,0.4)")
    p.add_argument("--weights", choices=WEIGHT_FORMATS, default="float", help="linear-layer weights: float (the dtype) or int8")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1024, help="KV-cache capacity: prompt + generated tokens")
    p.add_argument("--prompt", type=int, default=None, help="prefill length (default context/2, at least context - 4096), padded to a prompt bucket")
    p.add_argument("--mesh", default=None, help="DATAxMODEL over every device of the topology (default 1xDEVICES)")
    p.add_argument("--scan-layers", action="store_true", help="the scanned model (one layer's code): deep models compile faster")
    p.add_argument("--no-decode-loop", dest="decode_loop", action="store_false",
                   help="compile the prefill and one decode step only (not the decode loop)")
    p.add_argument("--require-fit", action="store_true", help="exit with an error when a program does not fit the chip's HBM")
    p.add_argument("--jobs", type=int, default=1, help="methods compiled at once, each in its own process")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--plot", default=None, help="write estimated tokens/s against ratio here (PNG; needs matplotlib)")
    p.add_argument("--hlo-dir", default=None, help="write the optimized HLO (XLA:TPU) of each method's programs here: <method>-<ratio>.{start,step,loop}.hlo.txt")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int | None:
    mesh = parse_mesh(args.mesh) if args.mesh else None
    report = tpu_compile(args.model, args.topology, args.method, args.ratio, weights=args.weights, dtype=args.dtype,
                         batch=args.batch, context=args.context, prompt=args.prompt, mesh=mesh,
                         scan_layers=args.scan_layers, decode_loop=args.decode_loop, hlo_dir=args.hlo_dir,
                         jobs=args.jobs)
    report["command"] = command_line(args.argv)
    print(format_report(report))
    if args.json:
        write_report(report, args.json)
    if args.plot:
        plot_report(report, args.plot)
    if args.require_fit:
        check_fit(report)  # after the table and the files: they show what does not fit
    return None
