"""Gate-scored, low-rank-scored and per-layer-band POP (issue 15) against plain NumPy references
written independently here (loops, float64); popjax runs fp32 JAX. Selections must agree exactly,
outputs within 1e-5.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import popjax
from popjax.methods import MethodError, POPPlan, make_method, method_fields
from popjax.methods.pop.gate_scored import gate_scored_plan, GateScoredPOP
from popjax.methods.pop.layer_bands import BandDrift, layer_bands_plan, LayerBandsPOP, allocate_bands, prompt_drift
from popjax.methods.pop.low_rank import lowrank_plan, LowRankPOP, factors_from_weights, lowrank_data, lowrank_factors
from tests.reference.ffn import as_jax, random_layer, silu
from tests.reference.ffn import ref_down_norms as dnorm
from tests.reference.ffn import ref_rank as rank_desc
from tests.reference.ffn import ref_sizes as sizes
from tests.reference.frontier import (
    ATOL, CASES, D, group_norm, jitted, random_batch, ref_gate_step, ref_lowrank_step, ref_select_and_apply, run_and_compare,
    tiny_config,
)


# ------------------------------------------------------------------ gate-scored


@pytest.mark.parametrize("aggregate", ["shared", "per_sequence"])
@pytest.mark.parametrize("f, n_keep, gamma", CASES)
def test_gate_scored_matches_reference(f, n_keep, gamma, aggregate):
    rng = np.random.default_rng(f * 31 + n_keep)
    W = random_layer(rng, D, f)
    X, valid = random_batch(rng, D, [5, 8, 3], T=8)
    n_r, n_c, m = sizes(f, n_keep, gamma)
    plan = gate_scored_plan(f=f, n_keep=n_keep, m=m, aggregate=aggregate)
    run_and_compare(plan, W, X, valid, aggregate, m, ref_gate_step)
    assert plan.ffn_weights_read(D) == 3 * D * n_r + D * n_c + 2 * D * m
    assert plan.ffn_flops_per_token(D) == 2 * plan.ffn_weights_read(D)


def test_gate_scored_over_all_channels_is_dynamic_by_gate_score():
    f, n_keep = 64, 32  # γ = 1 with n_keep = f/2: no retained, no pruned channel
    rng = np.random.default_rng(3)
    W = random_layer(rng, D, f)
    X, valid = random_batch(rng, D, [6, 4], T=6)
    plan = gate_scored_plan(f=f, n_keep=n_keep, m=32)
    assert (plan.n_retained, plan.n_candidates) == (0, f)
    w = as_jax(W)
    prefill, decode = jitted(plan)
    _, state, _ = prefill(w, jnp.asarray(X, jnp.float32), jnp.asarray(valid))
    x_t = rng.normal(0, 1.0, (2, 1, D))
    y_t, _, aux = decode(w, state, jnp.asarray(x_t, jnp.float32), 0, jnp.ones((2, 1), bool))
    # dynamic selection by the gate score over every channel, no prompt involved
    G = silu(x_t @ W["gate"])
    score = [math.sqrt(G[0, 0, j] ** 2 + G[1, 0, j] ** 2) * dnorm(W)[j] for j in range(f)]
    keep = rank_desc(score)[:n_keep]
    H = silu(x_t @ W["gate"]) * (x_t @ W["up"])
    np.testing.assert_allclose(np.asarray(y_t), H[..., keep] @ W["down"][keep], atol=ATOL)
    assert np.asarray(aux["selected"]).tolist() == keep


def test_gate_scored_reads_pops_bytes_at_twice_the_band():
    cfg = tiny_config(f=200)  # γ·f/2 = 10 and 20 exactly
    pop = popjax.POP(0.2, gamma=0.1).bind(cfg)
    gate = GateScoredPOP(0.2, gamma=0.2).bind(cfg)
    assert gate.m == 2 * pop.m
    assert gate.ffn_weights_read(D) == pop.ffn_weights_read(D)


# ------------------------------------------------------------------ low-rank


def lowrank_setup(W, f, n_keep, gamma, rank, project, aggregate, layers=1):
    """-> (plan, m, the factors as the method's data)."""
    Ws = [W] * layers
    factors = factors_from_weights([np.stack([w["gate"].T, w["up"].T]) for w in Ws], rank)
    _, _, m = sizes(f, n_keep, gamma)
    return lowrank_plan(f=f, n_keep=n_keep, m=m, aggregate=aggregate, rank=rank, project=project), m, lowrank_data(factors)


@pytest.mark.parametrize("project", ["gate_up", "gate"])
@pytest.mark.parametrize("aggregate", ["shared", "per_sequence"])
@pytest.mark.parametrize("f, n_keep, gamma, rank", [(96, 67, 0.4, 4), (96, 48, 0.5, 9), (4, 2, 1.0, 2), (96, 60, 0.0, 3)])
def test_lowrank_matches_reference(f, n_keep, gamma, rank, aggregate, project):
    rng = np.random.default_rng(f + n_keep + rank)
    W = random_layer(rng, D, f)
    X, valid = random_batch(rng, D, [5, 8], T=8)
    plan, m, data = lowrank_setup(W, f, n_keep, gamma, rank, project, aggregate)
    assert plan.requires_data
    step = lambda W_, R, C, x, m_: ref_lowrank_step(W_, R, C, x, m_, rank, project)
    run_and_compare(plan, W, X, valid, aggregate, m, step, data=data)
    k = 2 if project == "gate_up" else 1
    want = 3 * D * n_keep + (k * rank * (D + 2 * m) if m else 0)
    assert plan.ffn_weights_read(D) == want


def test_lowrank_at_full_rank_gives_pops_exact_scores():
    f, n_keep, gamma = 96, 60, 0.4
    rng = np.random.default_rng(11)
    W = random_layer(rng, D, f)
    X, valid = random_batch(rng, D, [7, 4], T=7)
    plan, m, data = lowrank_setup(W, f, n_keep, gamma, D, "gate_up", "shared")  # rank = min(d, f)
    pop = POPPlan(f=f, n_keep=n_keep, m=m)
    w = as_jax(W, data=data)
    args = (jnp.asarray(X, jnp.float32), jnp.asarray(valid))
    (p_low, d_low), (p_pop, d_pop) = jitted(plan), jitted(pop)
    (_, s_low, _), (_, s_pop, _) = p_low(w, *args), p_pop(w, *args)
    for step in range(3):
        x_t = jnp.asarray(rng.normal(0, 1.0, (2, 1, D)), jnp.float32)
        y_low, s_low, a_low = d_low(w, s_low, x_t, step, jnp.ones((2, 1), bool))
        y_pop, s_pop, a_pop = d_pop(w, s_pop, x_t, step, jnp.ones((2, 1), bool))
        assert np.asarray(a_low["selected"]).tolist() == np.asarray(a_pop["selected"]).tolist()
        np.testing.assert_allclose(np.asarray(a_low["scores"]), np.asarray(a_pop["scores"]), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(np.asarray(y_low), np.asarray(y_pop), atol=ATOL)


@pytest.mark.parametrize("rank", [0, -3, 17, 2.5, True])
def test_lowrank_bad_rank_is_an_error_naming_it(rank):
    W = random_layer(np.random.default_rng(0), D, 96)
    with pytest.raises(MethodError, match=f"rank={rank}"):
        if isinstance(rank, int) and not isinstance(rank, bool) and rank > 0:
            LowRankPOP(0.2, rank=rank).bind(tiny_config())  # 17 > min(d=16, f=96)
        else:
            LowRankPOP(0.2, rank=rank)
    if rank == 17:
        with pytest.raises(MethodError, match="rank=17 exceeds min"):
            factors_from_weights([np.stack([W["gate"].T, W["up"].T])], 17)


@pytest.mark.parametrize("name", ["pop-gate", "pop-lowrank", "pop-shortlist", "pop-bands"])
def test_pop_presets_take_only_the_options_they_implement(name):
    """POP's partition and weights options are POP's own (its exact scorer): the other presets
    do not take them, rather than take them and refuse them at run time."""
    assert {"partition", "shards", "weights"} <= method_fields("pop")
    assert not {"partition", "shards", "weights"} & method_fields(name)
    with pytest.raises(MethodError, match="partition"):
        make_method(name, ratio=0.2, partition="per_shard")


def test_lowrank_other_errors():
    with pytest.raises(MethodError, match="project='up'"):
        LowRankPOP(0.2, project="up")
    with pytest.raises(MethodError, match="prepare"):
        LowRankPOP(0.2, rank=4).bind(tiny_config())
    W = random_layer(np.random.default_rng(0), D, 96)
    factors = factors_from_weights([np.stack([W["gate"].T, W["up"].T])], 4)
    with pytest.raises(MethodError, match="do not fit"):
        LowRankPOP(0.2, rank=4, factors=factors).bind(tiny_config())  # 1 layer of factors, 3 layers


# ------------------------------------------------------------------ per-layer bands


def ref_drift(W, X, valid, n_keep):
    H = silu(X @ W["gate"]) * (X @ W["up"])
    first, second = np.zeros_like(valid), np.zeros_like(valid)
    for b in range(X.shape[0]):
        ids = [t for t in range(X.shape[1]) if valid[b, t]]
        for p, t in enumerate(ids):
            (first if p < len(ids) / 2 else second)[b, t] = True
    dn = dnorm(W)
    a = set(rank_desc(group_norm(H, first) * dn)[:n_keep])
    c = set(rank_desc(group_norm(H, second) * dn)[:n_keep])
    return 1.0 - len(a & c) / n_keep


def ref_allocate(drift, m, cap, levels):
    widths = sorted({min(int(math.floor(c * m + 0.5)), cap) for c in levels})
    L = len(drift)
    total = sum(drift)
    target = [L * m * x / total if total > 0 else m for x in drift]
    cur = [0] * L
    while True:
        best = None
        for l in range(L):
            if cur[l] + 1 < len(widths):
                cost = widths[cur[l] + 1] - widths[cur[l]]
                if sum(widths[c] for c in cur) + cost <= L * m:
                    key = target[l] - widths[cur[l]]
                    if best is None or key > best[0]:
                        best = (key, l)
        if best is None:
            return [widths[c] for c in cur]
        cur[best[1]] += 1


def test_prompt_drift_matches_reference():
    rng = np.random.default_rng(5)
    W = random_layer(rng, D, 48)
    X, valid = random_batch(rng, D, [7, 4], T=8)
    w = as_jax(W)
    from popjax.methods.base import activations

    h = activations(w.gate_up, jnp.asarray(X, jnp.float32))
    for n_keep in (10, 30):
        got = float(jax.jit(prompt_drift, static_argnums=3)(h, jnp.asarray(valid), w.down_norm, n_keep))
        assert got == pytest.approx(ref_drift(W, X, valid, n_keep), abs=1e-6)
    stat = jax.jit(BandDrift(n_keep=30).collect)(w, jnp.asarray(X, jnp.float32), jnp.asarray(valid), h)
    per_prompt = [ref_drift(W, X[b : b + 1], valid[b : b + 1], 30) for b in range(2)]
    assert float(stat["drift"]) == pytest.approx(sum(per_prompt), abs=1e-6) and int(stat["prompts"]) == 2


@pytest.mark.parametrize("seed", range(4))
def test_allocation_matches_reference_and_meets_the_budget(seed):
    rng = np.random.default_rng(seed)
    drift = rng.uniform(0, 1, 7) ** 2
    m, cap = 10, 25
    bands = allocate_bands(drift, m, cap)
    assert list(bands) == ref_allocate(list(drift), m, cap, (0.0, 0.5, 1.0, 1.5, 2.0, 3.0))
    assert sum(bands) <= 7 * m and max(bands) <= cap
    assert bands[int(np.argmax(drift))] >= bands[int(np.argmin(drift))]
    assert allocate_bands(np.full(7, 0.3), m, cap) == (m,) * 7  # equal drift: POP's bands


@pytest.mark.parametrize("aggregate", ["shared", "per_sequence"])
def test_layer_bands_match_reference_per_layer(aggregate):
    f, n_keep, bands = 96, 60, (0, 14, 5)
    rng = np.random.default_rng(9)
    plan = layer_bands_plan(f=f, n_keep=n_keep, m=10, bands=bands, aggregate=aggregate)
    assert plan.ffn_weights_read(D) == round(np.mean([3 * D * n_keep + 2 * D * b for b in bands]))
    for layer, m_l in enumerate(bands):
        W = random_layer(rng, D, f)
        X, valid = random_batch(rng, D, [6, 3], T=6)
        state = run_and_compare(plan, W, X, valid, aggregate, m_l, ref_pop_step, layer=layer, seed=layer)
        assert state["band_gate_up"].shape[-3:] == (2 * max(bands), 2, D)  # the same for every layer
        assert state["core_gate_up"].shape[-3:] == (2, n_keep - max(bands), D)


def ref_pop_step(W, R, C, x, m):
    H = silu(x @ W["gate"]) * (x @ W["up"])
    dn = dnorm(W)
    scores = {c: math.sqrt(sum(H[b, 0, c] ** 2 for b in range(x.shape[0]))) * dn[c] for c in C}
    return ref_select_and_apply(W, R, C, x, scores, m)


def test_layer_bands_errors():
    cfg = tiny_config()
    with pytest.raises(MethodError, match="levels=\\(2.0, 3.0\\)"):
        LayerBandsPOP(0.2, levels=(2.0, 3.0))
    with pytest.raises(MethodError, match="levels=\\(\\)"):
        LayerBandsPOP(0.2, levels=())
    with pytest.raises(MethodError, match="prepare"):
        LayerBandsPOP(0.2).bind(cfg)
    with pytest.raises(MethodError, match="drift has 2 layers"):
        LayerBandsPOP(0.2).with_drift([0.1, 0.2]).bind(cfg)
    with pytest.raises(MethodError, match="drift="):
        LayerBandsPOP(0.2).with_drift([0.1, -1.0, 0.2])
    from popjax.methods.pop.layer_bands import BandAllocation

    with pytest.raises(MethodError, match="POP's budget"):
        LayerBandsPOP(0.2, gamma=0.1, allocation=BandAllocation((10, 10, 10))).bind(cfg)  # m = 5


# ------------------------------------------------------------------ through the engine


@pytest.mark.slow  # calibrates, prepares and generates with three methods
def test_methods_run_through_the_engine_and_lowrank_factors_are_cached(tiny_model, tmp_path):
    from popjax.cache import list_entries
    from popjax.calibration import Corpus
    from popjax.generation import generate_ids

    corpus = Corpus.from_token_ids("tiny", np.random.default_rng(0).integers(3, 160, 512), window=32)
    prompts = [[5, 9, 33, 17, 80, 41, 12], [7, 3, 99]]
    methods = [
        make_method("pop-gate", ratio=0.2, gamma=0.3, aggregate="per_sequence"),
        LowRankPOP(0.2, gamma=0.3, rank=8).prepare(tiny_model),
        LayerBandsPOP(0.2, gamma=0.3).prepare(tiny_model, corpus=corpus),
    ]
    for method in methods:
        out, trace = generate_ids(tiny_model, prompts, max_new_tokens=5, method=method, ignore_eos=True, return_trace=True)
        assert [len(o) for o in out] == [5, 5]
    assert len(methods[2].allocation.drift) == tiny_model.config.num_hidden_layers
    a = lowrank_factors(tiny_model, 8, cache_dir=tmp_path)
    b = lowrank_factors(tiny_model, 8, cache_dir=tmp_path)  # from the cache entry (popjax.cache, kind "calibration")
    entries = [e for e in list_entries(tmp_path) if e.kind == "calibration"]
    assert len(entries) == 1 and entries[0].key.startswith("lowrank-svd-r8-") and a == b
    np.testing.assert_array_equal(a.outputs, b.outputs)
