"""WINA and GLASS (docs/methods.md §5.9, §5.10) against plain NumPy references written here.

The plans run directly (no engine) on random layers: WINA's per-token and batch-shared top-k
masks and its output, GLASS's aggregated ranking, kept channels and decode. The methods then run
through the engine on the tiny model: WINA's column norms and GLASS's global prior equal their
NumPy counterparts, GLASS with λ = 1 selects what GRIFFIN selects, and bad hyper-parameters give
one clear line. Selections must agree exactly, values within 1e-5.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from popjax import engine
from popjax.calibration import Corpus
from popjax.requests import pad_batch
from popjax.methods import GLASS, GRIFFIN, WINA, GLASSPlan, MethodError, WINAPlan, make_method
from popjax.methods.glass import GlobalPrior
from popjax.methods.wina import ColumnNorms
from tests.reference.ffn import as_jax, random_batch, random_layer, ref_hidden, ref_rank, ref_top_k

ATOL = 1e-5


# ------------------------------------------------------------------ WINA


def ref_wina_decode(W, x, valid, k_x, n_keep, aggregate, weight_norms):
    """x [B, 1, d] -> y [B, 1, d] by WINA's rule, with loops over float64 copies."""
    d, f = W["gate"].shape
    c = np.array([math.sqrt(sum(W["gate"][i, j] ** 2 + W["up"][i, j] ** 2 for j in range(f))) for i in range(d)])
    down_norm = np.array([math.sqrt(sum(v * v for v in W["down"][j])) for j in range(f)])
    B = x.shape[0]

    def masks(scores, k):  # scores [B, n] -> list of kept sets per row
        if aggregate == "per_token":
            return [ref_top_k(scores[b], k) for b in range(B)]
        rows = [scores[b] for b in range(B) if valid[b, 0]]
        agg = np.max(rows, axis=0) if aggregate == "max" else np.sum(rows, axis=0) / max(len(rows), 1)
        return [ref_top_k(agg, k)] * B

    sx = np.abs(x[:, 0]) * c
    keep_x = masks(sx, k_x)
    xs = np.array([[x[b, 0, i] if i in keep_x[b] else 0.0 for i in range(d)] for b in range(B)])
    H = ref_hidden(W, xs)
    sh = np.abs(H) * (down_norm if weight_norms == "both" else 1.0)
    keep_h = masks(sh, n_keep)
    Hs = np.array([[H[b, j] if j in keep_h[b] else 0.0 for j in range(f)] for b in range(B)])
    return (Hs @ W["down"])[:, None], c


@pytest.mark.parametrize("weight_norms", ["both", "x"])
@pytest.mark.parametrize("aggregate", ["per_token", "max", "mean"])
@pytest.mark.parametrize("f, n_keep, k_x", [(96, 40, 9), (32, 1, 1), (24, 24, 16)])
def test_wina_matches_reference(f, n_keep, k_x, aggregate, weight_norms):
    rng = np.random.default_rng(f + n_keep + k_x)
    d = 16
    W = random_layer(rng, d, f)
    plan = WINAPlan(f=f, n_keep=n_keep, k_x=k_x, aggregate=aggregate, weight_norms=weight_norms)
    x = rng.normal(0, 1.0, (3, 1, d)) * rng.uniform(0.3, 2.0, (3, 1, d))
    valid = np.array([[True], [False], [True]])
    want, c = ref_wina_decode(W, x, valid, k_x, n_keep, aggregate, weight_norms)
    w = as_jax(W, data={"wina": {"x_norm": jnp.asarray(c[None], jnp.float32)}})
    y, _, _ = jax.jit(plan.decode)(w, None, jnp.asarray(x, jnp.float32), 0, jnp.asarray(valid))
    rows = [0, 2] if aggregate != "per_token" else [0, 1, 2]  # a shared mask: the invalid row is not compared
    np.testing.assert_allclose(np.asarray(y)[rows], want[rows], atol=ATOL)
    X, pvalid = random_batch(rng, d, [5, 3], T=6)
    y_p, _, _ = plan.prefill(as_jax(W), jnp.asarray(X, jnp.float32), jnp.asarray(pvalid))
    np.testing.assert_allclose(np.asarray(y_p)[pvalid], (ref_hidden(W, X) @ W["down"])[pvalid], atol=ATOL)  # dense prompt
    assert plan.ffn_weights_read(d) == 2 * f * k_x + d * n_keep


