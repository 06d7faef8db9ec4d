"""Why base.gate_and_up reads gate/up [2, n, d] as a [2n, d] matrix without a mesh: XLA:CPU's
cost and time for H = silu(x W_gᵀ) ⊙ (x W_uᵀ) as one dot over each layout (SmolLM2-135M sizes).

    python benchmarks/gate_up_layout_bench.py results/engine/gate_up_layout.json
"""
import json
import sys
import time

import jax
import jax.numpy as jnp

D, F, REPEATS = 576, 1536, 300


def as_matrix(gate_up, x):  # the [2n, d] matrix the array is in memory (a free reshape)
    n = gate_up.shape[1]
    gu = jnp.einsum("...d,nd->...n", x, gate_up.reshape(2 * n, -1))
    return jax.nn.silu(gu[..., :n]) * gu[..., n:]


def stacked_pair_first(gate_up, x):  # a dot over the [2, n, d] operand itself (what a mesh needs)
    gu = jnp.einsum("...d,gnd->g...n", x, gate_up)
    return jax.nn.silu(gu[0]) * gu[1]


def stacked_pair_last(gate_up, x):  # the same dot with the output laid out [..., 2, n]
    gu = jnp.einsum("...d,gnd->...gn", x, gate_up)
    return jax.nn.silu(gu[..., 0, :]) * gu[..., 1, :]


def measure(fn, gate_up, x) -> dict:
    jitted = jax.jit(fn)
    compiled = jitted.lower(gate_up, x).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    jitted(gate_up, x).block_until_ready()
    start = time.perf_counter()
    for _ in range(REPEATS):
        jitted(gate_up, x).block_until_ready()
    return {"bytes_accessed": cost.get("bytes accessed"), "microseconds": (time.perf_counter() - start) / REPEATS * 1e6,
            "has_transpose": "transpose" in compiled.as_text()}


def main(out: str) -> None:
    gate_up = jax.random.normal(jax.random.key(0), (2, F, D), jnp.float32)
    results = {"d": D, "f": F, "backend": jax.default_backend(), "records": []}
    for shape in ((1, 1, D), (8, 1, D), (4, 64, D)):
        x = jnp.ones(shape, jnp.float32)
        layouts = (("[2n, d] matrix", as_matrix), ("[2, n, d] -> [2, ..., n]", stacked_pair_first),
                   ("[2, n, d] -> [..., 2, n]", stacked_pair_last))
        for name, fn in layouts:
            record = {"x": list(shape), "layout": name, **measure(fn, gate_up, x)}
            print(record, flush=True)
            results["records"].append(record)
    with open(out, "w") as handle:
        json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
