"""Shortlisted POP (popjax/methods/pop/shortlist.py) against a plain NumPy reference, and its two
ends: σ = 0.5 is gate-scored POP, σ = 1 is POP; shortlisted dynamic selection
(pop/shortlist_dynamic.py, the same plan as shortlisted POP at γ = 1 over the unkept band)
against its reference, and σ = 1 against dynamic."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from popjax.methods import MethodError, POPPlan, make_method, method_fields
from popjax.methods.pop.gate_scored import gate_scored_plan
from popjax.methods.pop.shortlist import shortlist_plan, ShortlistPOP, ShortlistScorer
from popjax.methods.pop.shortlist_dynamic import ShortlistDynamic, shortlist_dynamic_plan
from tests.reference.ffn import as_jax, random_layer, silu
from tests.reference.ffn import ref_down_norms as dnorm
from tests.reference.ffn import ref_sizes as sizes
from tests.reference.frontier import (
    ATOL, CASES, D, group_norm, groups, jitted, random_batch, ref_partition, ref_select_and_apply, run_and_compare,
    tiny_config,
)


def shortlist_size(m, n_c, sigma):
    return min(n_c, max(m, int(math.floor(sigma * n_c + 0.5))))


def ref_shortlist_step(s):
    """A step of shortlisted POP as docs/methods.md §7.4 writes it: the top s of C by gate score
    (ties: earlier in C), then the top m of those by POP's exact score (ties: earlier in the
    shortlist)."""

    def step(W, R, C, x, m):
        G = silu(x @ W["gate"])
        H = G * (x @ W["up"])
        dn = dnorm(W)
        B = x.shape[0]
        gate = {c: math.sqrt(sum(G[b, 0, c] ** 2 for b in range(B))) * dn[c] for c in C}
        L = sorted(C, key=lambda c: (-gate[c], C.index(c)))[:s]
        exact = {c: math.sqrt(sum(H[b, 0, c] ** 2 for b in range(B))) * dn[c] for c in L}
        return ref_select_and_apply(W, R, L, x, exact, m)

    return step


@pytest.mark.parametrize("aggregate", ["shared", "per_sequence"])
@pytest.mark.parametrize("sigma", [0.6, 0.8])
@pytest.mark.parametrize("f, n_keep, gamma", CASES[:4])
def test_shortlist_matches_reference(f, n_keep, gamma, sigma, aggregate):
    rng = np.random.default_rng(f * 7 + n_keep)
    W = random_layer(rng, D, f)
    X, valid = random_batch(rng, D, [5, 8, 3], T=8)
    n_r, n_c, m = sizes(f, n_keep, gamma)
    s = shortlist_size(m, n_c, sigma)
    plan = shortlist_plan(f=f, n_keep=n_keep, m=m, s=s, aggregate=aggregate)
    run_and_compare(plan, W, X, valid, aggregate, m, ref_shortlist_step(s))
    assert plan.ffn_weights_read(D) == 3 * D * n_r + D * n_c + D * s + D * m


def assert_same_selections(plan, other, rng, steps=3):
    """The two plans select the same channels (in any order) and give the same outputs, over a
    prefill and ``steps`` decode steps on one random layer."""
    w = as_jax(random_layer(rng, D, plan.f))
    X, valid = random_batch(rng, D, [6, 4], T=6)
    states = [jitted(p)[0](w, jnp.asarray(X, jnp.float32), jnp.asarray(valid))[1] for p in (plan, other)]
    for step in range(steps):
        x_t = jnp.asarray(rng.normal(0, 1.0, (2, 1, D)), jnp.float32)
        (y1, _, a1), (y2, _, a2) = (jitted(p)[1](w, st, x_t, step, jnp.ones((2, 1), bool)) for p, st in zip((plan, other), states))
        assert sorted(np.asarray(a1["selected"]).tolist()) == sorted(np.asarray(a2["selected"]).tolist())
        np.testing.assert_allclose(np.asarray(y1), np.asarray(y2), atol=ATOL)


@pytest.mark.parametrize("sigma", [0.5, 1.0])
def test_shortlist_ends_are_gate_scored_pop_and_pop(sigma):
    """σ = 0.5 selects what gate-scored POP selects, σ = 1 what POP selects (the order within
    the selection may differ), each at the other's bytes."""
    f, n_keep, gamma = 96, 67, 0.4
    n_r, n_c, m = sizes(f, n_keep, gamma)
    plan = shortlist_plan(f=f, n_keep=n_keep, m=m, s=shortlist_size(m, n_c, sigma))
    other = (gate_scored_plan if sigma == 0.5 else POPPlan)(f=f, n_keep=n_keep, m=m)
    assert plan.ffn_weights_read(D) == other.ffn_weights_read(D)
    assert_same_selections(plan, other, np.random.default_rng(11))


