"""LaRoSa and principal TEAL (docs/methods.md), the methods that sparsify activations in a rotated
basis, against plain NumPy references written here: the plans' decode on random layers (per-token
and batch-aggregated top-k or thresholds), the rotation as the damped second moments' eigenbasis,
then each method calibrated through the engine on the tiny model (the rotated model without
sparsity is dense; bad hyper-parameters give one clear line). Values within 1e-5.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from popjax import engine
from popjax.calibration import Corpus
from popjax.requests import pad_batch
from popjax.methods import LaRoSa, LaRoSaPlan, MethodError, PrincipalTEAL, PrincipalTEALPlan, kept_channels, make_method
from popjax.methods.larosa import DAMPING, Rotations, rotation_from_moment
from tests.reference.ffn import as_jax, random_layer, ref_hidden, ref_top_k

ATOL = 1e-5

# ------------------------------------------------------------------ LaRoSa


def ref_larosa_decode(W, Q, x, valid, k_x, k_h, aggregate):
    """x [B, 1, d] -> y [B, 1, d] by LaRoSa's rule (rotate, top k, rotate back; top k of |H|)."""
    d, f = W["gate"].shape
    B = x.shape[0]

    def masks(scores, k):
        if aggregate == "per_token":
            return [ref_top_k(scores[b], k) for b in range(B)]
        rows = [scores[b] for b in range(B) if valid[b, 0]]
        agg = np.max(rows, axis=0) if aggregate == "max" else np.sum(rows, axis=0) / max(len(rows), 1)
        return [ref_top_k(agg, k)] * B

    r = x[:, 0] @ Q
    keep = masks(np.abs(r), k_x)
    xs = np.array([[r[b, i] if i in keep[b] else 0.0 for i in range(d)] for b in range(B)]) @ Q.T
    H = ref_hidden(W, xs)
    keep_h = masks(np.abs(H), k_h)
    Hs = np.array([[H[b, j] if j in keep_h[b] else 0.0 for j in range(f)] for b in range(B)])
    return (Hs @ W["down"])[:, None]


@pytest.mark.parametrize("aggregate", ["per_token", "max", "mean"])
@pytest.mark.parametrize("f, k_h, k_x", [(96, 40, 9), (32, 1, 1), (24, 24, 16)])
def test_larosa_matches_reference(f, k_h, k_x, aggregate):
    rng = np.random.default_rng(f + k_h + k_x)
    d = 16
    W = random_layer(rng, d, f)
    A = rng.normal(size=(64, d)) * rng.uniform(0.1, 3.0, d)  # correlated, anisotropic "calibration" inputs
    Q = rotation_from_moment(A.T @ A)
    x = rng.normal(0, 1.0, (3, 1, d))
    valid = np.array([[True], [False], [True]])
    want = ref_larosa_decode(W, Q, x, valid, k_x, k_h, aggregate)
    plan = LaRoSaPlan(f=f, n_keep=k_h, k_x=k_x, aggregate=aggregate)
    w = as_jax(W, data={"larosa": {"rotation": jnp.asarray(Q[None], jnp.float32)}})
    y, _, _ = jax.jit(plan.decode)(w, None, jnp.asarray(x, jnp.float32), 0, jnp.asarray(valid))
    rows = [0, 2] if aggregate != "per_token" else [0, 1, 2]
    np.testing.assert_allclose(np.asarray(y)[rows], want[rows], atol=ATOL)
    assert plan.ffn_weights_read(d) == d * d + 2 * f * k_x + d * k_h


def test_rotation_is_the_damped_second_moments_eigenbasis():
    rng = np.random.default_rng(7)
    A = rng.normal(size=(200, 12)) * rng.uniform(0.1, 3.0, 12)
    M = A.T @ A
    Q = rotation_from_moment(M)
    np.testing.assert_allclose(Q.T @ Q, np.eye(12), atol=1e-10)
    D = Q.T @ (M + DAMPING * np.mean(np.diag(M)) * np.eye(12)) @ Q
    np.testing.assert_allclose(D - np.diag(np.diag(D)), 0.0, atol=1e-8)
    assert np.all(np.diff(np.diag(D)) <= 1e-9)  # descending: the first axes carry the energy


