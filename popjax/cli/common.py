"""What several commands share: the method flags, ``--skip``, the KV-calibration flags, list
arguments, and the JSON / report outputs that name the command which made them."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from .. import distributed
from ..analysis.memory_plan import parse_mesh
from ..convert.default_model import DEFAULT_MODEL
from ..convert.sources import source_names
from ..files import write_json_atomic
from ..methods import METHODS, Method, parse_method_spec
from ..methods.prefill_only.kv_calibration import DEFAULT_RIDGE
from ..methods.prefill_only.kv_training import DEFAULT_LR, DEFAULT_STEPS, DEFAULT_WEIGHT_DECAY
from ..kernels.int8 import WEIGHT_FORMATS
from ..sharding import make_mesh


def parse_skip(text: str):
    """--skip: "10" (last 10 layers), "0.33" (a fraction of the layers) or "3,7,12" (a list)."""
    try:
        if "," in text:
            return [int(x) for x in text.split(",") if x]
        return float(text) if "." in text else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--skip {text!r} is not a layer count, a fraction or a comma-separated layer list") from None


def add_model_arg(parser: argparse.ArgumentParser) -> None:
    """``--model SOURCE``: any source `popjax.load` takes (convert/sources.py), the same in every command."""
    parser.add_argument("--model", default=DEFAULT_MODEL, metavar="SOURCE",
                        help=f"a named source ({', '.join(source_names())}; default {DEFAULT_MODEL}), a Hugging Face "
                             "repo id, an HF checkpoint directory, a .gguf file or a converted directory")


def add_weights_arg(parser: argparse.ArgumentParser, default: str | None = None) -> None:
    """``--weights float|int8``: the linear layers' weight format (`popjax.load`'s ``weights``)."""
    parser.add_argument("--weights", choices=WEIGHT_FORMATS, default=default,
                        help="linear-layer weights: float (the dtype) or int8 (per-output-channel scales; "
                             "default: float, or a converted directory's own format)")


def add_method_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--method", default="dense",
                        help="a method spec: a name (popjax.METHODS) or name:key=value:..., prefill-only+NAME for "
                             "both (default dense); the flags below are sugar for the spec's keys")
    parser.add_argument("--ratio", type=float, default=None, help="global pruning ratio in [0, 1)")
    parser.add_argument("--gamma", type=float, default=None, help="POP candidate band width (default 0.1)")
    parser.add_argument("--aggregate", default=None,
                        help=f"how a batch's rows share a selection (default: the method's own: {_aggregate_defaults()})")
    parser.add_argument("--skip", type=parse_skip, default=None, help="prefill-only: layers skipped in prefill (default last third)")
    parser.add_argument("--kv", default=None, help="prefill-only: independent (default), calibrated or none")
    parser.add_argument("--no-boundary", dest="boundary", action="store_false", default=None,
                        help="prefill-only: prefill the last prompt token too")


def _aggregate_defaults() -> str:
    """Each registered method's default ``aggregate``, grouped by value, from the method classes
    themselves (so the help cannot drift): "per_sequence for dynamic, pop, ...; max for cats, ..."."""
    methods: dict[str, list[str]] = {}
    for name, cls in sorted(METHODS.items()):
        field = next((f for f in dataclasses.fields(cls) if f.name == "aggregate"), None)
        if field is not None:
            methods.setdefault(field.default, []).append(name)
    return "; ".join(f"{value} for {', '.join(names)}" for value, names in methods.items())


def method_from_args(args: argparse.Namespace) -> Method:
    """The ``--method`` spec with the method flags as its defaults (a key the spec names wins):
    ``--method pop --ratio 0.2 --gamma 0.1`` is ``pop:ratio=0.2:gamma=0.1``."""
    flags = dict(ratio=args.ratio, gamma=args.gamma, aggregate=args.aggregate, skip=args.skip, kv=args.kv,
                 boundary=args.boundary)
    return parse_method_spec(args.method, **flags)


def add_kv_calibration_args(parser: argparse.ArgumentParser, methods: tuple[str, ...]) -> None:
    """The flags of ``calibrate-kv`` and ``kv-drift``: the model and how the K/V projections are fitted."""
    add_model_arg(parser)
    parser.add_argument("--method", default="closed_form", choices=methods, help="calibration method (default closed_form)")
    parser.add_argument("--ridge", type=float, default=DEFAULT_RIDGE, help="closed-form ridge λ ≥ 0, relative to tr(ZᵀZ)/d")
    parser.add_argument("--tokens", type=int, default=None, help="calibration tokens (default 16384; optax 4096)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="optax: AdamW steps")
    parser.add_argument("--learning-rate", type=float, default=DEFAULT_LR, help="optax: learning rate")
    parser.add_argument("--weight-decay", type=float, default=DEFAULT_WEIGHT_DECAY, help="optax: decay toward the original W")


def kv_calibration_options(args: argparse.Namespace) -> dict[str, Any]:
    """`calibrate_kv`'s keyword arguments from the flags of `add_kv_calibration_args`."""
    options = {"ridge": args.ridge, "method": args.method, "tokens": args.tokens}
    if args.method == "optax":
        options.update(steps=args.steps, learning_rate=args.learning_rate, weight_decay=args.weight_decay)
    return options


