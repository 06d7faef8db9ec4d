"""Compiles the POP presets' data-dependent reads, the Pallas calls `popjax.kernels.decode_ffn`
makes, with Mosaic for v5e and v6e at the shipped configs' FFN shapes: channel POP's
`gather_matvec` (one row DMA per selected candidate) and block POP's `block_matvec` (b = 128: one
BlockSpec fetch per selected block) over the prefill's candidate copy [n_C, L, 128]; shortlisted
POP's (σ = 0.75) `gather_row_dots` of its s shortlisted up rows and `values_matvec` of its m
selected down rows; at 20% and 40% (γ = 0.1), batch 1 and 8, bf16 and int8 weights. Per configuration: the kernel's VMEM estimate (compiled
with the limit set to exactly that), whether it fits the chip, XLA's temp bytes (a copy of the
candidate rows would show here), the kernel's own byte count and XLA:TPU's cost-model bytes of
the whole call (the count passed as the call's cost, plus XLA's id and x preparation).
JSON to results/kernels/pop_down_compile.json.

    python benchmarks/pop_down_compile.py [--out results/kernels/pop_down_compile.json] [--chips v5e v6e]

Compile-only through libtpu (no TPU needed); bytes are counts and the compiler's estimates, not
measurements of a chip (docs/kernels.md, "Block POP's down read").
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from importlib.metadata import version
from pathlib import Path

import jax
import jax.numpy as jnp

import popjax
from popjax.analysis.topologies import resolve_topology
from popjax.files import write_json_atomic
from popjax.kernels import ffn_layout, ffn_tpu, matvec_tpu, traffic
from popjax.methods.pop.blocks import BlockBand
from popjax.methods.pop.plan import GLOBAL_BAND
from popjax.methods.pop.shortlist import shortlist_size
from popjax.models.config import ModelConfig

log = logging.getLogger("pop_down_compile")
S = jax.ShapeDtypeStruct
CONFIGS = Path(__file__).resolve().parents[1] / "popjax" / "configs"
BLOCK, CHUNK, GAMMA, SIGMA = 128, 64, 0.1, 0.75
SHAPES = (  # (shipped config, shown as, divisor of f: a tensor-parallel shard)
    ("llama-3.1-8b", "llama-3.1-8b", 1),
    ("llama-3.1-70b", "llama-3.1-70b (1/8 shard)", 8),
    ("gemma-3-27b", "gemma-3-27b", 1),
)


def ffn_shapes() -> list[dict]:
    """d, f and POP's kept fraction of f at each ratio, from the shipped configs' own plans."""
    out = []
    for name, shown, split in SHAPES:
        cfg = ModelConfig.from_hf_dict(json.loads((CONFIGS / f"{name}.json").read_text()))
        keep = {r: popjax.POP(r, gamma=GAMMA).bind(cfg).n_keep / cfg.intermediate_size for r in (0.2, 0.4)}
        out.append({"model": shown, "d": cfg.hidden_size, "f": cfg.intermediate_size // split, "kept_fraction": keep})
    return out


def call(kind: str, d: int, n_c: int, m: int, batch: int, w_dtype: str):
    """(fn, args, vmem estimate, own bytes) of one read of m of the n_C candidate rows."""
    lines = ffn_layout.channel_lines(d)
    rows = ffn_layout.InputRows(S((n_c, lines, 128), w_dtype), S((1, lines * 128), jnp.float32) if w_dtype == "int8" else None)
    h = S((batch, n_c), jnp.bfloat16)
    if kind == "row_dots":  # shortlisted POP's up rows: m = s outputs of the [n_C, d] up copy
        ups = ffn_layout.OutputRows(S((n_c, lines, 128), w_dtype), S((n_c,), jnp.float32) if w_dtype == "int8" else None)
        est = matvec_tpu.row_dots_vmem_bytes(batch, 128, d, w_dtype, jnp.bfloat16)
        fn = lambda x, r, i: matvec_tpu.gather_row_dots(x, r, i, vmem_limit_bytes=est)  # noqa: E731
        own = traffic.gather_row_dots_bytes(m, m, 128, d, batch, w_dtype, jnp.bfloat16, n_c)
        return fn, [S((batch, d), jnp.bfloat16), ups, S((m,), jnp.int32)], est, own
    if kind == "values":  # shortlisted POP's down read: the m selected rows, their H values given
        est = matvec_tpu.matvec_vmem_bytes(batch, CHUNK, d, w_dtype, jnp.bfloat16)
        fn = lambda v, r, i: matvec_tpu.values_matvec(v, r, i, out_features=d, chunk=CHUNK, vmem_limit_bytes=est)  # noqa: E731
        own = traffic.gather_matvec_bytes(m, m, CHUNK, d, batch, w_dtype, jnp.bfloat16)
        return fn, [S((batch, m), jnp.bfloat16), rows, S((m,), jnp.int32)], est, own
    if kind == "block":
        est = matvec_tpu.block_matvec_vmem_bytes(batch, BLOCK, d, w_dtype, jnp.bfloat16)
        fn = lambda x, r, i: matvec_tpu.block_matvec(x, r, i, block=BLOCK, out_features=d, vmem_limit_bytes=est)  # noqa: E731
        own = traffic.block_matvec_bytes(m // BLOCK, m // BLOCK, BLOCK, d, batch, w_dtype, jnp.bfloat16)
        return fn, [h, rows, S((m // BLOCK,), jnp.int32)], est, own
    est = matvec_tpu.matvec_vmem_bytes(batch, CHUNK, d, w_dtype, jnp.bfloat16)
    fn = lambda x, r, i: matvec_tpu.gather_matvec(x, r, i, out_features=d, chunk=CHUNK, vmem_limit_bytes=est)  # noqa: E731
    own = traffic.gather_matvec_bytes(m, m, CHUNK, d, batch, w_dtype, jnp.bfloat16)
    return fn, [h, rows, S((m,), jnp.int32)], est, own


def row(device, chip: str, kind: str, shape: dict, ratio: float, batch: int, w_dtype: str) -> dict:
    d, f = shape["d"], shape["f"]
    n_keep = round(shape["kept_fraction"][ratio] * f)
    band = BlockBand(BLOCK) if kind == "block" else GLOBAL_BAND
    m = band.selected(GAMMA, f, n_keep)
    read = shortlist_size(SIGMA, m, 2 * m) if kind == "row_dots" else m  # rows the call reads
    fn, args, est, own = call(kind, d, 2 * m, read, batch, w_dtype)
    out = {"chip": chip, "kernel": kind, "model": shape["model"], "d": d, "f": f, "ratio": ratio, "gamma": GAMMA,
           "batch": batch, "weights": w_dtype, "n_candidates": 2 * m, "m": m, "rows_read": read, "vmem_estimate": est,
           "vmem_physical": ffn_tpu.chip_vmem_bytes(chip), "fits_chip": est <= ffn_tpu.chip_vmem_bytes(chip), "kernel_bytes": own,
           "ideal_bytes": read * d * jnp.dtype(w_dtype).itemsize}
    if kind == "block":
        out["block"] = BLOCK
    if kind == "row_dots":
        out["shortlist"] = SIGMA
    sharding = jax.sharding.SingleDeviceSharding(device)
    try:
        placed = jax.tree.map(lambda s: S(s.shape, s.dtype, sharding=sharding), args)
        compiled = jax.jit(fn).lower(*placed).compile()
        out.update(compiled_at_estimate=True, xla_temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
                   cost_model_bytes=float(compiled.cost_analysis()["bytes accessed"]))
    except Exception as err:  # noqa: BLE001 - the compiler's refusal is the result
        out.update(compiled_at_estimate=False, error=str(err).strip().splitlines()[0])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results/kernels/pop_down_compile.json"))
    parser.add_argument("--chips", nargs="+", default=["v5e", "v6e"], choices=["v5e", "v6e"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = []
    for chip in args.chips:
        device = resolve_topology(f"{chip}:1x1").devices[0]
        for shape in ffn_shapes():
            for batch in (1, 8):
                for w_dtype in ("bfloat16", "int8"):
                    for ratio in (0.2, 0.4):
                        for kind in ("gather", "block", "row_dots", "values"):
                            r = row(device, chip, kind, shape, ratio, batch, w_dtype)
                            rows.append(r)
                            log.info("%s %-26s %-8s r=%.1f B=%d %-8s m=%d vmem %.2f MiB compiled=%s cost/own %.3f", chip, shape["model"],
                                     kind, ratio, batch, w_dtype, r["m"], r["vmem_estimate"] / 2**20, r["compiled_at_estimate"],
                                     r.get("cost_model_bytes", float("nan")) / r["kernel_bytes"])
    payload = {"command": " ".join(["python benchmarks/pop_down_compile.py", *(argv if argv is not None else sys.argv[1:])]),
               "jax": jax.__version__, "libtpu": version("libtpu"), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out, payload)
    failed = [r for r in rows if not (r["compiled_at_estimate"] and r["fits_chip"])]
    log.info("%d configurations, %d failed; wrote %s", len(rows), len(failed), args.out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
