"""POP, static and dynamic against a plain NumPy reference of docs/methods.md §2, written independently here.

The reference uses loops and argsort on float64 copies; popjax runs fp32 JAX. Partitions and
selections must agree exactly, outputs within 1e-5.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from popjax.methods import DynamicPlan, POPPlan, StaticPlan
from tests.reference.ffn import as_jax, random_batch, random_layer, ref_down_norms, ref_hidden, ref_rank, ref_sizes
from tests.reference.methods import ref_dynamic_decode, ref_pop_decode, ref_prefill

ATOL = 1e-5


# ------------------------------------------------------------------ fixtures


# (f, n_keep, gamma): ordinary, ratio 0, m clamped by f − n_keep, m clamped by n_keep, tiny f, gamma 0
CASES = [
    (96, 67, 0.1),
    (96, 96, 0.1),
    (96, 91, 0.5),
    (96, 5, 0.5),
    (4, 2, 1.0),
    (96, 60, 0.0),
    (96, 48, 0.3),
]


def _plan(f, n_keep, gamma, aggregate):
    _, _, m = ref_sizes(f, n_keep, gamma)
    return POPPlan(f=f, n_keep=n_keep, m=m, aggregate=aggregate)


@pytest.mark.parametrize("f, n_keep, gamma", CASES)
def test_pop_shared_matches_reference(f, n_keep, gamma):
    rng = np.random.default_rng(f * 1000 + n_keep)
    d, steps = 16, 4
    W = random_layer(rng, d, f)
    X, valid = random_batch(rng, d, [5, 8, 3], T=8)
    plan = _plan(f, n_keep, gamma, "shared")
    n_r, n_c, m = ref_sizes(f, n_keep, gamma)
    assert (plan.n_retained, plan.n_candidates, plan.m) == (n_r, n_c, m)

    y, state, aux = plan.prefill(as_jax(W), jnp.asarray(X, jnp.float32), jnp.asarray(valid))
    Y_ref, R, C, importance = ref_prefill(W, X, valid, n_keep, m)
    assert np.asarray(state["retained_idx"]).tolist() == R
    assert np.asarray(state["candidate_idx"]).tolist() == C
    np.testing.assert_allclose(np.asarray(aux["importance"]), importance, rtol=1e-5, atol=ATOL)
    np.testing.assert_allclose(np.asarray(y)[valid], Y_ref[valid], atol=ATOL)

    for step in range(steps):
        x_t = rng.normal(0, 1.0, (3, 1, d))
        y_t, state, aux = plan.decode(as_jax(W), state, jnp.asarray(x_t, jnp.float32), step, jnp.ones((x_t.shape[0], 1), bool))
        y_ref, selected = ref_pop_decode(W, R, C, x_t, m)
        np.testing.assert_allclose(np.asarray(y_t), y_ref, atol=ATOL)
        if m:
            assert np.asarray(aux["selected"]).tolist() == selected


@pytest.mark.parametrize("f, n_keep, gamma", CASES)
def test_pop_per_sequence_matches_reference(f, n_keep, gamma):
    rng = np.random.default_rng(7 + f + n_keep)
    d = 16
    W = random_layer(rng, d, f)
    X, valid = random_batch(rng, d, [6, 2], T=6)
    plan = _plan(f, n_keep, gamma, "per_sequence")
    _, _, m = ref_sizes(f, n_keep, gamma)
    y, state, _ = plan.prefill(as_jax(W), jnp.asarray(X, jnp.float32), jnp.asarray(valid))
    refs = [ref_prefill(W, X[b : b + 1], valid[b : b + 1], n_keep, m) for b in range(2)]
    for b, (Y_ref, R, C, _) in enumerate(refs):
        assert np.asarray(state["retained_idx"][b]).tolist() == R
        assert np.asarray(state["candidate_idx"][b]).tolist() == C
        np.testing.assert_allclose(np.asarray(y[b])[valid[b]], Y_ref[0][valid[b]], atol=ATOL)
    for step in range(3):
        x_t = rng.normal(0, 1.0, (2, 1, d))
        y_t, state, aux = plan.decode(as_jax(W), state, jnp.asarray(x_t, jnp.float32), step, jnp.ones((x_t.shape[0], 1), bool))
        for b, (_, R, C, _) in enumerate(refs):
            y_ref, selected = ref_pop_decode(W, R, C, x_t[b : b + 1], m)
            np.testing.assert_allclose(np.asarray(y_t[b]), y_ref[0], atol=ATOL)
            if m:
                assert np.asarray(aux["selected"][b]).tolist() == selected


@pytest.mark.parametrize("aggregate", ["shared", "per_sequence"])
@pytest.mark.parametrize("f, n_keep", [(96, 67), (4, 1), (32, 31)])
def test_static_and_dynamic_match_reference(f, n_keep, aggregate):
    rng = np.random.default_rng(f + n_keep)
    d = 16
    W = random_layer(rng, d, f)
    X, valid = random_batch(rng, d, [4, 7], T=7)
    groups = [slice(0, 2)] if aggregate == "shared" else [slice(0, 1), slice(1, 2)]
    x_t = rng.normal(0, 1.0, (2, 1, d))
    for plan_cls in (StaticPlan, DynamicPlan):
        plan = plan_cls(f=f, n_keep=n_keep, aggregate=aggregate)
        y, state, _ = plan.prefill(as_jax(W), jnp.asarray(X, jnp.float32), jnp.asarray(valid))
        y_t, _, _ = plan.decode(as_jax(W), state, jnp.asarray(x_t, jnp.float32), 0, jnp.ones((x_t.shape[0], 1), bool))
        for g in groups:
            Y_ref, R, C, _ = ref_prefill(W, X[g], valid[g], n_keep, 0)  # m=0: R = top n_keep
            np.testing.assert_allclose(np.asarray(y[g])[valid[g]], Y_ref[valid[g]], atol=ATOL)
            if plan_cls is StaticPlan:
                want = ref_hidden(W, x_t[g])[..., R] @ W["down"][R]
            else:
                want = ref_dynamic_decode(W, x_t[g], n_keep)
            np.testing.assert_allclose(np.asarray(y_t[g]), want, atol=ATOL)


def ref_block_dynamic_decode(W, x, n_keep, block, order=None):
    """Dynamic by whole blocks: a block of ``block`` consecutive channels (of ``order``, a
    permutation: block k holds channels order[k·b … k·b + b − 1]; default the model's order)
    scores the L2 norm of its channels' scores; the top n_keep/block blocks (ties: the lower
    block) are kept whole."""
    H = ref_hidden(W, x)
    dn = ref_down_norms(W)
    order = list(range(H.shape[-1])) if order is None else [int(c) for c in order]
    scores = [math.sqrt(sum(H[b, 0, j] ** 2 for b in range(x.shape[0]))) * dn[j] for j in order]
    block_scores = [math.sqrt(sum(s * s for s in scores[k * block : (k + 1) * block])) for k in range(len(scores) // block)]
    keep = [order[k * block + i] for k in ref_rank(block_scores)[: n_keep // block] for i in range(block)]
    return H[..., keep] @ W["down"][keep]


@pytest.mark.parametrize("aggregate, permuted", [("shared", False), ("per_sequence", False), ("per_sequence", True)])
def test_block_dynamic_matches_reference(aggregate, permuted):
    """``Dynamic(block=b)``'s step: the top n_keep/b blocks of b consecutive channels (of the
    model's order, or of a calibrated order given as the method's data) by the L2 norm of their
    scores, each kept whole (f = 96, b = 8, n_keep = 48: 6 of 12 blocks)."""
    rng = np.random.default_rng(5)
    d, f, n_keep, block = 16, 96, 48, 8
    W = random_layer(rng, d, f)
    X, valid = random_batch(rng, d, [4, 7], T=7)
    x_t = rng.normal(0, 1.0, (2, 1, d))
    order = rng.permutation(f) if permuted else None
    w = as_jax(W, data=None if order is None else {"order": jnp.asarray(order, jnp.int32)[None]})
    plan = DynamicPlan(f=f, n_keep=n_keep, aggregate=aggregate, block=block, calibrated_order=permuted)
    _, state, _ = plan.prefill(w, jnp.asarray(X, jnp.float32), jnp.asarray(valid))
    y_t, _, _ = plan.decode(w, state, jnp.asarray(x_t, jnp.float32), 0, jnp.ones((2, 1), bool))
    for g in [slice(0, 2)] if aggregate == "shared" else [slice(0, 1), slice(1, 2)]:
        np.testing.assert_allclose(np.asarray(y_t[g]), ref_block_dynamic_decode(W, x_t[g], n_keep, block, order), atol=ATOL)
