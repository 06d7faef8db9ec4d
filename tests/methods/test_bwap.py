"""BWAP against a plain NumPy reference of docs/methods.md §3, written independently here.

The reference keeps each exploration phase's raw H rows per sample and recomputes the scores
from them with loops in float64; popjax keeps running sums in fp32. Masks (kept channel ids, in
top-k order) must agree exactly, memories and outputs within 1e-5.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import popjax
from popjax import engine
from popjax.methods import BWAP, BWAPPlan, DensePlan, MethodError
from popjax.models import ModelConfig
from tests.conftest import random_prompts
from tests.reference.ffn import as_jax, random_batch, random_layer, ref_hidden

ATOL = 1e-5


# ------------------------------------------------------------------ the NumPy reference


def ref_sample_score(rows):
    """s_j = ‖col_j of the L2-normalised rows‖₂ / √T for one sample's valid rows; None if none."""
    if not rows:
        return None
    f = len(rows[0])
    total = np.zeros(f)
    for row in rows:
        norm = math.sqrt(sum(v * v for v in row))
        for j in range(f):
            z = row[j] / norm if norm > 0 else 0.0
            total[j] += z * z
    return np.sqrt(total) / math.sqrt(len(rows))


def ref_batch_score(per_sample_rows, how, f):
    scores = [s for s in (ref_sample_score(r) for r in per_sample_rows) if s is not None]
    if not scores:
        return np.zeros(f)
    return np.max(scores, axis=0) if how == "max" else np.mean(scores, axis=0)


def ref_top(mem, k):
    return sorted(range(len(mem)), key=lambda j: (-mem[j], j))[:k]


def ref_is_explore(step, t_init, t_explore, t_prune):
    return step < t_init or (step - t_init) % (t_prune + t_explore) >= t_prune


def ref_is_update(step, t_init, t_explore, t_prune):
    period = t_prune + t_explore
    return step == t_init - 1 or (step >= t_init and (step - t_init) % period == period - 1)


class RefBWAP:
    """docs/methods.md §3 step by step: prompt score s₀, exploration rows per sample, memory, top-k."""

    def __init__(self, W, k, t_init, t_explore, t_prune, how, memory=True):
        self.W, self.k, self.how, self.memory = W, k, how, memory
        self.periods = (t_init, t_explore, t_prune)

    def prefill(self, X, valid):
        H = ref_hidden(self.W, X)
        rows = [[H[b, t] for t in range(X.shape[1]) if valid[b, t]] for b in range(X.shape[0])]
        self.mem = ref_batch_score(rows, self.how, H.shape[-1])
        self.kept = ref_top(self.mem, self.k)
        self.phase_rows = [[] for _ in range(X.shape[0])]
        return H @ self.W["down"], self.mem.copy()

    def refresh(self, score):
        self.mem = np.maximum(self.mem, score) if self.memory else score
        self.kept = ref_top(self.mem, self.k)

    def decode(self, x, step, valid):
        H = ref_hidden(self.W, x)
        explore = ref_is_explore(step, *self.periods)
        if explore:
            y = H @ self.W["down"]
            for b in range(x.shape[0]):
                if valid[b, 0]:
                    self.phase_rows[b].append(H[b, 0])
        else:
            y = H[..., self.kept] @ self.W["down"][self.kept]
        update = ref_is_update(step, *self.periods)
        if update:
            self.refresh(ref_batch_score(self.phase_rows, self.how, H.shape[-1]))
            self.phase_rows = [[] for _ in range(x.shape[0])]
        return y, explore, update

    def decode_every_step(self, x, valid):
        H = ref_hidden(self.W, x)
        rows = [[H[b, 0]] if valid[b, 0] else [] for b in range(x.shape[0])]
        self.refresh(ref_batch_score(rows, self.how, H.shape[-1]))
        return H[..., self.kept] @ self.W["down"][self.kept]


# ------------------------------------------------------------------ plan vs reference


def jitted(plan):
    """(prefill, decode) of a plan compiled once: ``step`` is traced, as in the decode loop."""
    return jax.jit(plan.prefill), jax.jit(plan.decode)