def test_shortlist_method_sizes_and_errors():
    cfg = tiny_config(f=200)
    plan = ShortlistPOP(0.2, gamma=0.4, shortlist=0.75).bind(cfg)
    assert isinstance(plan.scorer, ShortlistScorer) and plan.scorer.s == round(0.75 * 2 * plan.m)
    assert make_method("pop-shortlist", ratio=0.2, gamma=0.4, shortlist=0.75).bind(cfg) == plan
    for bad in (0.4, 1.5, True):
        with pytest.raises(MethodError, match=rf"shortlist={bad!r} is outside \[0.5, 1\]"):
            ShortlistPOP(0.2, shortlist=bad)
    # POP's partition option is POP's own: the preset does not take it (no option accepted and then refused)
    assert "partition" not in method_fields("pop-shortlist")
    with pytest.raises(TypeError, match="partition"):
        ShortlistPOP(0.2, partition="per_shard")


# ------------------------------------------------------------------ shortlisted dynamic selection


def ref_shortlist_dynamic(W, X, valid, x_steps, n_keep, s, prior_kind):
    """Shortlisted dynamic selection as docs/methods.md §7.5 writes it, for one group of rows: the
    prompt output and prior, then per step the top s of all channels by ‖silu(g)‖·û·‖W_d‖ (ties:
    lower id) and the top n_keep of those by the exact score (ties: earlier in the shortlist)."""
    dn = dnorm(W)
    Y, _, _, _ = ref_partition(W, X, valid, n_keep, 0)
    G, U = silu(X @ W["gate"]), X @ W["up"]
    u_hat = {"up": group_norm(U, valid), "gated_up": group_norm(G * U, valid) / group_norm(G, valid), "none": np.ones(len(dn))}
    prior = u_hat[prior_kind] * dn
    outs = []
    for x in x_steps:
        G = silu(x @ W["gate"])
        H = G * (x @ W["up"])
        est = group_norm(G, np.ones(x.shape[:2], bool)) * prior
        L = sorted(range(len(dn)), key=lambda j: (-est[j], j))[:s]
        exact = group_norm(H, np.ones(x.shape[:2], bool)) * dn
        S = sorted(L, key=lambda c: (-exact[c], L.index(c)))[:n_keep]
        outs.append((H[..., S] @ W["down"][S], S))
    return Y, outs


@pytest.mark.parametrize("aggregate", ["shared", "per_sequence"])
@pytest.mark.parametrize("prior", ["gated_up", "up", "none"])
def test_shortlist_dynamic_matches_reference(aggregate, prior):
    f, n_keep, s = 96, 40, 61
    rng = np.random.default_rng(5 + len(prior))
    W = random_layer(rng, D, f)
    X, valid = random_batch(rng, D, [5, 8, 3], T=8)
    x_steps = [rng.normal(0, 1.0, (3, 1, D)) for _ in range(3)]
    plan = shortlist_dynamic_plan(f=f, n_keep=n_keep, s=s, prior=prior, aggregate=aggregate)
    prefill, decode = jitted(plan)
    w = as_jax(W)
    y, state, _ = prefill(w, jnp.asarray(X, jnp.float32), jnp.asarray(valid))
    got = [decode(w, state, jnp.asarray(x, jnp.float32), t, jnp.ones((3, 1), bool)) for t, x in enumerate(x_steps)]
    for g in groups(aggregate, 3):
        Y_ref, steps = ref_shortlist_dynamic(W, X[g], valid[g], [x[g] for x in x_steps], n_keep, s, prior)
        np.testing.assert_allclose(np.asarray(y[g])[valid[g]], Y_ref[valid[g]], atol=ATOL)
        for (y_t, _, aux), (y_ref, S) in zip(got, steps):
            np.testing.assert_allclose(np.asarray(y_t[g]), y_ref, atol=ATOL)
            selected = np.asarray(aux["selected"]) if aggregate == "shared" else np.asarray(aux["selected"][g.start])
            assert selected.tolist() == S
    assert plan.ffn_weights_read(D) == D * (f + s + n_keep)


def test_shortlist_dynamic_at_full_shortlist_selects_what_dynamic_selects():
    cfg = tiny_config(f=96)
    plan = ShortlistDynamic(0.3, shortlist=1.0, aggregate="shared").bind(cfg)
    dynamic = make_method("dynamic", ratio=0.3, aggregate="shared").bind(cfg)
    assert plan.scorer.s == plan.f and plan.ffn_weights_read(D) == dynamic.ffn_weights_read(D)
    rng = np.random.default_rng(3)
    w = as_jax(random_layer(rng, D, plan.f))
    X, valid = random_batch(rng, D, [6, 4], T=6)
    states = [jitted(p)[0](w, jnp.asarray(X, jnp.float32), jnp.asarray(valid))[1] for p in (plan, dynamic)]
    x_t = jnp.asarray(rng.normal(0, 1.0, (2, 1, D)), jnp.float32)
    (y1, _, a1), (y2, _, a2) = (jitted(p)[1](w, st, x_t, 0, jnp.ones((2, 1), bool)) for p, st in zip((plan, dynamic), states))
    top = np.argsort(-np.asarray(a2["scores"]))[: plan.n_keep]
    assert sorted(np.asarray(a1["selected"]).tolist()) == sorted(top.tolist())
    np.testing.assert_allclose(np.asarray(y1), np.asarray(y2), atol=ATOL)