def test_wina_weight_norm_changes_the_selection():
    """Equal activations: weight_norms="both" keeps the channel with the largest down column,
    "x" (|H| alone) the lowest channel id of the tie."""
    d, f = 4, 6
    W = {"gate": np.ones((d, f)), "up": np.ones((d, f)), "down": np.ones((f, d)), "act": "silu"}
    W["down"][3] *= 100.0
    x = np.ones((1, 1, d))
    outs = {}
    for norms in ("both", "x"):
        want, c = ref_wina_decode(W, x, np.ones((1, 1), bool), d, 1, "per_token", norms)
        w = as_jax(W, data={"wina": {"x_norm": jnp.asarray(c[None], jnp.float32)}})
        y, _, _ = WINAPlan(f=f, n_keep=1, k_x=d, weight_norms=norms).decode(w, None, jnp.asarray(x, jnp.float32), 0, jnp.ones((1, 1), bool))
        np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5)
        outs[norms] = np.asarray(y)
    H = ref_hidden(W, x[0, 0])
    np.testing.assert_allclose(outs["both"][0, 0], H[3] * W["down"][3], rtol=1e-5)
    np.testing.assert_allclose(outs["x"][0, 0], H[0] * W["down"][0], rtol=1e-5)


def test_wina_on_the_tiny_model(tiny_model):
    """Column norms from the model's weights; the budget (TEAL's sparsity on both inputs); the
    engine's log-probabilities finite; errors name the value."""
    model = tiny_model
    cfg = model.config
    method = WINA(0.3).prepare(model)
    params = {int(i): l for i, l in nnx.to_pure_dict(model.params)["layers"].items()}
    for l in range(cfg.num_hidden_layers):
        g = np.asarray(params[l]["mlp"]["gate_up"], np.float64)
        np.testing.assert_allclose(method.norms.norms[l], np.sqrt((g ** 2).sum(axis=(0, 1))), rtol=1e-6)
    plan = method.bind(cfg)
    s = 1.0 - plan.n_keep / cfg.intermediate_size
    assert plan.k_x == round(cfg.hidden_size * (1 - s))
    assert method.prepare(model) is method  # prepared once
    tokens, mask = pad_batch([[5, 17, 3, 9, 4], [8, 9, 10]], 0)
    nll, _, _ = engine.teacher_force(model.graphdef, model.params, plan, jnp.asarray(tokens), jnp.asarray(mask),
                                     jnp.asarray([[1, 2, 3], [4, 5, 6]]), data=method.data(model))
    assert np.all(np.isfinite(np.asarray(nll)))
    with pytest.raises(MethodError, match="prepare"):
        WINA(0.3).bind(cfg)
    with pytest.raises(MethodError, match="weight_norms='all' is not one of"):
        WINA(0.3, weight_norms="all")
    with pytest.raises(MethodError, match="aggregate='shared' is not one of"):
        WINA(0.3, aggregate="shared")
    with pytest.raises(MethodError, match="give ratio=0.3 or ffn_sparsity=0.5, not both"):
        make_method("wina", ratio=0.3, ffn_sparsity=0.5)
    bad = dataclasses.replace(method, norms=ColumnNorms("other", np.zeros((1, cfg.hidden_size), np.float32)))
    with pytest.raises(MethodError, match="do not fit this model"):
        bad.bind(cfg)


# ------------------------------------------------------------------ GLASS


def ref_griffin(H, valid):
    f = H.shape[-1]
    s = np.zeros(f)
    for b in range(H.shape[0]):
        for t in range(H.shape[1]):
            if valid[b, t]:
                norm = math.sqrt(sum(v * v for v in H[b, t]))
                if norm > 0:
                    for j in range(f):
                        s[j] += (H[b, t, j] / norm) ** 2
    return np.sqrt(s)


def ref_glass_kept(local, prior, lam, n_keep):
    f = len(local)
    r_local, r_prior = np.zeros(f), np.zeros(f)
    for pos, j in enumerate(ref_rank(list(local))):
        r_local[j] = pos
    for pos, j in enumerate(ref_rank(list(prior))):
        r_prior[j] = pos
    w_local = round(lam * 1024)  # λ in integer steps of 1/1024: exact ties, broken by channel id
    R = [w_local * int(r_local[j]) + (1024 - w_local) * int(r_prior[j]) for j in range(f)]
    return sorted(range(f), key=lambda j: (R[j], j))[:n_keep]