def _run(plan, ref, steps=24, seed=0, d=16, B=3):
    """Prefill + ``steps`` decode steps of both, comparing everything; -> per-step aux list."""
    rng = np.random.default_rng(seed)
    W = ref.W
    X, valid = random_batch(rng, d, [5, 8, 3][:B], T=8)
    w = as_jax(W)
    prefill, decode = jitted(plan)
    y, state, aux = prefill(w, jnp.asarray(X, jnp.float32), jnp.asarray(valid))
    Y_ref, s0 = ref.prefill(X, valid)
    np.testing.assert_allclose(np.asarray(y)[valid], Y_ref[valid], atol=ATOL)
    np.testing.assert_allclose(np.asarray(aux["score"]), s0, rtol=1e-5, atol=1e-7)
    auxes = []
    for step in range(steps):
        x = rng.normal(0, 1.0, (B, 1, d))
        row_valid = rng.random((B, 1)) > 0.25  # stopped rows come and go
        x[~row_valid[:, 0]] *= 100.0  # an invalid row must not move any statistic
        y, state, aux = decode(w, state, jnp.asarray(x, jnp.float32), step, jnp.asarray(row_valid))
        if plan.schedule == "every_step":
            y_ref = ref.decode_every_step(x, row_valid)
        else:
            y_ref, explore, update = ref.decode(x, step, row_valid)
            assert (bool(aux["explore"]), bool(aux["update"])) == (explore, update), step
        np.testing.assert_allclose(np.asarray(y)[row_valid[:, 0]], y_ref[row_valid[:, 0]], atol=ATOL)
        assert np.asarray(state["kept_idx"]).tolist() == ref.kept, step
        np.testing.assert_allclose(np.asarray(state["memory"]), ref.mem, rtol=1e-5, atol=1e-7)
        auxes.append(aux)
    return auxes


CASES = [  # (f, k, t_init, t_explore, t_prune)
    (96, 40, 3, 2, 4),
    (96, 90, 1, 1, 1),
    (32, 1, 2, 3, 5),
    (8, 7, 4, 1, 2),
]


@pytest.mark.parametrize("aggregate", ["max", "mean"])
@pytest.mark.parametrize("f, k, t_init, t_explore, t_prune", CASES)
def test_bwap_matches_reference(f, k, t_init, t_explore, t_prune, aggregate):
    W = random_layer(np.random.default_rng(f + k), 16, f)
    plan = BWAPPlan(f=f, n_keep=k, t_init=t_init, t_explore=t_explore, t_prune=t_prune, aggregate=aggregate)
    ref = RefBWAP(W, k, t_init, t_explore, t_prune, aggregate)
    auxes = _run(plan, ref, seed=f * 7 + k)
    for aux in auxes:
        assert float(aux["density"]) == pytest.approx(1.0 if bool(aux["explore"]) else k / f)
        assert np.asarray(aux["kept_idx"]).shape == (k,)


@pytest.mark.parametrize("memory, schedule", [(False, "periodic"), (True, "every_step"), (False, "every_step")])
def test_bwap_ablations_match_reference(memory, schedule):
    W = random_layer(np.random.default_rng(5), 16, 48)
    plan = BWAPPlan(f=48, n_keep=20, t_init=2, t_explore=2, t_prune=3, aggregate="max", memory=memory, schedule=schedule)
    _run(plan, RefBWAP(W, 20, 2, 2, 3, "max", memory=memory), steps=12, seed=9)


def test_schedule_is_the_papers_cycle():
    plan = BWAPPlan(f=8, n_keep=4, t_init=3, t_explore=2, t_prune=4)
    explore = [bool(plan.phase(s)[0]) for s in range(21)]
    update = [bool(plan.phase(s)[1]) for s in range(21)]
    # init 0-2 | prune 3-6 | explore 7-8 | prune 9-12 | explore 13-14 | prune 15-18 | explore 19-20
    assert [s for s, e in enumerate(explore) if e] == [0, 1, 2, 7, 8, 13, 14, 19, 20]
    assert [s for s, u in enumerate(update) if u] == [2, 8, 14, 20]