def comma_list(kind):
    """An argparse ``type``: "a,b,,c" -> [kind(a), kind(b), kind(c)] (empty items dropped)."""
    return lambda s: [kind(x) for x in s.split(",") if x]


def command_line(argv: list[str] | None = None) -> str:
    """The popjax command that is running, shell-quoted (recorded in result JSON); ``argv``
    defaults to the process's arguments."""
    return "popjax " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))


def add_distributed_args(parser: argparse.ArgumentParser) -> None:
    """The multi-host flags (docs/scale_out.md, "Multi-host"): the same command runs on every
    process with its own ``--process-id``; ``--mesh`` spans the devices of all of them."""
    group = parser.add_argument_group("multi-host (docs/scale_out.md)")
    group.add_argument("--coordinator", default=None,
                       help=f"process 0's HOST:PORT, the same on every process (env {distributed.ENV_COORDINATOR}); "
                            "'auto': JAX's cluster auto-detection (TPU pod slices, SLURM)")
    group.add_argument("--num-processes", type=int, default=None, help=f"processes in the run (env {distributed.ENV_NUM_PROCESSES})")
    group.add_argument("--process-id", type=int, default=None, help=f"this process, 0..N-1 (env {distributed.ENV_PROCESS_ID})")
    group.add_argument("--init-timeout", type=float, default=distributed.DEFAULT_TIMEOUT_S,
                       help=f"seconds to wait for the coordinator and the other processes (default {distributed.DEFAULT_TIMEOUT_S})")
    group.add_argument("--mesh", default=None,
                       help="DATAxMODEL devices over all processes, e.g. 2x4 (default: one device; with several "
                            "processes: PROCESSESxDEVICES_PER_PROCESS)")
    parser.set_defaults(multihost_flags=True)


def start_distributed(args: argparse.Namespace) -> None:
    """Joins the other processes when a multi-host flag or its environment variable is set
    (`popjax.distributed.initialize`); a plain single-process run calls nothing."""
    env = (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID)
    given = (args.coordinator, args.num_processes, args.process_id)
    if all(v is None for v in given) and not any(os.environ.get(name) for name in env):
        return
    coordinator = None if args.coordinator == "auto" else args.coordinator
    if args.coordinator == "auto" and (args.num_processes is not None or args.process_id is not None):
        raise ValueError("--coordinator auto detects the processes itself; drop --num-processes and --process-id")
    distributed.initialize(coordinator, args.num_processes, args.process_id, args.init_timeout)


def mesh_from_args(args: argparse.Namespace):
    """``--mesh DATAxMODEL`` -> a mesh over every process's devices (checked to cover them all on
    several processes); None without ``--mesh`` on one process (the single-device default)."""
    shape = parse_mesh(args.mesh) if args.mesh else distributed.default_mesh_shape()
    if shape is None:
        return None
    distributed.check_global_mesh(shape)
    return make_mesh(shape)


def write_outputs(args: argparse.Namespace, records: list, table: str, plot, title: str, intro: str) -> None:
    """Prints the table; writes the records as JSON (``--json``) and, with ``--out``, the plots
    and a report.md that names the command which produced them. Process 0 only (every process
    of a multi-host run holds the same records)."""
    if not distributed.is_main():
        return
    print(table)
    if args.json:
        write_json_atomic(Path(args.json), {"command": command_line(args.argv), "records": records})
    if args.out:
        out = Path(args.out)
        plots = plot(records, out)
        lines = [f"# {title}", "", f"{intro} Generated {datetime.date.today()} by", "", f"```bash\n{command_line(args.argv)}\n```", "", table, ""]
        lines += [f"![{p.stem}]({p.name})" for p in plots]
        (out / "report.md").write_text("\n".join(lines) + "\n")