@pytest.mark.parametrize("score", ["activation", "impact"])
@pytest.mark.parametrize("lam", [0.0, 0.5, 0.8, 1.0])
@pytest.mark.parametrize("aggregate", ["shared", "per_sequence"])
def test_glass_matches_reference(aggregate, lam, score):
    rng = np.random.default_rng(int(lam * 10) + len(score))
    d, f, n_keep = 16, 48, 20
    W = random_layer(rng, d, f)
    prior = rng.uniform(0.1, 3.0, f)
    X, valid = random_batch(rng, d, [5, 8, 2], T=8, varied_norms=True)
    plan = GLASSPlan(f=f, n_keep=n_keep, aggregate=aggregate, lam=lam, score=score)
    w = as_jax(W, data={"glass": {"prior": jnp.asarray(prior[None], jnp.float32)}})
    y, state, _ = jax.jit(plan.prefill)(w, jnp.asarray(X, jnp.float32), jnp.asarray(valid))
    H = ref_hidden(W, X)
    np.testing.assert_allclose(np.asarray(y)[valid], (H @ W["down"])[valid], atol=ATOL)  # the prompt runs dense
    down_norm = np.sqrt((W["down"] ** 2).sum(1))
    groups = [slice(0, 3)] if aggregate == "shared" else [slice(b, b + 1) for b in range(3)]
    x_t = rng.normal(0, 1.0, (3, 1, d))
    y_t, _, _ = jax.jit(plan.decode)(w, state, jnp.asarray(x_t, jnp.float32), 0, jnp.ones((3, 1), bool))
    for i, g in enumerate(groups):
        local, glob = ref_griffin(H[g], valid[g]), prior
        if score == "impact":
            local, glob = local * down_norm, glob * down_norm
        kept = ref_glass_kept(local, glob, lam, n_keep)
        got = np.asarray(state["kept_idx"]) if aggregate == "shared" else np.asarray(state["kept_idx"][i])
        assert got.tolist() == kept, (i, got.tolist(), kept)
        want = ref_hidden(W, x_t[g])[..., kept] @ W["down"][kept]
        np.testing.assert_allclose(np.asarray(y_t[g]), want, atol=ATOL)


def test_glass_on_the_tiny_model(tiny_model):
    """The global prior is GRIFFIN's statistic over the calibration tokens (NumPy, from each
    layer's dense FFN input); λ = 1 selects GRIFFIN's channels; errors name the value."""
    model = tiny_model
    cfg = model.config
    corpus = Corpus("random", np.random.default_rng(2).integers(3, cfg.vocab_size, (4, 16)))
    glass = GLASS(0.3, lam=1.0, aggregate="per_sequence").calibrate(model, corpus, cache=False)
    assert glass.prior.scores.shape == (cfg.num_hidden_layers, cfg.intermediate_size)
    assert np.all(glass.prior.scores > 0)
    # every calibration token's normalised row has unit norm: Σ_j prior_j² = the number of tokens
    np.testing.assert_allclose((glass.prior.scores.astype(np.float64) ** 2).sum(axis=1), corpus.windows.size, rtol=1e-4)
    tokens, mask = pad_batch([[5, 17, 3, 9, 4, 22], [8, 9, 10]], 0)
    args = (jnp.asarray(tokens), jnp.asarray(mask))
    griffin = GRIFFIN(0.3, aggregate="per_sequence")
    _, _, states_g, _ = engine.prefill(model.graphdef, model.params, *args, griffin.bind(cfg))
    _, _, states_l, _ = engine.prefill(model.graphdef, model.params, *args, glass.bind(cfg), data=glass.data(model))
    for a, b in zip(states_g, states_l):
        assert np.asarray(a["kept_idx"]).tolist() == np.asarray(b["kept_idx"]).tolist()
    fixed = dataclasses.replace(glass, lam=0.0, aggregate="per_sequence")  # the prior alone: one selection for both rows
    _, _, states_f, _ = engine.prefill(model.graphdef, model.params, *args, fixed.bind(cfg), data=fixed.data(model))
    for l, state in enumerate(states_f):
        kept = np.asarray(state["kept_idx"])
        assert kept[0].tolist() == kept[1].tolist() == ref_rank(list(glass.prior.scores[l]))[: fixed.bind(cfg).n_keep]
    with pytest.raises(MethodError, match="lam=1.5 is outside"):
        GLASS(0.3, lam=1.5)
    with pytest.raises(MethodError, match="score='weights' is not one of"):
        GLASS(0.3, score="weights")
    with pytest.raises(MethodError, match="no global prior"):
        GLASS(0.3).bind(cfg)
    with pytest.raises(MethodError, match="does not fit this model"):
        dataclasses.replace(glass, prior=GlobalPrior("other", np.ones((1, 8), np.float32))).bind(cfg)
