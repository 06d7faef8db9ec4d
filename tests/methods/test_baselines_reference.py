"""The paper baselines (docs/methods.md §5) against plain NumPy references written independently here.

GRIFFIN and Probe Pruning run their plans directly (no engine); Wanda-sp and FLAP compare their
calibration statistics, scores, kept channels, per-layer widths and bias with loops over
float64 copies. Selections must agree exactly, values within 1e-5.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from popjax.methods import GRIFFIN, GRIFFINPlan, MethodError, ProbePruning, ProbePruningPlan
from popjax.models import ModelConfig
from tests.reference import ffn
from tests.reference.ffn import as_jax, random_layer, ref_hidden, ref_rank
from tests.reference.methods import ref_flap, ref_griffin_scores

ATOL = 1e-5
# tokens of different norms: the baselines' token-normalised statistics must see them
random_batch = functools.partial(ffn.random_batch, varied_norms=True)


# ------------------------------------------------------------------ shared reference helpers


def jitted(plan):
    """The plan's prefill and decode, jitted (tests stay fast: one compile per shape)."""
    return jax.jit(plan.prefill), jax.jit(plan.decode)


def tiny_config(**extra) -> ModelConfig:
    return ModelConfig.from_hf_dict(
        dict(model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=2, num_key_value_heads=1, **extra)
    )


# ------------------------------------------------------------------ GRIFFIN


@pytest.mark.parametrize("aggregate", ["shared", "per_sequence"])
@pytest.mark.parametrize("f, n_keep", [(96, 67), (8, 1), (32, 32)])
def test_griffin_matches_reference(f, n_keep, aggregate):
    rng = np.random.default_rng(f + n_keep)
    d = 16
    W = random_layer(rng, d, f)
    X, valid = random_batch(rng, d, [5, 8, 2], T=8)
    plan = GRIFFINPlan(f=f, n_keep=n_keep, aggregate=aggregate)
    prefill, decode = jitted(plan)
    y, state, aux = prefill(as_jax(W), jnp.asarray(X, jnp.float32), jnp.asarray(valid))
    groups = [slice(0, 3)] if aggregate == "shared" else [slice(b, b + 1) for b in range(3)]
    x_t = rng.normal(0, 1.0, (3, 1, d))
    y_t, state_t, _ = decode(as_jax(W), state, jnp.asarray(x_t, jnp.float32), 0, jnp.ones((3, 1), bool))
    H = ref_hidden(W, X)
    # the prompt runs dense (GRIFFIN's prompt phase uses the full FFN)
    np.testing.assert_allclose(np.asarray(y)[valid], (H @ W["down"])[valid], atol=ATOL)
    for i, g in enumerate(groups):
        scores = ref_griffin_scores(W, X[g], valid[g])
        kept = ref_rank(scores)[:n_keep]
        got_scores = np.asarray(aux["importance"]) if aggregate == "shared" else np.asarray(aux["importance"][i])
        got_kept = np.asarray(state["kept_idx"]) if aggregate == "shared" else np.asarray(state["kept_idx"][i])
        np.testing.assert_allclose(got_scores, scores, rtol=1e-5, atol=ATOL)
        assert got_kept.tolist() == kept
        want = ref_hidden(W, x_t[g])[..., kept] @ W["down"][kept]
        np.testing.assert_allclose(np.asarray(y_t[g]), want, atol=ATOL)
    assert np.asarray(state_t["kept_idx"]).tolist() == np.asarray(state["kept_idx"]).tolist()


def test_griffin_metric_is_not_pops():
    """Token normalisation: one token with huge activations cannot dominate GRIFFIN's scores."""
    rng = np.random.default_rng(3)
    d, f = 16, 32
    W = random_layer(rng, d, f)
    X, valid = random_batch(rng, d, [6], T=6, scale=np.ones((1, 6, 1)))
    X[0, -1] *= 40.0  # one loud token
    y, state, aux = GRIFFINPlan(f=f, n_keep=8).prefill(as_jax(W), jnp.asarray(X, jnp.float32), jnp.asarray(valid))
    np.testing.assert_allclose(np.asarray(aux["importance"]), ref_griffin_scores(W, X, valid), rtol=1e-5)
    assert float(np.sum(np.square(np.asarray(aux["importance"])))) == pytest.approx(6.0, rel=1e-5)  # Σ_j s_j² = #tokens