def test_shortlist_dynamic_sizes_and_errors():
    cfg = tiny_config(f=200)
    plan = make_method("dynamic-shortlist", ratio=0.2, shortlist=0.9).bind(cfg)
    assert plan == shortlist_dynamic_plan(f=200, n_keep=plan.n_keep, s=180, prior="up", aggregate="per_sequence")
    assert plan.scorer == ShortlistScorer(s=180, prior="up") and plan.m == plan.n_keep and plan.n_retained == 0
    assert ShortlistDynamic(0.2, shortlist=0.01).bind(cfg).scorer.s == plan.n_keep  # never below n_keep
    for bad in (0, -0.5, 1.5, True):
        with pytest.raises(MethodError, match=rf"shortlist={bad!r} is outside \(0, 1\]"):
            ShortlistDynamic(0.2, shortlist=bad)
    with pytest.raises(MethodError, match=r"prior='yes' is not one of \('up', 'gated_up', 'none'\)"):
        ShortlistDynamic(0.2, prior="yes")


@pytest.mark.parametrize("aggregate", ["shared", "per_sequence"])
def test_shortlist_wide_band_with_up_prior_matches_reference(aggregate):
    """band="all" (every channel outside R a candidate) and prior="up" (the shortlist's gate
    score × the prompt's up norm per candidate), against the NumPy reference."""
    f, n_keep, gamma, sigma = 96, 67, 0.4, 0.6
    rng = np.random.default_rng(17)
    W = random_layer(rng, D, f)
    X, valid = random_batch(rng, D, [5, 8, 3], T=8)
    method = ShortlistPOP(0.2, gamma=gamma, shortlist=sigma, band="all", prior="up", aggregate=aggregate)
    plan = POPPlan(f=f, n_keep=n_keep, aggregate=aggregate, **method.plan_sizes(f, n_keep))
    n_r, m = n_keep - plan.m, plan.m
    assert plan.n_candidates == f - n_r and plan.scorer.s == shortlist_size(m, f - n_r, sigma)
    prefill, decode = jitted(plan)
    w = as_jax(W)
    y, state, _ = prefill(w, jnp.asarray(X, jnp.float32), jnp.asarray(valid))
    x_t = rng.normal(0, 1.0, (3, 1, D))
    y_t, _, aux = decode(w, state, jnp.asarray(x_t, jnp.float32), 0, jnp.ones((3, 1), bool))
    for g in groups(aggregate, 3):
        Y_ref, order, _, _ = ref_partition(W, X[g], valid[g], n_keep, m)
        np.testing.assert_allclose(np.asarray(y[g])[valid[g]], Y_ref[valid[g]], atol=ATOL)
        R, C = order[:n_r], order[n_r:]
        prior = group_norm(X[g] @ W["up"], valid[g]) * dnorm(W)
        G = silu(x_t[g] @ W["gate"])
        est = group_norm(G, np.ones((G.shape[0], 1), bool)) * prior
        L = sorted(C, key=lambda c: (-est[c], C.index(c)))[: plan.scorer.s]
        H = G * (x_t[g] @ W["up"])
        exact = {c: v for c, v in zip(range(f), group_norm(H, np.ones((H.shape[0], 1), bool)) * dnorm(W))}
        y_ref, S = ref_select_and_apply(W, R, L, x_t[g], exact, m)
        np.testing.assert_allclose(np.asarray(y_t[g]), y_ref, atol=ATOL)
        selected = np.asarray(aux["selected"]) if aggregate == "shared" else np.asarray(aux["selected"][g.start])
        assert selected.tolist() == S
    assert plan.ffn_weights_read(D) == 3 * D * n_r + D * (f - n_r) + D * plan.scorer.s + D * m


def test_shortlist_wide_band_at_gamma_one_is_shortlisted_dynamic():
    """γ = 1 with band="all" and prior="up" is ShortlistDynamic: the two presets bind to one plan
    (which selects what the removed copy-free ShortlistDynamic selected, at its bytes)."""
    cfg = tiny_config(f=96)
    wide = ShortlistPOP(0.3, gamma=1.0, shortlist=0.7, band="all", prior="up").bind(cfg)
    lean = ShortlistDynamic(0.3, shortlist=0.7).bind(cfg)
    assert wide == lean
    assert (wide.n_retained, wide.n_candidates, wide.scorer.s) == (0, wide.f, lean.scorer.s)
    assert wide.ffn_weights_read(D) == lean.ffn_weights_read(D)
    assert_same_selections(wide, lean, np.random.default_rng(23), steps=2)


def test_shortlist_band_and_prior_errors():
    with pytest.raises(MethodError, match=r"band='wide' is not one of \('pop', 'all'\)"):
        ShortlistPOP(0.2, band="wide")
    with pytest.raises(MethodError, match=r"prior='gated_up' is not one of \('none', 'up'\)"):
        ShortlistPOP(0.2, prior="gated_up")
    assert ShortlistPOP(0.2, shortlist=0.3, band="all").shortlist == 0.3  # below 0.5 only with the wide band
    with pytest.raises(MethodError, match=r"shortlist=0.3 is outside \[0.5, 1\]"):
        ShortlistPOP(0.2, shortlist=0.3)
