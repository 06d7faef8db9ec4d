"""Per-layer costs of BWAP's step kinds at batch 8 (SmolLM2-135M dims, global 40%: k = 717 of
f = 1536; 30 layers of distinct random weights so nothing stays in cache), each inside a jitted
20-step fori_loop: a dense FFN step, a pruned step on compact blocks (down block as rows [k, d],
as BWAP keeps it, or as columns [d, k]), and a mask update (gathering the compact blocks from
W_d's columns, as BWAP does, or from a transposed copy of W_d). Usage:
python benchmarks/bwap_step_bench.py results/engine/bwap_step_bench.json   (~1 min)"""
import json, sys, time
import jax, jax.numpy as jnp
L, d, f, k, B = 30, 576, 1536, 717, 8
key = jax.random.PRNGKey(0)
gu = jax.random.normal(key, (L, 2 * f, d), jnp.float32) * 0.02
down = jax.random.normal(key, (L, d, f), jnp.float32) * 0.02
down_t = jnp.swapaxes(down, 1, 2)  # [L, f, d]
kept = jnp.sort(jax.random.permutation(key, f)[:k])
idx2 = jnp.concatenate([kept, kept + f])
x = jax.random.normal(key, (B, 1, d), jnp.float32)

def act(g, x):
    z = jnp.einsum("btd,nd->btn", x, g); n = g.shape[0] // 2
    return jax.nn.silu(z[..., :n]) * z[..., n:]

def loop(body, init, steps=20):
    return jax.jit(lambda p, c: jax.lax.fori_loop(0, steps, lambda i, c: body(p, i, c), c))

def timeit(fn, arg, n=5):
    out = fn(P, arg); jax.block_until_ready(out)
    ts = []
    for _ in range(n):
        t = time.perf_counter(); jax.block_until_ready(fn(P, arg)); ts.append(time.perf_counter() - t)
    return min(ts)

steps = 20
def dense_body(P, i, x):
    gu, down = P['gu'], P['down']
    for l in range(L):
        x = x + jnp.einsum("btn,dn->btd", act(gu[l], x), down[l]) * 0.01
    return x
P = {'gu': gu, 'down': down, 'down_t': down_t}
gu_c = jnp.stack([gu[l][idx2] for l in range(L)]); rows = jnp.stack([down_t[l][kept] for l in range(L)]); cols = jnp.stack([down[l][:, kept] for l in range(L)])
P.update(gu_c=gu_c, rows=rows, cols=cols)
def rows_body(P, i, x):
    gu_c, rows = P['gu_c'], P['rows']
    for l in range(L):
        x = x + jnp.einsum("btk,kd->btd", act(gu_c[l], x), rows[l]) * 0.01
    return x
def cols_body(P, i, x):
    gu_c, cols = P['gu_c'], P['cols']
    for l in range(L):
        x = x + jnp.einsum("btk,dk->btd", act(gu_c[l], x), cols[l]) * 0.01
    return x
def upd_cols(P, i, c):
    gu, down = P['gu'], P['down']
    s, ids = c
    out = [(jnp.take(gu[l], jnp.concatenate([ids, ids + f]), axis=0), jnp.take(down[l], ids, axis=1).T) for l in range(L)]
    s = s + sum(jnp.sum(a) + jnp.sum(b) for a, b in out)
    return s, jnp.roll(ids, 1)
def upd_rows(P, i, c):
    gu, down_t = P['gu'], P['down_t']
    s, ids = c
    out = [(jnp.take(gu[l], jnp.concatenate([ids, ids + f]), axis=0), jnp.take(down_t[l], ids, axis=0)) for l in range(L)]
    s = s + sum(jnp.sum(a) + jnp.sum(b) for a, b in out)
    return s, jnp.roll(ids, 1)
res = {}
for name, body, arg in [("dense", dense_body, x), ("pruned_rows", rows_body, x), ("pruned_cols", cols_body, x),
                        ("update_from_columns", upd_cols, (jnp.float32(0), kept)), ("update_from_transposed", upd_rows, (jnp.float32(0), kept))]:
    res[name + "_ms_per_layer"] = 1e3 * timeit(loop(body, arg, steps), arg) / steps / L
    print(name, round(res[name + "_ms_per_layer"], 3), flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
