"""Compiles one layer of CATS's decode FFN with its Pallas kernel for a TPU (Mosaic through libtpu,
compile-only) at Llama-3.1-8B's shapes, and compares XLA:TPU's cost-model bytes with the ideal:
the dense gate dot (all of W_g), the threshold, then `popjax.kernels.decode_ffn.gated_ffn`
reading the kept channels' up and down rows from the 32-layer stack at a traced layer. Per CATS
budget (ratio 0.2 and 0.4 keep 62.9% and 25.7% of the channels on the 8B) and batch 1 and 8:
the cost-model bytes, the ideal (W_g + 2·|J| rows of d, bf16, x and y) and their ratio.
JSON to results/kernels/cats_layer_compile.json.

    python benchmarks/cats_layer_compile.py [--out results/kernels/cats_layer_compile.json] [--chip v6e]

The whole step's figures (`popjax compile`) are in docs/kernels.md, "CATS and dynamic POP"; this
isolates the part the kernel changes. Bytes are the compiler's estimates, not measurements.
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
from popjax.kernels import decode_ffn, ffn_layout
from popjax.models.config import ModelConfig

log = logging.getLogger("cats_layer_compile")
S = jax.ShapeDtypeStruct
CONFIG = Path(__file__).resolve().parents[1] / "popjax" / "configs" / "llama-3.1-8b.json"


def layer_bytes(device, d: int, f: int, layers: int, batch: int, kept: int) -> float:
    """XLA:TPU's cost-model bytes of one layer's CATS FFN: gate dot, threshold, kernel call."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    lines = ffn_layout.channel_lines(d)

    def step(x, gate_up, rows, layer, t):
        g = jax.nn.silu(jnp.einsum("bd,nd->bn", x, gate_up[0]).astype(jnp.float32))
        return decode_ffn.gated_ffn(x, rows, jnp.abs(g) > t, g, layer=layer, act="silu", expected_active=kept, kernel="pallas-tpu")

    args = [S((batch, d), "bfloat16"), S((2, f, d), "bfloat16"), ffn_layout.ChannelRows(S((2, layers, f, lines, 128), "bfloat16")),
            S((), "int32"), S((), "float32")]
    placed = jax.tree.map(lambda s: S(s.shape, s.dtype, sharding=sharding), args)
    return float(jax.jit(step).lower(*placed).compile().cost_analysis()["bytes accessed"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results/kernels/cats_layer_compile.json"))
    parser.add_argument("--chip", default="v6e", choices=["v5e", "v6e"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = ModelConfig.from_hf_dict(json.loads(CONFIG.read_text()))
    d, f, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    device = resolve_topology(f"{args.chip}:1x1").devices[0]
    rows = []
    for ratio in (0.2, 0.4):
        kept_fraction = 1.0 - popjax.CATS(ratio=ratio).sparsity(cfg)
        kept = round(kept_fraction * f)
        for batch in (1, 8):
            cost = layer_bytes(device, d, f, layers, batch, kept)
            ideal = (f * d + 2 * kept * d) * 2 + 2 * batch * d * 2
            rows.append({"chip": args.chip, "d": d, "f": f, "ratio": ratio, "batch": batch, "kept_fraction": kept_fraction, "kept": kept,
                         "cost_model_bytes": cost, "ideal_bytes": ideal, "cost_over_ideal": cost / ideal})
            log.info("%s CATS %.1f (kept %.1f%%) B=%d: %.1f MiB, ideal %.1f MiB, %.3fx", args.chip, ratio, 100 * kept_fraction, batch, cost / 2**20,
                     ideal / 2**20, cost / ideal)
    payload = {"command": " ".join(["python benchmarks/cats_layer_compile.py", *(argv if argv is not None else sys.argv[1:])]),
               "model": "llama-3.1-8b", "jax": jax.__version__, "libtpu": version("libtpu"), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out, payload)
    log.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