# ------------------------------------------------------------------ Probe Pruning


def ref_count(frac, n):
    return max(1, math.ceil(frac * n - 1e-6))


def ref_probe(X, valid, probe_batch, probe_tokens):
    """-> probe mask [B, T] (stage 1 of the module docstring)."""
    B, T = valid.shape
    r = np.array([[math.sqrt(sum(v * v for v in X[b, t])) for t in range(T)] for b in range(B)])
    seqs = [b for b in range(B) if valid[b].any()]
    seq_score = {b: math.sqrt(sum(r[b, t] ** 2 for t in range(T) if valid[b, t])) for b in seqs}
    chosen = sorted(seqs, key=lambda b: (-seq_score[b], b))[: ref_count(probe_batch, len(seqs))] if seqs else []
    mask = np.zeros((B, T), bool)
    for b in chosen:
        toks = [t for t in range(T) if valid[b, t]]
        for t in sorted(toks, key=lambda t: (-r[b, t], t))[: ref_count(probe_tokens, len(toks))]:
            mask[b, t] = True
    return mask


class RefProbePruning:
    """PP's stages on one batch stream, in float64 loops."""

    def __init__(self, W, n_keep, probe_batch, probe_tokens, momentum):
        self.W, self.n_keep = W, n_keep
        self.pb, self.pt, self.mu = probe_batch, probe_tokens, momentum
        f = W["down"].shape[0]
        self.history = np.zeros(f)
        self.seen = np.zeros(f, bool)
        self.l4 = np.array([math.sqrt(sum(v**4 for v in W["down"][j])) for j in range(f)])

    def forward(self, X, valid):
        """One forward pass (prompt or decode step) -> (y, kept, scores, probe mask)."""
        H = ref_hidden(self.W, X)
        f = H.shape[-1]
        probe = ref_probe(X, valid, self.pb, self.pt)
        n_probe = max(int(probe.sum()), 1)
        q = np.array([sum(H[b, t, j] ** 2 for b, t in zip(*np.nonzero(probe))) / n_probe for j in range(f)])
        scores = np.zeros(f)
        for j in range(f):
            h = self.history[j]
            p = q[j] / (q[j] + h + 1e-6)
            scores[j] = ((1 - p) * h + p * q[j]) * self.l4[j]
        kept = ref_rank(scores)[: self.n_keep]
        y = H[..., kept] @ self.W["down"][kept]
        n_valid = int(valid.sum())
        if n_valid:
            for j in kept:
                stat = sum(H[b, t, j] ** 2 for b, t in zip(*np.nonzero(valid))) / n_valid
                self.history[j] = self.mu * self.history[j] + (1 - self.mu) * stat if self.seen[j] else stat
                self.seen[j] = True
        return y, kept, scores, probe


PP_CASES = [  # (f, n_keep, probe_batch, probe_tokens, momentum)
    (96, 67, 0.5, 0.5, 0.9),
    (96, 40, 0.05, 0.5, 0.99),
    (32, 31, 1.0, 0.25, 0.5),
    (8, 1, 0.5, 1.0, 0.0),
]