def test_padded_rows_and_tokens_are_ignored():
    """The same sequences with an extra all-padding row and stopped rows: identical masks."""
    rng = np.random.default_rng(3)
    W = random_layer(rng, 16, 64)
    w = as_jax(W)
    prefill, decode = jitted(BWAPPlan(f=64, n_keep=30, t_init=2, t_explore=1, t_prune=2))
    X, valid = random_batch(rng, 16, [6, 4], T=6)
    X_pad = np.concatenate([X, rng.normal(0, 80.0, (1, 6, 16))])
    valid_pad = np.concatenate([valid, np.zeros((1, 6), bool)])
    _, state, _ = prefill(w, jnp.asarray(X, jnp.float32), jnp.asarray(valid))
    _, state_pad, _ = prefill(w, jnp.asarray(X_pad, jnp.float32), jnp.asarray(valid_pad))
    for step in range(8):
        x = rng.normal(0, 1.0, (2, 1, 16))
        x_pad = np.concatenate([x, rng.normal(0, 80.0, (1, 1, 16))])
        y, state, _ = decode(w, state, jnp.asarray(x, jnp.float32), step, jnp.ones((2, 1), bool))
        y_pad, state_pad, _ = decode(
            w, state_pad, jnp.asarray(x_pad, jnp.float32), step, jnp.asarray([[True], [True], [False]])
        )
        assert np.asarray(state["kept_idx"]).tolist() == np.asarray(state_pad["kept_idx"]).tolist()
        np.testing.assert_allclose(np.asarray(y_pad)[:2], np.asarray(y), atol=1e-6)


def test_t_prune_zero_is_dense():
    rng = np.random.default_rng(4)
    W = random_layer(rng, 16, 48)
    w = as_jax(W)
    plan, dense = BWAPPlan(f=48, n_keep=10, t_init=2, t_explore=3, t_prune=0), DensePlan(f=48, n_keep=48)
    X, valid = random_batch(rng, 16, [5, 2], T=5)
    prefill, decode = jitted(plan)
    y, state, _ = prefill(w, jnp.asarray(X, jnp.float32), jnp.asarray(valid))
    np.testing.assert_allclose(np.asarray(y), np.asarray(dense.prefill(w, jnp.asarray(X, jnp.float32), valid)[0]), rtol=0, atol=1e-6)
    for step in range(12):
        x = jnp.asarray(rng.normal(0, 1.0, (2, 1, 16)), jnp.float32)
        y, state, aux = decode(w, state, x, step, jnp.ones((2, 1), bool))
        assert bool(aux["explore"])
        np.testing.assert_allclose(np.asarray(y), np.asarray(dense.decode(w, None, x, step, None)[0]), rtol=0, atol=1e-6)


def test_weights_read_accounting():
    plan = BWAPPlan(f=100, n_keep=40, t_init=8, t_explore=4, t_prune=16)
    d = 10
    assert plan.pruned_step_weights_read(d) == 3 * d * 40
    assert plan.explore_step_weights_read(d) == 3 * d * 100
    assert plan.ffn_weights_read(d) == round((16 * 1200 + 4 * 3000 + 1200) / 20)
    assert plan.ffn_flops_per_token(d) == round((16 * 2400 + 4 * 6000) / 20)
    assert BWAPPlan(f=100, n_keep=40, schedule="every_step").ffn_weights_read(d) == 2 * d * 100 + d * 40


# ------------------------------------------------------------------ budget and bad input

TINY = ModelConfig.from_hf_dict(
    dict(model_type="llama", hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
         num_hidden_layers=2, vocab_size=160, max_position_embeddings=256)
)


