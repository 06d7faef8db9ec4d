"""Block-granular POP (``POP(ratio, block=b)``, popjax/methods/pop/blocks.py) against a plain NumPy
reference written here with loops: m in whole blocks, channel POP's partition, each decode
step's choice of whole blocks of consecutive candidates and its output, per batch and per
sequence; ``block=1`` is channel POP; through the engine on the tiny model; bad input in one line.
Block shortlisted POP (``ShortlistPOP(ratio, block=b)``, pop/shortlist.py) likewise: a shortlist
of whole blocks by gate score, then whole blocks of it by exact score."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

import popjax
from popjax.methods import MethodError, POPPlan, make_method
from popjax.methods.pop.blocks import BlockBand
from popjax.methods.pop.plan import ExactScorer
from popjax.methods.pop.shortlist import ShortlistScorer
from tests.reference.methods import ref_prefill
from tests.reference.ffn import as_jax, random_batch, random_layer, ref_down_norms, ref_gate, ref_hidden

ATOL = 1e-5


def ref_block_m(f: int, n_keep: int, gamma: float, b: int) -> int:
    """m in whole blocks of b (round half up), within both sides of the cut."""
    return min(math.floor(gamma * f / 2 / b + 0.5), (f - n_keep) // b, n_keep // b) * b


def ref_block_rank(per_position, b):
    """Blocks of b consecutive positions by decreasing L2 norm of their values (ties: lower first)."""
    norms = [math.sqrt(sum(per_position[k * b + i] ** 2 for i in range(b))) for k in range(len(per_position) // b)]
    return sorted(range(len(norms)), key=lambda k: (-norms[k], k))


def ref_block_decode(W, R, C, x, m, b):
    """One step, x [B, 1, d] -> (y, the selected channels in order of their blocks' scores)."""
    H, dn = ref_hidden(W, x), ref_down_norms(W)
    scores = [math.sqrt(sum(H[r, 0, c] ** 2 for r in range(x.shape[0]))) * dn[c] for c in C]
    blocks = ref_block_rank(scores, b)[: m // b]
    selected = [C[k * b + i] for k in blocks for i in range(b)]
    return sum(H[..., [j]] * W["down"][j] for j in list(R) + selected), selected


def ref_coactive_order(W, X, valid, C, b):
    """C laid out in blocks of co-active channels: each channel's prompt scores |H[t, c]|·‖W_d[:, c]‖
    over the valid tokens, unit-normed; the first channel left (C is in importance order) takes the
    b − 1 left whose profiles have the largest dot product with its own (ties: lower position)."""
    H, dn = ref_hidden(W, X), ref_down_norms(W)
    tokens = [(r, t) for r in range(X.shape[0]) for t in range(X.shape[1]) if valid[r, t]]
    profiles = [np.array([abs(H[r, t, c]) * dn[c] for r, t in tokens]) for c in C]
    unit = [p / np.linalg.norm(p) for p in profiles]
    free, order = list(range(len(C))), []
    while free:
        seed = free[0]
        others = sorted((p for p in free if p != seed), key=lambda p: (-float(unit[seed] @ unit[p]), p))
        members = sorted([seed] + others[: b - 1])
        order += members
        free = [p for p in free if p not in members]
    return [C[p] for p in order]


def _plan(f, n_keep, m, b, aggregate, order="importance"):
    return POPPlan(f=f, n_keep=n_keep, m=m, aggregate=aggregate, scorer=ExactScorer(block=b), band=BlockBand(b, order))


@pytest.mark.parametrize("f, n_keep_channels, gamma, b", [(96, 58, 0.3, 8), (96, 40, 0.5, 4), (96, 70, 0.2, 12), (64, 33, 1.0, 16)])
def test_block_pop_matches_the_reference(f, n_keep_channels, gamma, b):
    rng = np.random.default_rng(f + b)
    d = 16
    W = random_layer(rng, d, f)
    X, valid = random_batch(rng, d, [5, 8, 3], T=8)
    n_keep, m = n_keep_channels, ref_block_m(f, n_keep_channels, gamma, b)
    plan = _plan(f, n_keep, m, b, "shared")
    y, state, _ = plan.prefill(as_jax(W), jnp.asarray(X, jnp.float32), jnp.asarray(valid))
    Y_ref, R, C, _ = ref_prefill(W, X, valid, n_keep, m)  # channel POP's partition
    assert np.asarray(state["retained_idx"]).tolist() == R and np.asarray(state["candidate_idx"]).tolist() == C
    np.testing.assert_allclose(np.asarray(y)[valid], Y_ref[valid], atol=ATOL)
    for step in range(3):
        x_t = rng.normal(0, 1.0, (3, 1, d))
        y_t, state, aux = plan.decode(as_jax(W), state, jnp.asarray(x_t, jnp.float32), step, jnp.ones((3, 1), bool))
        y_ref, selected = ref_block_decode(W, R, C, x_t, m, b)
        np.testing.assert_allclose(np.asarray(y_t), y_ref, atol=ATOL)
        if m:
            assert np.asarray(aux["selected"]).tolist() == selected
            blocks = [[C.index(c) for c in selected[i : i + b]] for i in range(0, m, b)]
            assert all(p == list(range(p[0], p[0] + b)) and p[0] % b == 0 for p in blocks)  # whole blocks of C


@pytest.mark.parametrize("f, n_keep, gamma, b, aggregate", [(96, 58, 0.3, 8, "shared"), (96, 40, 0.5, 4, "per_sequence")])
def test_coactivation_order_matches_the_reference(f, n_keep, gamma, b, aggregate):
    """``block_order="coactivation"``: the partition is channel POP's, C is copied in the
    reference's co-activation blocks, and a step selects whole blocks of that layout."""
    rng = np.random.default_rng(f + b + 1)
    d = 16
    W = random_layer(rng, d, f)
    X, valid = random_batch(rng, d, [7, 4], T=7)
    m = ref_block_m(f, n_keep, gamma, b)
    plan = _plan(f, n_keep, m, b, aggregate, order="coactivation")
    _, state, _ = plan.prefill(as_jax(W), jnp.asarray(X, jnp.float32), jnp.asarray(valid))
    x_t = rng.normal(0, 1.0, (2, 1, d))
    y_t, _, aux = plan.decode(as_jax(W), state, jnp.asarray(x_t, jnp.float32), 0, jnp.ones((2, 1), bool))
    rows = [slice(0, 2)] if aggregate == "shared" else [slice(0, 1), slice(1, 2)]
    for r, row in enumerate(rows):
        _, R, C, _ = ref_prefill(W, X[row], valid[row], n_keep, m)
        laid_out = ref_coactive_order(W, X[row], valid[row], C, b)
        got = state["candidate_idx"] if aggregate == "shared" else state["candidate_idx"][r]
        assert sorted(laid_out) == sorted(C) and laid_out != C and np.asarray(got).tolist() == laid_out
        y_ref, selected = ref_block_decode(W, R, laid_out, x_t[row], m, b)
        np.testing.assert_allclose(np.asarray(y_t[row]), y_ref, atol=ATOL)
        assert np.asarray(aux["selected"] if aggregate == "shared" else aux["selected"][r]).tolist() == selected


@pytest.mark.parametrize("ratio, gamma, b", [(0.2, 0.1, 4), (0.4, 0.1, 8), (0.4, 0.3, 16), (0.1, 0.5, 12), (0.4, 0.2, 5)])
def test_m_is_whole_blocks(tiny_model, ratio, gamma, b):
    """n_keep is channel POP's; m (and n_C = 2m) whole blocks."""
    cfg = tiny_model.config
    channel = popjax.POP(ratio, gamma=gamma).bind(cfg)
    plan = popjax.POP(ratio, gamma=gamma, block=b).bind(cfg)
    m = ref_block_m(cfg.intermediate_size, channel.n_keep, gamma, b)
    assert (plan.n_keep, plan.m, plan.n_candidates) == (channel.n_keep, m, 2 * m) and m % b == 0 and m > 0


def test_per_sequence_block_pop_is_each_row_alone():
    rng = np.random.default_rng(5)
    f, d, b = 96, 16, 8
    W = random_layer(rng, d, f)
    X, valid = random_batch(rng, d, [6, 2], T=6)
    plan = _plan(f, 56, 16, b, "per_sequence")
    y, state, _ = plan.prefill(as_jax(W), jnp.asarray(X, jnp.float32), jnp.asarray(valid))
    x_t = rng.normal(0, 1.0, (2, 1, d))
    y_t, _, aux = plan.decode(as_jax(W), state, jnp.asarray(x_t, jnp.float32), 0, jnp.ones((2, 1), bool))
    for r in range(2):
        Y_ref, R, C, _ = ref_prefill(W, X[r : r + 1], valid[r : r + 1], 56, 16)
        assert np.asarray(state["retained_idx"][r]).tolist() == R
        np.testing.assert_allclose(np.asarray(y[r])[valid[r]], Y_ref[0][valid[r]], atol=ATOL)
        y_ref, selected = ref_block_decode(W, R, C, x_t[r : r + 1], 16, b)
        np.testing.assert_allclose(np.asarray(y_t[r]), y_ref[0], atol=ATOL)
        assert np.asarray(aux["selected"][r]).tolist() == selected


def test_block_one_is_channel_pop_and_blocks_generate(tiny_model):
    cfg = tiny_model.config
    assert popjax.POP(0.4, block=1).bind(cfg) == popjax.POP(0.4).bind(cfg)
    method = make_method("pop", ratio=0.4, block=8)  # the registry spec "pop:block=8"
    plan = method.bind(cfg)
    assert plan.m % 8 == 0 and plan.m > 0
    ids, trace = popjax.generate_ids(tiny_model, [[5, 6, 7, 8], [9, 10]], max_new_tokens=4, method=method,
                                     ignore_eos=True, return_trace=True)
    assert [len(row) for row in ids] == [4, 4]
    selected = np.asarray(trace["decode"]["selected"])  # [steps, L, B, m]: channel ids, whole blocks of C
    candidates = np.asarray(trace["partition"]["candidate_idx"])  # [L, B, n_C]
    assert selected.shape[-1] == plan.m
    for step in selected:
        for l, layer in enumerate(step):
            for row, ids in enumerate(layer):
                positions = [list(candidates[l, row]).index(c) for c in ids]
                blocks = [positions[i : i + 8] for i in range(0, plan.m, 8)]
                assert all(p == list(range(p[0], p[0] + 8)) and p[0] % 8 == 0 for p in blocks)


@pytest.mark.parametrize("kwargs, message", [
    (dict(block=0), r"^block=0 is invalid; use a positive integer"),
    (dict(block=True), r"^block=True is invalid"),
    (dict(block=8, partition="per_shard"), r"^block=8 applies to partition='global' only"),
    (dict(block=4096), r"^block=4096 is wider than POP's band here \(m=\d+ candidates chosen per step for gamma=0.1"),
    (dict(block=8, block_order="random"), r"^block_order='random' is not one of \('importance', 'coactivation'\)"),
    (dict(block_order="coactivation"), r"^block_order='coactivation' applies to block > 1 \(block=1\)"),
])
def test_bad_blocks_are_one_line(tiny_model, kwargs, message):
    with pytest.raises(MethodError, match=message):
        popjax.POP(0.4, **kwargs).bind(tiny_model.config)


# ------------------------------------------------------------------ block shortlisted POP


def ref_block_shortlist_decode(W, R, C, x, m, s, b):
    """One step of block shortlisted POP: the top s/b blocks of C by the L2 norm of their gate
    scores ‖silu(G[:, c])‖·‖W_d[:, c]‖ form the shortlist L (in block rank order); the top m/b
    blocks of L (b consecutive positions of L) by their exact scores are selected."""
    G, H, dn = ref_gate(W, x), ref_hidden(W, x), ref_down_norms(W)
    rows = range(x.shape[0])
    gate = [math.sqrt(sum(G[r, 0, c] ** 2 for r in rows)) * dn[c] for c in C]
    L = [C[k * b + i] for k in ref_block_rank(gate, b)[: s // b] for i in range(b)]
    exact = [math.sqrt(sum(H[r, 0, c] ** 2 for r in rows)) * dn[c] for c in L]
    selected = [L[k * b + i] for k in ref_block_rank(exact, b)[: m // b] for i in range(b)]
    return sum(H[..., [j]] * W["down"][j] for j in list(R) + selected), selected


@pytest.mark.parametrize("f, n_keep, gamma, sigma, b, aggregate, order", [
    (96, 58, 0.5, 0.75, 4, "shared", "importance"), (96, 40, 0.7, 0.6, 8, "per_sequence", "importance"),
    (64, 33, 1.0, 0.8, 4, "shared", "importance"), (96, 40, 0.7, 0.6, 8, "per_sequence", "coactivation"),
])
def test_block_shortlist_matches_the_reference(f, n_keep, gamma, sigma, b, aggregate, order):
    rng = np.random.default_rng(f + 3 * b)
    d = 16
    W = random_layer(rng, d, f)
    X, valid = random_batch(rng, d, [6, 3], T=6)
    m = ref_block_m(f, n_keep, gamma, b)
    s = min(2 * m, max(m, math.floor(sigma * 2 * m / b + 0.5) * b))
    assert m < s < 2 * m  # both stages choose
    plan = POPPlan(f=f, n_keep=n_keep, m=m, aggregate=aggregate, scorer=ShortlistScorer(s, "none", block=b), band=BlockBand(b, order))
    sizes = popjax.ShortlistPOP(0.5, gamma=gamma, shortlist=sigma, block=b, block_order=order, kernel="xla").plan_sizes(f, n_keep)
    assert (sizes["m"], sizes["scorer"], sizes["band"]) == (m, plan.scorer, plan.band)  # the preset binds to this plan
    _, state, _ = plan.prefill(as_jax(W), jnp.asarray(X, jnp.float32), jnp.asarray(valid))
    rows = [slice(0, 2)] if aggregate == "shared" else [slice(0, 1), slice(1, 2)]
    for step in range(2):
        x_t = rng.normal(0, 1.0, (2, 1, d))
        y_t, state, aux = plan.decode(as_jax(W), state, jnp.asarray(x_t, jnp.float32), step, jnp.ones((2, 1), bool))
        for r, row in enumerate(rows):
            _, R, C, _ = ref_prefill(W, X[row], valid[row], n_keep, m)
            if order == "coactivation":
                C = ref_coactive_order(W, X[row], valid[row], C, b)
            y_ref, selected = ref_block_shortlist_decode(W, R, C, x_t[row], m, s, b)
            np.testing.assert_allclose(np.asarray(y_t[row]), y_ref, atol=ATOL)
            got = aux["selected"] if aggregate == "shared" else aux["selected"][r]
            assert np.asarray(got).tolist() == selected


def test_block_shortlist_sizes_and_bad_input(tiny_model):
    """m is block POP's, s = round(σ·n_C/b)·b within [m, n_C]; blocks apply to POP's band only."""
    cfg = tiny_model.config
    plan = make_method("pop-shortlist", ratio=0.4, gamma=0.5, shortlist=0.75, block=8).bind(cfg)  # "pop-shortlist:block=8"
    channel = popjax.ShortlistPOP(0.4, gamma=0.5).bind(cfg)
    m = ref_block_m(cfg.intermediate_size, channel.n_keep, 0.5, 8)
    assert (plan.n_keep, plan.m, plan.n_candidates, plan.scorer.block) == (channel.n_keep, m, 2 * m, 8)
    assert plan.scorer.s == min(2 * m, max(m, math.floor(0.75 * 2 * m / 8 + 0.5) * 8)) and plan.scorer.s % 8 == 0
    assert popjax.ShortlistPOP(0.4, gamma=0.5, block=1).bind(cfg) == channel
    with pytest.raises(MethodError, match=r"^block=8 applies to band='pop' only \(band='all'\)$"):
        popjax.ShortlistPOP(0.4, band="all", block=8)
    with pytest.raises(MethodError, match=r"^block=0 is invalid"):
        popjax.ShortlistPOP(0.4, block=0)
    with pytest.raises(MethodError, match=r"^block=4096 is wider than POP's band here"):
        popjax.ShortlistPOP(0.4, block=4096).bind(cfg)
    with pytest.raises(MethodError, match=r"^block_order='coactivation' applies to block > 1 \(block=1\)$"):
        popjax.ShortlistPOP(0.4, block_order="coactivation")
