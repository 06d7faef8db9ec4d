"""The q/k/v projection on CPU, rows stacked [q; k; v] (store format 4) against grouped by KV head
[n_kv, g + 2, h, d] (format 5, models/layers.py), at SmolLM2-135M sizes: the same one dot, then
contiguous against strided slices of its output. Best of 3 interleaved rounds per shape.

    python benchmarks/qkv_layout_bench.py results/engine/qkv_layout.json
"""
import json
import sys
import time

import jax
import jax.numpy as jnp

D, N_Q, N_KV, H = 576, 9, 3, 64
G = N_Q // N_KV


def stacked_rows(w, x):  # format 4: w [(n_q + 2 n_kv)·h, d]
    y = jnp.einsum("...i,oi->...o", x, w)
    q, k, v = jnp.split(y, [N_Q * H, (N_Q + N_KV) * H], axis=-1)
    shape = (*x.shape[:2], -1, H)
    return q.reshape(shape), k.reshape(shape), v.reshape(shape)


def grouped(w, x):  # format 5: w [n_kv, g + 2, h, d], read as its [n_kv·(g+2)·h, d] matrix
    y = jnp.einsum("...i,oi->...o", x, w.reshape(-1, D)).reshape(*x.shape[:2], N_KV, G + 2, H)
    return y[:, :, :, :G].reshape(*x.shape[:2], -1, H), y[:, :, :, G], y[:, :, :, G + 1]


def seconds(fn, w, x, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(fn(w, x))
    return (time.perf_counter() - start) / repeats


def main(out: str) -> None:
    key = jax.random.key(0)
    layouts = {"[q; k; v] rows": (jax.jit(stacked_rows), jax.random.normal(key, ((N_Q + 2 * N_KV) * H, D))),
               "grouped by KV head": (jax.jit(grouped), jax.random.normal(key, (N_KV, G + 2, H, D)))}
    results = {"d": D, "heads": N_Q, "kv_heads": N_KV, "head_dim": H, "backend": jax.default_backend(), "records": []}
    for shape in ((1, 1, D), (8, 1, D), (1, 512, D), (8, 512, D)):
        x = jax.random.normal(key, shape)
        repeats = 200 if shape[1] == 1 else 10
        best = {}
        for fn, w in layouts.values():
            jax.block_until_ready(fn(w, x))  # compile
        for _ in range(3):
            for name, (fn, w) in layouts.items():
                best[name] = min(best.get(name, float("inf")), seconds(fn, w, x, repeats))
        for name, s in best.items():
            record = {"x": list(shape), "layout": name, "microseconds": s * 1e6}
            print(record, flush=True)
            results["records"].append(record)
    with open(out, "w") as handle:
        json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