@pytest.mark.parametrize("f, n_keep, probe_batch, probe_tokens, momentum", PP_CASES)
def test_probe_pruning_shared_matches_reference(f, n_keep, probe_batch, probe_tokens, momentum):
    rng = np.random.default_rng(11 * f + n_keep)
    d, B = 16, 4
    W = random_layer(rng, d, f)
    X, valid = random_batch(rng, d, [5, 8, 3, 0], T=8)  # the last row is a padded batch slot
    plan = ProbePruningPlan(f=f, n_keep=n_keep, probe_batch=probe_batch, probe_tokens=probe_tokens, momentum=momentum)
    prefill, decode = jitted(plan)
    ref = RefProbePruning(W, n_keep, probe_batch, probe_tokens, momentum)
    y, state, aux = prefill(as_jax(W), jnp.asarray(X, jnp.float32), jnp.asarray(valid))
    y_ref, kept, scores, probe = ref.forward(X, valid)
    assert np.array_equal(np.asarray(aux["probe"]), probe)
    np.testing.assert_allclose(np.asarray(aux["importance"]), scores, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(y)[valid], y_ref[valid], atol=ATOL)
    np.testing.assert_allclose(np.asarray(state["history"]), ref.history, rtol=1e-5, atol=1e-7)
    assert np.array_equal(np.asarray(state["seen"]), ref.seen)

    for step, rows in enumerate([[1, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 0]]):
        x_t, v_t = rng.normal(0, 1.0, (B, 1, d)) * rng.uniform(0.3, 2.0, (B, 1, 1)), np.array(rows, bool)[:, None]
        x_t[~v_t[:, 0]] *= 50.0  # stopped / padded rows must not enter the probe or the history
        y_t, state, aux = decode(as_jax(W), state, jnp.asarray(x_t, jnp.float32), step, jnp.asarray(v_t))
        y_ref, kept, scores, _ = ref.forward(x_t, v_t)
        assert np.asarray(aux["selected"]).tolist() == kept
        np.testing.assert_allclose(np.asarray(aux["scores"]), scores, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(np.asarray(y_t)[v_t[:, 0]], y_ref[v_t[:, 0]], atol=ATOL)
        np.testing.assert_allclose(np.asarray(state["history"]), ref.history, rtol=1e-5, atol=1e-7)
        assert np.array_equal(np.asarray(state["seen"]), ref.seen)


def test_probe_pruning_per_sequence_matches_reference():
    rng = np.random.default_rng(5)
    d, f, n_keep = 16, 64, 40
    W = random_layer(rng, d, f)
    X, valid = random_batch(rng, d, [6, 2], T=6)
    plan = ProbePruningPlan(f=f, n_keep=n_keep, aggregate="per_sequence", probe_batch=0.05, probe_tokens=0.5, momentum=0.9)
    prefill, decode = jitted(plan)
    refs = [RefProbePruning(W, n_keep, 0.05, 0.5, 0.9) for _ in range(2)]
    y, state, aux = prefill(as_jax(W), jnp.asarray(X, jnp.float32), jnp.asarray(valid))
    for b, ref in enumerate(refs):
        y_ref, _, _, probe = ref.forward(X[b : b + 1], valid[b : b + 1])
        assert np.array_equal(np.asarray(aux["probe"][b]), probe)
        np.testing.assert_allclose(np.asarray(y[b])[valid[b]], y_ref[0][valid[b]], atol=ATOL)
    for step in range(3):
        x_t = rng.normal(0, 1.0, (2, 1, d))
        y_t, state, aux = decode(as_jax(W), state, jnp.asarray(x_t, jnp.float32), step, jnp.ones((2, 1), bool))
        for b, ref in enumerate(refs):
            y_ref, kept, _, _ = ref.forward(x_t[b : b + 1], np.ones((1, 1), bool))
            assert np.asarray(aux["selected"][b]).tolist() == kept
            np.testing.assert_allclose(np.asarray(y_t[b]), y_ref[0], atol=ATOL)
            np.testing.assert_allclose(np.asarray(state["history"][b]), ref.history, rtol=1e-5, atol=1e-7)


def test_probe_history_changes_the_selection():
    """With the same decode input, a different history (prompt) gives a different selection."""
    rng = np.random.default_rng(9)
    d, f = 16, 48
    W = random_layer(rng, d, f)
    plan = ProbePruningPlan(f=f, n_keep=20, probe_batch=1.0, probe_tokens=0.5, momentum=0.99)
    prefill, decode = jitted(plan)
    x_t = jnp.asarray(rng.normal(0, 1.0, (1, 1, d)), jnp.float32)
    picks = []
    for seed in (1, 2):
        X, valid = random_batch(np.random.default_rng(seed), d, [8], T=8)
        _, state, _ = prefill(as_jax(W), jnp.asarray(X, jnp.float32), jnp.asarray(valid))
        picks.append(np.asarray(decode(as_jax(W), state, x_t, 0, jnp.ones((1, 1), bool))[2]["selected"]).tolist())
    assert picks[0] != picks[1]


# ------------------------------------------------------------------ binding and bad input


def test_baseline_methods_bind_with_global_ratio():
    cfg = tiny_config()
    from popjax.methods import kept_channels

    for method in (GRIFFIN(0.2), ProbePruning(0.2, probe_batch=0.5), GRIFFIN(0.3, aggregate="per_sequence")):
        plan = method.bind(cfg)
        assert (plan.f, plan.n_keep) == (96, kept_channels(cfg, method.ratio))
    plan = ProbePruning(0.2, probe_batch=0.5, probe_tokens=0.25, momentum=0.5).bind(cfg)
    assert (plan.probe_batch, plan.probe_tokens, plan.momentum) == (0.5, 0.25, 0.5)
    assert plan.ffn_weights_read(16) == 2 * 16 * 96 + 16 * plan.n_keep
    assert GRIFFIN(0.2).bind(cfg).ffn_weights_read(16) == 3 * 16 * plan.n_keep
    assert GRIFFIN(0.0).bind(cfg).name == "dense"


@pytest.mark.parametrize(
    "make, bad",
    [
        (lambda: GRIFFIN(1.2), "ratio=1.2"),
        (lambda: GRIFFIN(0.2, aggregate="mean"), "aggregate='mean'"),
        (lambda: ProbePruning(0.2, probe_batch=0.0), "probe_batch=0.0"),
        (lambda: ProbePruning(0.2, probe_tokens=1.5), "probe_tokens=1.5"),
        (lambda: ProbePruning(0.2, probe_tokens=True), "probe_tokens=True"),
        (lambda: ProbePruning(0.2, momentum=-0.1), "momentum=-0.1"),
    ],
)
def test_baseline_bad_hyper_parameters(make, bad):
    with pytest.raises(MethodError, match=bad.replace("(", r"\(")):
        make()


# ------------------------------------------------------------------ Wanda-sp and FLAP: plan and host math


def test_wanda_sp_statistic_matches_reference():
    """One layer of the in-order collector: scores, kept channels and the pruned output."""
    from popjax.methods.wanda_sp import WandaSPInOrder

    rng = np.random.default_rng(21)
    d, f, n_keep = 16, 40, 25
    W = random_layer(rng, d, f)
    X, valid = random_batch(rng, d, [7, 3], T=7)
    w, x, v = as_jax(W), jnp.asarray(X, jnp.float32), jnp.asarray(valid)
    stat = WandaSPInOrder(n_keep=n_keep)
    from popjax.methods.base import activations

    h = activations(w.gate_up, x)
    got = stat.collect(w, x, v, h)
    H = ref_hidden(W, X)
    n_tok = int(valid.sum())
    scores = np.zeros(f)
    for j in range(f):
        mean_abs = sum(abs(W["down"][j, i]) for i in range(d)) / d
        mean_sq = sum(H[b, t, j] ** 2 for b, t in zip(*np.nonzero(valid))) / n_tok
        scores[j] = mean_abs * math.sqrt(mean_sq)
    kept = ref_rank(scores)[:n_keep]
    np.testing.assert_allclose(np.asarray(got["scores"]), scores, rtol=1e-5)
    assert sorted(np.flatnonzero(np.asarray(got["kept"])).tolist()) == sorted(kept)
    assert int(got["tokens"]) == n_tok
    y = np.asarray(stat.output(w, x, v, h))
    np.testing.assert_allclose(y[valid], (H[..., kept] @ W["down"][kept])[valid], atol=ATOL)


def test_selection_plan_matches_reference():
    """Per-layer kept sets of different widths (padded inside) and a per-layer bias."""
    from popjax.methods import SelectionPlan
    from popjax.methods.wanda_sp import selection_data

    rng = np.random.default_rng(4)
    d, f = 16, 32
    W = random_layer(rng, d, f)
    kept = (tuple(sorted(rng.choice(f, 20, replace=False).tolist())), tuple(sorted(rng.choice(f, 9, replace=False).tolist())))
    bias = tuple(tuple(float(b) for b in rng.normal(0, 1, d).astype(np.float32)) for _ in kept)
    plan = SelectionPlan(f=f, n_keep=14, n_max=20)
    data = selection_data(kept, bias)  # the method's data, as generate passes it (w.data)
    assert data["kept"].shape == (2, 20) and data["bias"].shape == (2, d)
    assert plan.ffn_weights_read(d) == 3 * d * 20
    X, valid = random_batch(rng, d, [5, 2], T=5)
    x_t = rng.normal(0, 1.0, (2, 1, d))
    for layer in range(2):
        w = as_jax(W, layer, data=data)
        y, state, _ = jax.jit(plan.prefill)(w, jnp.asarray(X, jnp.float32), jnp.asarray(valid))
        y_t, _, _ = jax.jit(plan.decode)(w, state, jnp.asarray(x_t, jnp.float32), 0, jnp.ones((2, 1), bool))
        k = list(kept[layer])
        for got, inp in ((np.asarray(y)[valid], X[valid]), (np.asarray(y_t), x_t)):
            np.testing.assert_allclose(got, ref_hidden(W, inp)[..., k] @ W["down"][k] + np.asarray(bias[layer]), atol=ATOL)


def test_flap_selection_matches_reference():
    """Host side of FLAP: fluctuation, standardised scores, one global threshold with a floor, bias."""
    from popjax.methods.flap import flap_selection

    rng = np.random.default_rng(8)
    L, d, f, n_tok, n_keep, floor = 3, 12, 24, 50, 10, 4
    H_layers = [rng.normal(rng.normal(0, 0.3, f), rng.uniform(0.1, 1.0, f), (n_tok, f)) for _ in range(L)]
    downs = [rng.normal(0, 0.1, (d, f)) for _ in range(L)]
    downs[0] *= np.exp(rng.normal(0, 1.5, f))  # a heavy-tailed layer: its share of the budget differs
    stats = {
        "sum": np.stack([H.sum(0) for H in H_layers]),
        "sumsq": np.stack([(H**2).sum(0) for H in H_layers]),
        "tokens": np.full(L, n_tok),
    }
    kept, bias, _ = flap_selection(stats, [dn.astype(np.float32) for dn in downs], n_keep, floor)
    ref_kept, ref_bias = ref_flap(H_layers, [dn.astype(np.float32).astype(np.float64) for dn in downs], n_keep, floor)
    assert [k.tolist() for k in kept] == ref_kept
    widths = [len(k) for k in ref_kept]
    assert sum(widths) == L * n_keep and min(widths) >= floor and len(set(widths)) > 1  # adaptive per-layer ratios
    np.testing.assert_allclose(bias, ref_bias, atol=1e-9)


def test_flap_floor_and_budget():
    """A layer whose scores are all below the others' keeps exactly its floor."""
    from popjax.methods.flap import global_selection

    z = np.array([[-5.0, -6.0, -7.0, -8.0], [1.0, 2.0, 3.0, 0.5], [0.9, 0.8, 0.7, 0.6]])
    kept = global_selection(z, n_keep=2, floor=1)
    assert [k.tolist() for k in kept] == [[0], [0, 1, 2], [0, 1]]
    assert [k.tolist() for k in global_selection(z, n_keep=2, floor=2)] == [[0, 1], [1, 2], [0, 1]]