def test_larosa_on_the_tiny_model(tiny_model):
    """Rotations calibrated through the pipeline are orthogonal; the rotated model without
    sparsity equals the original within 1e-5; the budget; errors name the value."""
    model = tiny_model
    cfg = model.config
    d, f = cfg.hidden_size, cfg.intermediate_size
    corpus = Corpus("random", np.random.default_rng(2).integers(3, cfg.vocab_size, (4, 16)))
    method = LaRoSa(0.3).calibrate(model, corpus, cache=False)
    q = method.rotations.q.astype(np.float64)
    assert q.shape == (cfg.num_hidden_layers, d, d)
    for l in range(cfg.num_hidden_layers):
        np.testing.assert_allclose(q[l].T @ q[l], np.eye(d), atol=1e-5)
    tokens, mask = pad_batch([[5, 17, 3, 9, 4], [8, 9, 10]], 0)
    targets = jnp.asarray([[1, 2, 3], [4, 5, 6]])
    args = (jnp.asarray(tokens), jnp.asarray(mask), targets)
    dense = make_method("dense")
    _, want, _ = engine.teacher_force(model.graphdef, model.params, dense.bind(cfg), *args, with_logprobs=True)
    full = LaRoSaPlan(f=f, n_keep=f, k_x=d)  # rotated, nothing dropped
    _, got, _ = engine.teacher_force(model.graphdef, model.params, full, *args, with_logprobs=True, data=method.data(model))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    plan = method.bind(cfg)
    s = 1.0 - kept_channels(cfg, 0.3) / f  # TEAL's sparsity; alpha = 1: the same on both inputs
    assert (plan.k_x, plan.n_keep) == (round(d * (1 - s)), round(f * (1 - s))) == method.kept(cfg)
    k_x, k_h = dataclasses.replace(method, alpha=0.8).kept(cfg)  # less on x, more on H: TEAL's FFN reads
    assert abs(2 * f * k_x + d * k_h - 3 * d * f * (1 - s)) <= 2 * f + d
    _, sparse, _ = engine.teacher_force(model.graphdef, model.params, plan, *args, with_logprobs=True, data=method.data(model))
    assert np.all(np.isfinite(np.asarray(sparse)))
    with pytest.raises(MethodError, match="alpha=2 is outside"):
        LaRoSa(0.3, alpha=2)
    with pytest.raises(MethodError, match="no rotations"):
        LaRoSa(0.3).bind(cfg)
    with pytest.raises(MethodError, match="do not fit this model"):
        dataclasses.replace(method, rotations=Rotations("other", np.ones((1, 4, 4), np.float32))).bind(cfg)


# ------------------------------------------------------------------ Principal TEAL (built here)


def ref_principal_teal_decode(W, P, x, valid, t_e, t_h, aggregate):
    """x [B, 1, d] -> y [B, 1, d]: the projection on P kept whole, the residual and H thresholded."""
    d, f = W["gate"].shape
    B = x.shape[0]

    def keep(v, t):  # v [B, n] -> list of kept sets per row
        a = np.abs(v)
        if aggregate == "per_token":
            return [{i for i in range(v.shape[1]) if a[b, i] > t} for b in range(B)]
        rows = [a[b] for b in range(B) if valid[b, 0]]
        agg = np.max(rows, axis=0) if aggregate == "max" else np.sum(rows, axis=0) / max(len(rows), 1)
        return [{i for i in range(v.shape[1]) if agg[i] > t}] * B

    principal = x[:, 0] @ P @ P.T
    rest = x[:, 0] - principal
    k_e = keep(rest, t_e)
    xs = principal + np.array([[rest[b, i] if i in k_e[b] else 0.0 for i in range(d)] for b in range(B)])
    H = ref_hidden(W, xs)
    k_h = keep(H, t_h)
    Hs = np.array([[H[b, j] if j in k_h[b] else 0.0 for j in range(f)] for b in range(B)])
    return (Hs @ W["down"])[:, None]


@pytest.mark.parametrize("aggregate", ["per_token", "max", "mean"])
@pytest.mark.parametrize("rank", [1, 4])
def test_principal_teal_matches_reference(rank, aggregate):
    rng = np.random.default_rng(rank + len(aggregate))
    d, f = 16, 48
    W = random_layer(rng, d, f)
    A = rng.normal(size=(64, d)) * rng.uniform(0.1, 3.0, d)
    P = rotation_from_moment(A.T @ A)[:, :rank]
    x = rng.normal(0, 1.0, (3, 1, d)) * rng.uniform(0.3, 2.0, (3, 1, d))
    valid = np.array([[True], [False], [True]])
    t_e, t_h = 0.6, 0.05
    want = ref_principal_teal_decode(W, P, x, valid, t_e, t_h, aggregate)
    plan = PrincipalTEALPlan(f=f, n_keep=20, rank=rank, k_x=8, aggregate=aggregate)
    data = {"basis": jnp.asarray(P[None], jnp.float32), "t_e": jnp.asarray([t_e], jnp.float32),
            "t_h": jnp.asarray([t_h], jnp.float32)}
    y, _, aux = jax.jit(plan.decode)(as_jax(W, data={"principal_teal": data}), None, jnp.asarray(x, jnp.float32), 0,
                                     jnp.asarray(valid))
    rows = [0, 2] if aggregate != "per_token" else [0, 1, 2]
    np.testing.assert_allclose(np.asarray(y)[rows], want[rows], atol=ATOL)
    assert 0.0 < float(aux["density_x"]) < 1.0 and 0.0 < float(aux["density_h"]) <= 1.0
    assert plan.ffn_weights_read(d) == d * rank + 2 * f * 8 + d * 20


