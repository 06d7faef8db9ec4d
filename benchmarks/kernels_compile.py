"""Compiles the decode-FFN TPU kernels (popjax.kernels.ffn_tpu) with Mosaic for v5e and v6e at the
shipped configs' FFN shapes and writes, per kernel and configuration, its VMEM (estimated from
its block shapes; checked by compiling with the limit set to exactly that estimate), whether it
fits the chip, whether XLA copied the weights first (temp bytes), and the bytes of one call: the
kernel's own count, the dense FFN's, the ideal (only the kept channels) and XLA:TPU's cost-model
figure for the dense FFN compiled for the same chip. JSON to results/kernels/compile.json.

    python benchmarks/kernels_compile.py [--out results/kernels/compile.json] [--chips v5e v6e]

Compile-only through libtpu (no TPU needed); the byte figures are counts and the compiler's
estimates, not measurements of a chip (docs/kernels.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from importlib.metadata import version
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from popjax.analysis.topologies import CHIPS, resolve_topology
from popjax.files import write_json_atomic
from popjax.kernels import block_slab, ffn_layout, ffn_tpu, traffic

log = logging.getLogger("kernels_compile")
S = jax.ShapeDtypeStruct
CONFIGS = Path(__file__).resolve().parents[1] / "popjax" / "configs"
BLOCK, CHUNK = 128, 64


def shapes() -> list[dict]:
    """The FFN shapes of the shipped configs: (name, d, f, activation)."""
    def cfg(name):
        return json.loads((CONFIGS / f"{name}.json").read_text())

    llama8, llama70, gemma, qwen = (cfg(n) for n in ("llama-3.1-8b", "llama-3.1-70b", "gemma-3-27b", "qwen3-30b-a3b"))
    return [
        {"model": "llama-3.1-8b", "d": llama8["hidden_size"], "f": llama8["intermediate_size"], "act": "silu"},
        {"model": "llama-3.1-70b (1/8 shard)", "d": llama70["hidden_size"], "f": llama70["intermediate_size"] // 8, "act": "silu"},
        {"model": "gemma-3-27b", "d": gemma["hidden_size"], "f": gemma["intermediate_size"], "act": "gelu_pytorch_tanh"},
        {"model": "qwen3-30b-a3b (one expert)", "d": qwen["hidden_size"], "f": qwen["moe_intermediate_size"], "act": "silu"},
    ]


def _scales(int8: bool, *shapes_):
    return [S(s, jnp.float32) if int8 else None for s in shapes_]


def kernel_call(kind: str, shape: dict, ratio: float, batch: int, w_dtype: str):
    """(fn, args, positions, kept channels, vmem estimate, own bytes) of one configuration."""
    d, f, act = shape["d"], shape["f"], shape["act"]
    int8 = w_dtype == "int8"
    x = S((batch, d), jnp.bfloat16)
    if kind == "block":
        nb = f // BLOCK
        n = max(1, round(nb * (1 - ratio)))
        slab = block_slab.BlockSlab(S((nb, 3, BLOCK, d), w_dtype), *_scales(int8, (nb, 2, BLOCK), (1, d)))
        est = ffn_tpu.block_vmem_bytes(batch, BLOCK, d, w_dtype, jnp.bfloat16, masked=batch > 1)
        mask = [S((batch, nb), jnp.bool_)] if batch > 1 else []
        fn = lambda x, s, i, *m: ffn_tpu.block_ffn(x, s, i, *m, act=act, vmem_limit_bytes=est)  # noqa: E731
        own = traffic.block_ffn_bytes(n, n, BLOCK, d, batch, w_dtype, jnp.bfloat16, masked=batch > 1)
        return fn, [x, slab, S((n,), jnp.int32), *mask], n, n * BLOCK, est, own
    lines = ffn_layout.channel_lines(d)
    n = round(f * (1 - ratio))
    rows = ffn_layout.ChannelRows(S((3, f, lines, 128), w_dtype), *_scales(int8, (2, f), (1, lines * 128)))
    est = ffn_tpu.gather_vmem_bytes(batch, CHUNK, d, w_dtype, jnp.bfloat16)
    fn = lambda x, r, i: ffn_tpu.gather_ffn(x, r, i, act=act, chunk=CHUNK, vmem_limit_bytes=est)  # noqa: E731
    own = traffic.gather_ffn_bytes(n, n, CHUNK, d, batch, w_dtype, jnp.bfloat16)
    return fn, [x, rows, S((n,), jnp.int32)], n, n, est, own


def dense_ffn(x, gate_up, down, gate_up_scale, down_scale):
    """The dense FFN as XLA runs it (weight-only int8: the convert fused into the dot)."""
    gu = jnp.einsum("bd,kfd->kbf", x, gate_up.astype(x.dtype), preferred_element_type=jnp.float32)
    if gate_up_scale is not None:
        gu = gu * gate_up_scale[:, None, :, 0]
    h = (jax.nn.silu(gu[0]) * gu[1]).astype(x.dtype)
    y = jnp.einsum("bf,df->bd", h, down.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y if down_scale is None else y * down_scale[:, 0]).astype(x.dtype)


def compile_on(device, fn, args):
    sharding = jax.sharding.SingleDeviceSharding(device)
    placed = jax.tree.map(lambda s: S(s.shape, s.dtype, sharding=sharding), args)
    return jax.jit(fn).lower(*placed).compile()


def xla_dense_bytes(device, shape: dict, batch: int, w_dtype: str) -> float:
    d, f, int8 = shape["d"], shape["f"], w_dtype == "int8"
    args = [S((batch, d), jnp.bfloat16), S((2, f, d), w_dtype), S((d, f), w_dtype), *_scales(int8, (2, f, 1), (d, 1))]
    return float(compile_on(device, dense_ffn, args).cost_analysis()["bytes accessed"])


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0][:300]


def default_scoped_vmem(device) -> int:
    """The chip's default scoped VMEM limit, as the compiler states it when a kernel built
    without ``vmem_limit_bytes`` pipelines 48 MiB of blocks ("... and limit 16.00M exceeded")."""
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    block, shape = (3072, 8, 128), (6144, 8, 128)  # 12 MiB blocks of f32, double-buffered in and out
    spec = pl.BlockSpec(block, lambda i: (i, 0, 0))
    fn = lambda x: pl.pallas_call(kernel, grid=(2,), in_specs=[spec], out_specs=spec, out_shape=S(shape, jnp.float32))(x)  # noqa: E731
    try:
        compile_on(device, fn, [S(shape, jnp.float32)])
    except Exception as err:  # noqa: BLE001 - the refusal states the limit
        found = re.search(r"limit ([0-9.]+)M", str(err))
        if found:
            return int(float(found.group(1)) * 2**20)
        raise
    raise RuntimeError("48 MiB of blocks compiled: no default limit to read")


def layout_probe(device, shape: tuple[int, ...], view: tuple[int, ...], per_row) -> dict:
    """What XLA:TPU and Mosaic make of a DMA of one channel out of a weight array of ``shape``
    (bf16): the temp bytes of the compiled program (a copy of the array before the kernel) or
    Mosaic's refusal. ``per_row(ref, id)`` is the channel's view, of shape ``view``."""

    def kernel(ids_ref, rows_hbm, o_ref, buf, sem):
        copy = pltpu.make_async_copy(per_row(rows_hbm, ids_ref[0]), buf, sem.at[0])
        copy.start()
        copy.wait()
        o_ref[...] = jnp.sum(buf[...].astype(jnp.float32)).reshape(1, 1) + jnp.zeros((8, 128))

    def fn(ids, rows):
        grid = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(1,), in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((8, 128), lambda i, ids: (0, 0)),
            scratch_shapes=[pltpu.VMEM(view, jnp.bfloat16), pltpu.SemaphoreType.DMA((1,))])
        return pl.pallas_call(kernel, grid_spec=grid, out_shape=S((8, 128), jnp.float32))(ids, rows)

    try:
        compiled = compile_on(device, fn, [S((1,), jnp.int32), S(shape, jnp.bfloat16)])
    except Exception as err:  # noqa: BLE001 - Mosaic's refusal is the result
        return {"shape": list(shape), "compiled": False, "error": _first_line(err)}
    return {"shape": list(shape), "compiled": True, "xla_temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
            "weight_bytes": 2 * int(jnp.prod(jnp.array(shape)))}


def layout_probes(device) -> list[dict]:
    """One channel of Llama-3.1-8B's (and Gemma-3-27B's) FFN rows, in the layouts tried."""
    f = 14336
    return [
        {"layout": "[3, f, d]: row offset inside a tile",
         **layout_probe(device, (3, f, 4096), (1, 4096), lambda r, i: r.at[0, pl.ds(i, 1)])},
        {"layout": "[3, f, 1, d]", **layout_probe(device, (3, f, 1, 4096), (1, 4096), lambda r, i: r.at[0, i])},
        {"layout": "[3, f, d/128, 128], d = 5376 (42 lines)", **layout_probe(device, (3, f, 42, 128), (42, 128), lambda r, i: r.at[0, i])},
        {"layout": "[3, f, L, 128], d = 4096 (L = 32)", **layout_probe(device, (3, f, 32, 128), (32, 128), lambda r, i: r.at[0, i])},
        {"layout": "[3, f, L, 128], d = 5376 padded (L = 48)", **layout_probe(device, (3, f, 48, 128), (48, 128), lambda r, i: r.at[0, i])},
    ]


def row(device, chip: str, kind: str, shape: dict, ratio: float, batch: int, w_dtype: str, dense_xla: float) -> dict:
    fn, args, n, kept, est, own = kernel_call(kind, shape, ratio, batch, w_dtype)
    d, f = shape["d"], shape["f"]
    physical = ffn_tpu.chip_vmem_bytes(chip)
    out = {"chip": chip, "kernel": kind, **shape, "ratio": ratio, "batch": batch, "weights": w_dtype,
           "block" if kind == "block" else "chunk": BLOCK if kind == "block" else CHUNK, "positions": n, "kept_channels": kept,
           "vmem_estimate": est, "vmem_physical": physical, "vmem_default_scoped": ffn_tpu.DEFAULT_SCOPED_VMEM[chip],
           "fits_chip": est <= physical}
    try:
        compiled = compile_on(device, fn, args)
        cost = compiled.cost_analysis()
        out.update(compiled_at_estimate=True, xla_temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
                   cost_model_bytes=float(cost["bytes accessed"]))
    except Exception as err:  # noqa: BLE001 - the compiler's refusal is the result
        out.update(compiled_at_estimate=False, error=_first_line(err))
    dense = traffic.dense_ffn_bytes(d, f, batch, w_dtype, jnp.bfloat16)
    # ideal: exactly the channels this kernel keeps (whole blocks round the ratio); and at the ratio
    ideal = traffic.ideal_ffn_bytes(kept, d, batch, w_dtype, jnp.bfloat16)
    at_ratio = traffic.ideal_ffn_bytes(round(f * (1 - ratio)), d, batch, w_dtype, jnp.bfloat16)
    bandwidth = CHIPS[chip].hbm_bandwidth
    out.update(kernel_bytes=own, dense_bytes=dense, ideal_bytes=ideal, ideal_bytes_at_ratio=at_ratio,
               xla_dense_cost_model_bytes=dense_xla, kernel_over_ideal=own / ideal, kernel_over_dense=own / dense,
               roofline_us_kernel=1e6 * own / bandwidth, roofline_us_dense=1e6 * dense / bandwidth)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results/kernels/compile.json"))
    parser.add_argument("--chips", nargs="+", default=["v5e", "v6e"], choices=sorted(ffn_tpu.DEFAULT_SCOPED_VMEM))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows, defaults, probes = [], {}, []
    for chip in args.chips:
        device = resolve_topology("v5p:1x1x1" if chip == "v5p" else f"{chip}:1x1").devices[0]
        defaults[chip] = default_scoped_vmem(device)
        if chip == "v5e":
            probes = layout_probes(device)
        for shape in shapes():
            for batch in (1, 8):
                for w_dtype in ("bfloat16", "int8"):
                    dense_xla = xla_dense_bytes(device, shape, batch, w_dtype)
                    for ratio in (0.2, 0.4):
                        for kind in ("block", "gather"):
                            r = row(device, chip, kind, shape, ratio, batch, w_dtype, dense_xla)
                            rows.append(r)
                            log.info("%s %-26s %-6s r=%.1f B=%d %-8s vmem %.1f MiB compiled=%s kernel/ideal %.3f",
                                     chip, shape["model"], kind, ratio, batch, w_dtype, r["vmem_estimate"] / 2**20,
                                     r["compiled_at_estimate"], r["kernel_over_ideal"])
    payload = {"command": " ".join(["python benchmarks/kernels_compile.py", *(argv if argv is not None else sys.argv[1:])]),
               "jax": jax.__version__, "libtpu": version("libtpu"), "default_scoped_vmem": defaults,
               "layout_probes_v5e": probes, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out, payload)
    failed = [r for r in rows if not (r["compiled_at_estimate"] and r["fits_chip"])]
    log.info("%d configurations, %d failed; wrote %s", len(rows), len(failed), args.out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