def test_budget():
    from popjax.methods import kept_channels

    assert BWAP().ratio == 0.2 and BWAP().ffn_sparsity is None
    assert BWAP(0.3).bind(TINY).n_keep == kept_channels(TINY, 0.3)
    assert BWAP(ffn_sparsity=0.5).bind(TINY).n_keep == 48
    assert BWAP(ffn_sparsity=0.3).bind(TINY).n_keep == math.floor(0.7 * 96)
    assert isinstance(BWAP(ratio=0.0).bind(TINY), DensePlan)
    assert isinstance(BWAP(ffn_sparsity=0.0).bind(TINY), DensePlan)
    assert popjax.methods.make_method("bwap", ratio=0.1, t_prune=3).t_prune == 3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(t_init=0), r"t_init=0 is invalid; use an integer ≥ 1"),
        (dict(t_explore=0), r"t_explore=0 is invalid; use an integer ≥ 1"),
        (dict(t_prune=-1), r"t_prune=-1 is invalid; use an integer ≥ 0"),
        (dict(t_init=2.5), r"t_init=2.5 is invalid"),
        (dict(aggregate="median"), r"aggregate='median' is not one of \('max', 'mean'\)"),
        (dict(schedule="sometimes"), r"schedule='sometimes' is not one of"),
        (dict(ratio=1.0), r"ratio=1.0 is outside \[0, 1\)"),
        (dict(ratio=-0.2), r"ratio=-0.2 is outside \[0, 1\)"),
        (dict(ffn_sparsity=1.0), r"ffn_sparsity=1.0 is outside \[0, 1\)"),
        (dict(ratio=0.2, ffn_sparsity=0.5), r"give ratio=0.2 or ffn_sparsity=0.5, not both"),
        (dict(memory="yes"), r"memory='yes' must be True or False"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(MethodError, match=message):
        BWAP(**kwargs)


def test_infeasible_budgets():
    with pytest.raises(MethodError, match=r"ratio=0.7 needs an FFN ratio"):
        BWAP(ratio=0.7).bind(TINY)
    with pytest.raises(MethodError, match=r"ffn_sparsity=0.999 keeps no channel of f=96"):
        BWAP(ffn_sparsity=0.999).bind(TINY)


# ------------------------------------------------------------------ through the whole model


def test_generation_follows_the_schedule_without_recompiles(tiny_model):
    rng = np.random.default_rng(0)
    vocab = tiny_model.config.vocab_size
    method = BWAP(ratio=0.3, t_init=2, t_explore=2, t_prune=3)
    plan = method.bind(tiny_model.config)
    n = 20
    ids, trace = popjax.generate_ids(
        tiny_model, random_prompts(rng, (4, 11, 7), vocab), n, method=method, ignore_eos=True, return_trace=True
    )
    assert [len(row) for row in ids] == [n] * 3
    L = tiny_model.config.num_hidden_layers
    explore, update = trace["decode"]["explore"], trace["decode"]["update"]
    steps = explore.shape[0]
    assert explore.shape == (steps, L) and steps == n - 1
    for s in range(steps):
        assert explore[s].tolist() == [ref_is_explore(s, 2, 2, 3)] * L
        assert update[s].tolist() == [ref_is_update(s, 2, 2, 3)] * L
    assert trace["decode"]["kept_idx"].shape == (steps, L, plan.n_keep)
    assert trace["prefill"]["score"].shape == (L, plan.f)
    popjax.generate_ids(tiny_model, random_prompts(rng, (4, 5, 6), vocab), n, method=method, ignore_eos=True)
    before = engine.compile_counts()  # after the untraced variant's first compile
    popjax.generate_ids(tiny_model, random_prompts(rng, (9, 3, 30), vocab), n, method=method, ignore_eos=True)
    popjax.generate_ids(tiny_model, random_prompts(rng, (1, 17, 25), vocab), n, method=method, ignore_eos=True)
    assert engine.compile_counts() == before


def test_ratio_zero_generates_exactly_dense(tiny_model):
    prompts = random_prompts(np.random.default_rng(1), (5, 12), tiny_model.config.vocab_size)
    dense, _ = popjax.generate_ids(tiny_model, prompts, 12, ignore_eos=True)
    ours, _ = popjax.generate_ids(tiny_model, prompts, 12, method=BWAP(ratio=0.0), ignore_eos=True)
    assert ours == dense
    tprune0, _ = popjax.generate_ids(tiny_model, prompts, 12, method=BWAP(ratio=0.3, t_prune=0), ignore_eos=True)
    assert tprune0 == dense