def test_principal_teal_on_the_tiny_model(tiny_model):
    """The bases are LaRoSa's top axes; the thresholds are the calibration quantiles at the
    budget's densities, which the reads of §12 meet; with zero thresholds the method is the dense
    model (principal part + whole residual = x); errors name the value."""
    model = tiny_model
    cfg = model.config
    d, f = cfg.hidden_size, cfg.intermediate_size
    corpus = Corpus("random", np.random.default_rng(2).integers(3, cfg.vocab_size, (4, 16)))
    method = PrincipalTEAL(0.3, rank=2).calibrate(model, corpus, cache=False)
    q = LaRoSa(0.3).calibrate(model, corpus, cache=False).rotations.q
    np.testing.assert_allclose(method.fit.basis, q[..., :2], atol=1e-6)
    k_x, k_h = method.sizes(cfg)
    s = 1.0 - kept_channels(cfg, 0.3) / f
    reads = d * 2 + 2 * f * k_x + d * k_h  # never more than TEAL's or WINA's at this ratio, within one down row
    assert k_x == round(d * (1 - 0.9 * s)) and 0 <= round(3 * d * f * (1 - s)) - reads < d
    assert reads <= 2 * f * round(d * (1 - s)) + d * round(f * (1 - s))
    teal_x = PrincipalTEAL(0.3, rank=2, alpha=1.0).sizes(cfg)  # alpha 1: TEAL's input density
    assert teal_x[0] == round(d * (1 - s)) and teal_x[1] > k_h  # a sparser input leaves more down entries
    assert method.fit.densities == ((k_x - 2) / d, k_h / f) and np.all(method.fit.t_e > 0) and np.all(method.fit.t_h > 0)
    assert method.prepare(model) is method
    tokens, mask = pad_batch([[5, 17, 3, 9, 4], [8, 9, 10]], 0)
    args = (jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray([[1, 2, 3], [4, 5, 6]]))
    _, want, _ = engine.teacher_force(model.graphdef, model.params, make_method("dense").bind(cfg), *args, with_logprobs=True)
    zero = {"principal_teal": {**method.data(model)["principal_teal"], "t_e": jnp.zeros(cfg.num_hidden_layers) - 1.0,
                               "t_h": jnp.zeros(cfg.num_hidden_layers) - 1.0}}
    plan = method.bind(cfg)
    assert isinstance(plan, PrincipalTEALPlan) and (plan.k_x, plan.n_keep) == (k_x, k_h)
    _, got, _ = engine.teacher_force(model.graphdef, model.params, plan, *args, with_logprobs=True, data=zero)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    _, sparse, _ = engine.teacher_force(model.graphdef, model.params, plan, *args, with_logprobs=True, data=method.data(model))
    assert np.all(np.isfinite(np.asarray(sparse)))
    with pytest.raises(MethodError, match="rank=0 is invalid"):
        PrincipalTEAL(0.3, rank=0)
    with pytest.raises(MethodError, match="alpha=0 is outside"):
        PrincipalTEAL(0.3, alpha=0)
    with pytest.raises(MethodError, match="alpha=0.1 leaves no down-input budget"):
        PrincipalTEAL(0.3, rank=2, alpha=0.1).sizes(cfg)
    with pytest.raises(MethodError, match=f"rank=64 must be below the {k_x} input columns"):
        PrincipalTEAL(0.3, rank=64).sizes(cfg)
    with pytest.raises(MethodError, match="not fitted"):
        PrincipalTEAL(0.3).bind(cfg)
    with pytest.raises(MethodError, match="does not fit this model and budget"):
        dataclasses.replace(method, ratio=0.2).bind(cfg)
