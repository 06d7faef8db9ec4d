"""What XLA:TPU's int8 decode step costs with the int8 weights in the tiling its dots want.

XLA:TPU gives an int8 argument its default tiling T(32,128)(4,1), but its matrix-vector fusions
read int8 weights in T(8,128)(4,1). A layer's weights are staged into VMEM and re-tiled there,
inside their fusion; the embedding table, read whole by the LM head, is re-tiled by a `copy` in
HBM in every step (read and written: 2 × V·d bytes). This script compiles the decode step of
``--methods`` for one chip twice: with the default layouts, and with every int8 weight of ≥ 2
dims declared in T(8,128)(4,1) (a `jax.experimental.layout.Format` on its abstract argument, as
`jax.device_put(x, Format(layout, sharding))` would place it on a TPU). Per method and layout:
XLA:TPU's bytes accessed per step, the analytic ideal, and the entry-level int8 `copy` ops of
the step's HLO with their bytes. JSON to results/tpu/int8_layout.json.

    python benchmarks/int8_tpu_layout.py [--model gemma-3-270m] [--methods static] [--ratio 0.4]
        [--topology v5e:1x1] [--context 1024] [--out results/tpu/int8_layout.json] [--hlo-dir DIR]

Compile-only through libtpu (no TPU needed): bytes are the compiler's cost model, not a
measurement (docs/tpu.md, "int8: the LM head is re-tiled in every step").
"""

from __future__ import annotations

import argparse
import math
import re
import tempfile
from importlib.metadata import version
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
from jax.experimental.layout import Format, Layout

from popjax import sharding
from popjax.analysis.tpu_compile import tpu_compile
from popjax.files import write_json_atomic

DOT_TILING = ((8, 128), (4, 1))  # the tiling XLA:TPU's int8 matrix-vector fusions read
ENTRY_COPY = re.compile(r"= s8\[([\d,]+)\]\{[^}]*\} copy\(")


def dot_tiled(params):
    """The abstract params with every int8 leaf of ≥ 2 dims declared row-major in `DOT_TILING`."""
    def one(leaf):
        if leaf.dtype != jnp.int8 or leaf.ndim < 2:
            return leaf
        layout = Layout(tuple(range(leaf.ndim)), tiling=DOT_TILING)
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=Format(layout, leaf.sharding))
    return jax.tree_util.tree_map(one, params)


def entry_copies(hlo: str) -> list[dict]:
    """The int8 `copy` ops of the entry computation (re-tilings in HBM), with their bytes."""
    entry = hlo[hlo.index("\nENTRY"):]
    shapes = [tuple(int(n) for n in m.group(1).split(",")) for m in ENTRY_COPY.finditer(entry)]
    return [{"shape": list(s), "bytes": math.prod(s)} for s in shapes]


def compile_with(layout: str, args) -> list[dict]:
    abstract = sharding.abstract_params
    patched = (lambda *a, **k: dot_tiled(abstract(*a, **k))) if layout == "dot-tiled" else abstract
    with tempfile.TemporaryDirectory() as scratch, mock.patch.object(sharding, "abstract_params", patched):
        hlo_dir = Path(args.hlo_dir) / layout if args.hlo_dir else Path(scratch)
        report = tpu_compile(args.model, args.topology, args.methods.split(","), [args.ratio], weights="int8",
                             context=args.context, decode_loop=False, prefill=False, hlo_dir=hlo_dir)
        rows = []
        for record in report["records"]:
            step = (Path(hlo_dir) / f"{record['method']}-{record['ratio']}.step.hlo.txt").read_text()
            copies = entry_copies(step)
            rows.append({"layout": layout, "method": record["method"], "ratio": record["ratio"],
                         "bytes_per_step": record["decode_step"]["bytes_accessed"],
                         "ideal_bytes": record["decode_step"]["ideal_bytes_per_device"],
                         "entry_int8_copies": copies, "entry_int8_copy_bytes": sum(c["bytes"] for c in copies)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--methods", default="static")
    parser.add_argument("--ratio", type=float, default=0.4)
    parser.add_argument("--topology", default="v5e:1x1")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--out", default="results/tpu/int8_layout.json")
    parser.add_argument("--hlo-dir", help="keep each program's optimized HLO here, under default/ and dot-tiled/")
    args = parser.parse_args()
    rows = compile_with("default", args) + compile_with("dot-tiled", args)
    print(f"{'layout':10} {'method':8} {'ratio':>5} {'GB/step':>8} {'ideal':>7} {'x ideal':>7} {'HBM copies GB':>13}")
    for r in rows:
        print(f"{r['layout']:10} {r['method']:8} {r['ratio']:5.2f} {r['bytes_per_step'] / 1e9:8.3f} {r['ideal_bytes'] / 1e9:7.3f} "
              f"{r['bytes_per_step'] / r['ideal_bytes']:7.2f} {r['entry_int8_copy_bytes'] / 1e9:13.3f}")
    write_json_atomic(args.out, {"model": args.model, "topology": args.topology, "context": args.context, "weights": "int8",
                                 "dot_tiling": [list(t) for t in DOT_TILING], "jax": jax.__version__,
                                 "libtpu": version("libtpu"), "records": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
