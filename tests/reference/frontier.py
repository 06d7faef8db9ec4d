"""NumPy references of POP's frontier variants (docs/methods.md §7: gate-scored, low-rank-scored,
per-layer bands, shortlisted), loops over float64 copies: the prompt partition, the top m of C by
a score, each variant's decode step; and `run_and_compare`, which runs a plan's prefill and decode
steps against a reference step group by group (tests/methods/test_frontier_methods.py,
test_shortlist.py)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from popjax.models.config import ModelConfig
from tests.reference.ffn import as_jax, silu
from tests.reference.ffn import ref_down_norms as dnorm
from tests.reference.ffn import ref_rank as rank_desc

ATOL = 1e-5
D = 16


# ------------------------------------------------------------------ the NumPy reference


def group_norm(values, valid):
    """‖values[valid rows, j]‖₂ per column: values [B, T, n], valid [B, T] -> [n]."""
    out = np.zeros(values.shape[-1])
    for j in range(values.shape[-1]):
        out[j] = math.sqrt(sum(values[b, t, j] ** 2 for b in range(values.shape[0]) for t in range(values.shape[1]) if valid[b, t]))
    return out


def ref_partition(W, X, valid, n_keep, m):
    """POP's prefill (docs/methods.md §2): -> (Y, order by prompt importance, R, C)."""
    H = silu(X @ W["gate"]) * (X @ W["up"])
    order = rank_desc(group_norm(H, valid) * dnorm(W))
    keep = order[:n_keep]
    n_r = n_keep - m
    return H[..., keep] @ W["down"][keep], order, order[:n_r], order[n_r : n_r + 2 * m]


def ref_select_and_apply(W, R, C, x, scores, m):
    """Top m of C by ``scores`` (dict c -> score; ties: earlier in C), then exact H on R ∪ S."""
    S = sorted(C, key=lambda c: (-scores[c], C.index(c)))[:m]
    H = silu(x @ W["gate"]) * (x @ W["up"])
    return sum((H[..., [j]] * W["down"][j] for j in list(R) + S), np.zeros(x.shape[:-1] + (W["down"].shape[1],))), S


def ref_gate_step(W, R, C, x, m):
    G = silu(x @ W["gate"])
    dn = dnorm(W)
    scores = {c: math.sqrt(sum(G[b, 0, c] ** 2 for b in range(x.shape[0]))) * dn[c] for c in C}
    return ref_select_and_apply(W, R, C, x, scores, m)


def truncated(Wmat, r):
    """The best rank-r approximation of a [d, f] matrix (float64 SVD)."""
    u, s, vt = np.linalg.svd(Wmat, full_matrices=False)
    return (u[:, :r] * s[:r]) @ vt[:r]


def ref_lowrank_step(W, R, C, x, m, r, project):
    G = silu(x @ truncated(W["gate"], r))
    U = x @ truncated(W["up"], r)
    A = G * U if project == "gate_up" else G
    dn = dnorm(W)
    scores = {c: math.sqrt(sum(A[b, 0, c] ** 2 for b in range(x.shape[0]))) * dn[c] for c in C}
    return ref_select_and_apply(W, R, C, x, scores, m)


# ------------------------------------------------------------------ fixtures


def random_batch(rng, d, lengths, T):
    X = rng.normal(0, 1.0, (len(lengths), T, d))
    valid = np.zeros((len(lengths), T), bool)
    for b, n in enumerate(lengths):
        valid[b, T - n :] = True
    X[~valid] = rng.normal(0, 50.0, (int((~valid).sum()), d))  # padding must not leak
    return X, valid


def groups(aggregate, B):
    return [slice(0, B)] if aggregate == "shared" else [slice(b, b + 1) for b in range(B)]


def tiny_config(f=96, layers=3, d=D):
    return ModelConfig(
        model_type="llama", vocab_size=32, hidden_size=d, intermediate_size=f, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=2, head_dim=d // 2, rms_norm_eps=1e-6, rope_theta=1e4,
        max_position_embeddings=64, tie_word_embeddings=True,
    )


@functools.lru_cache(maxsize=None)
def jitted(plan):
    """The plan's prefill and decode, compiled once per plan and shape (eager mode compiles
    every op on its own: much slower here)."""
    return jax.jit(plan.prefill), jax.jit(plan.decode)


def run_and_compare(plan, W, X, valid, aggregate, m, ref_step, steps=3, seed=0, layer=0, data=None):
    """Prefill + ``steps`` decode steps of ``plan`` against the reference, group by group."""
    rng = np.random.default_rng(seed)
    w = as_jax(W, layer, data=data)
    prefill, decode = jitted(plan)
    y, state, _ = prefill(w, jnp.asarray(X, jnp.float32), jnp.asarray(valid))
    parts = {}
    for g in groups(aggregate, X.shape[0]):
        Y_ref, _, R, C = ref_partition(W, X[g], valid[g], plan.n_keep, m)
        np.testing.assert_allclose(np.asarray(y[g])[valid[g]], Y_ref[valid[g]], atol=ATOL)
        parts[g.start] = (R, C)
    for step in range(steps):
        x_t = rng.normal(0, 1.0, (X.shape[0], 1, X.shape[-1]))
        y_t, state, aux = decode(w, state, jnp.asarray(x_t, jnp.float32), step, jnp.ones((X.shape[0], 1), bool))
        for g in groups(aggregate, X.shape[0]):
            R, C = parts[g.start]
            y_ref, S = ref_step(W, R, C, x_t[g], m)
            np.testing.assert_allclose(np.asarray(y_t[g]), y_ref, atol=ATOL)
            if m:
                got = np.asarray(aux["selected"]) if aggregate == "shared" else np.asarray(aux["selected"][g.start])
                assert got[:m].tolist() == S
    return state


CASES = [(96, 67, 0.1), (96, 67, 0.4), (96, 91, 0.5), (96, 5, 0.5), (4, 2, 1.0), (96, 60, 0.0)]
