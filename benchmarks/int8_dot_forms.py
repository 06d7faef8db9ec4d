"""One int8 dot of each of the default model's weight shapes, in each form popjax can run it,
read as a decode step reads them: 30 distinct weights (2 for the LM head) applied in turn inside
a jitted ``fori_loop``, so each comes from the shared L3 or memory, not a core's L2. Run alone:

    python benchmarks/int8_dot_forms.py --json results/int8/dot_forms.json

Forms (x has ``rows`` rows; every form goes through `kernels.int8.dot` as the model does):
  fp32            x · Wᵀ on the float weight
  int8 act        int8 activations (x quantized per row, int8 × int8 → int32; one row padded to two)
  weight-only     x · convert(q)ᵀ · s, the int8 values tied to x by an optimisation barrier

Each row also says which XLA:CPU kernel runs the dot: "ynn" (a YNNPACK library call) or "loop"
(XLA's own loop fusion of convert → transpose → dot), read from the compiled HLO.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from popjax.kernels.int8 import Int8Weight, dot, quantize

SHAPES = {"q/k/v": (960, 576), "o": (576, 576), "gate/up": (3072, 576), "down": (576, 1536), "lm head": (49152, 576)}


def _timed_loop(fn, x, weights, steps: int = 8, repeats: int = 7) -> tuple[float, str]:
    """µs per dot of ``fn`` over ``weights`` inside a fori_loop, and the kernel that ran it."""

    def loop(x, weights):
        def body(_, x):
            for w in weights:  # each result feeds the next input: nothing can be hoisted or skipped
                x = x + 1e-6 * jnp.sum(fn(x, w))
            return x

        return jax.lax.fori_loop(0, steps, body, x)

    jitted = jax.jit(loop)
    kernel = "ynn" if "__ynn_fusion" in jitted.lower(x, weights).compile().as_text() else "loop"
    jitted(x, weights).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jitted(x, weights).block_until_ready()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) / steps / len(weights) * 1e6, kernel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="where to write the results")
    parser.add_argument("--rows", default="1,8", help="comma-separated batch sizes (default 1,8)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    records = []
    for rows in (int(r) for r in args.rows.split(",")):
        for name, (m, k) in SHAPES.items():
            count = 2 if m * k > 10_000_000 else 30
            floats = [rng.standard_normal((m, k)).astype(np.float32) * 0.05 for _ in range(count)]
            x = jnp.asarray(rng.standard_normal((rows, k)).astype(np.float32))
            forms = {"fp32": [jnp.asarray(w) for w in floats]}
            for activations in ("int8", "float"):
                label = "int8 act" if activations == "int8" else "weight-only"
                forms[label] = [Int8Weight(*map(jnp.asarray, quantize(w)), jnp.float32, activations) for w in floats]
            for form, weights in forms.items():
                us, kernel = _timed_loop(lambda x, w: dot("bk,mk->bm", x, w), x, weights)
                nbytes = m * k * (4 if form == "fp32" else 1)
                records.append({"rows": rows, "weight": name, "shape": [m, k], "form": form, "us": us,
                                "gb_per_s": nbytes / us / 1e3, "kernel": kernel})
                print(f"rows {rows} {name:8s} {m}x{k} {form:12s} {us:8.1f} µs {nbytes / us / 1e3:6.1f} GB/s ({kernel})", flush=True)
    with open(args.json, "w") as f:
        json.dump({"records": records, "jax": jax.__version__}, f, indent=2)


if __name__ == "__main__":
    main()
