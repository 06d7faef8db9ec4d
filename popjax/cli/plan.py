"""``popjax plan``: per-device memory and decode cost of a model, mesh, batch, context and method,
from XLA, without weights (the plan: `popjax.analysis.memory_plan`). An offline method (TEAL, ...)
is planned with shape-fitted placeholders (`popjax.analysis.shape_fitted`), as ``popjax compile``
plans it: a plan needs shapes, not a calibration.

On CPU a mesh larger than the visible devices needs fake devices, and XLA reads
``--xla_force_host_platform_device_count`` only at start-up: the command then re-runs itself
(``python -m popjax.cli`` with the same arguments) in a child process with the flag set."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import jax

from ..analysis.memory_plan import DEVICES, GiB, check_hosts, fits, format_plan, memory_plan, parse_mesh, published_configs, resolve_config
from ..files import write_json_atomic
from ..methods import MethodError
from ..kernels.int8 import WEIGHT_FORMATS
from ..models.scan import check_scannable
from ..sharding import make_mesh
from .common import add_method_args, method_from_args

POP_WEIGHTS = ("compact", "gather")  # POP's own ``weights`` option (methods/pop/core.py)
CHILD = "POPJAX_PLAN_CHILD"  # set in the re-run child: it must not re-run again


def register(sub) -> None:
    p = sub.add_parser("plan", help="per-device memory and decode cost of a model/mesh/method, from XLA (no weights)")
    p.add_argument("--model", required=True, help=f"a published config {published_configs()} or a config.json path")
    p.add_argument("--mesh", default="1x1", help="DATAxMODEL devices, e.g. 1x8 (fake CPU devices are made as needed)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=4096, help="KV-cache capacity: prompt + generated tokens")
    p.add_argument("--prompt", type=int, default=None, help="prefill length (default context/2, at least context - 4096)")
    p.add_argument("--dtype", default="bfloat16")
    add_method_args(p)
    p.add_argument("--partition", default=None, help="POP: global (default) or per_shard (compact blocks stay on their shard)")
    p.add_argument("--weights", default=None, choices=(*WEIGHT_FORMATS, *POP_WEIGHTS),
                   help="float or int8: the linear layers' weight format (popjax.load); compact or gather: POP's "
                        "option (compact, the default: a copy of the partition's rows in the state; gather: ids only)")
    p.add_argument("--scan-layers", action="store_true",
                   help="plan the scanned model (layers stacked, one lax.scan step): deep models compile in minutes")
    p.add_argument("--hosts", type=int, default=1,
                   help="processes (hosts) the mesh's devices are split over: adds per-host chips and host RAM while loading")
    p.add_argument("--json", default=None, help="write the plan here")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int | None:
    data, model_axis = parse_mesh(args.mesh)
    check_hosts(args.hosts, data * model_axis)
    cfg = resolve_config(args.model)  # validate before any device work
    if args.weights in WEIGHT_FORMATS:  # the model's weight format; POP's compact/gather stays a method option
        cfg, args.weights = dataclasses.replace(cfg, weights=args.weights), None
    if args.scan_layers:
        check_scannable(cfg)
    method = method_from_args(args)
    for option in ("partition", "weights"):
        if getattr(args, option) is None:
            continue
        if option not in {f.name for f in dataclasses.fields(method)}:
            raise MethodError(f"--{option} applies to POP only, not to {args.method!r}")
        method = dataclasses.replace(method, **{option: getattr(args, option)})
        method.__post_init__()  # validates the value
    if jax.device_count() < data * model_axis:
        if os.environ.get(CHILD) or jax.default_backend() != "cpu":
            raise ValueError(f"mesh {args.mesh} needs {data * model_axis} devices; {jax.device_count()} are available")
        return _rerun_with_fake_devices(args, data * model_axis)
    mesh = make_mesh((data, model_axis))
    plan = memory_plan(cfg, mesh, method, args.batch, args.context, args.prompt, args.dtype, args.scan_layers, args.hosts)
    plan["fits"] = {name: fits(plan, size) for name, size in DEVICES.items()}
    print(format_plan(plan))
    print("fits: " + ", ".join(f"{name} ({size // GiB} GiB): {'yes' if ok else 'no'}"
                               for (name, size), ok in zip(DEVICES.items(), plan["fits"].values())))
    if args.json:
        write_json_atomic(Path(args.json), plan)
    return None


def _rerun_with_fake_devices(args: argparse.Namespace, devices: int) -> int:
    """Runs this same command in a child process that has ``devices`` fake CPU devices -> its exit status."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    env = dict(os.environ, **{CHILD: "1"}, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    argv = sys.argv[1:] if args.argv is None else args.argv
    return subprocess.call([sys.executable, "-m", "popjax.cli", *argv], env=env)
