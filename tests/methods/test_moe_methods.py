"""FFN-pruning methods on mixture-of-experts models (docs/moe.md): generation on tiny random
Qwen3-MoE and Qwen2-MoE models (tests/reference/moe.py), traces on a model that mixes dense
and MoE layers, clear errors, and per-block calibrated constants used at run time against NumPy.
Per-expert calibration statistics: test_moe_statistics.py; every registered method on the mixed
model: test_method_matrix.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import popjax
from popjax import engine
from popjax.methods import MethodError, make_method
from popjax.methods.prefill_only.calibrate import calibrate_kv
from popjax.methods.teal import Thresholds, thresholds_data
from popjax.methods.wanda_sp import ChannelSelection, SelectionPlan, selection_data
from popjax.models.moe import moe_mlp
from tests.reference.moe import PROMPTS, block_hidden, moe_corpus, routed_tokens, slot_ffns


def test_generate_on_qwen3_moe_with_per_expert_constants(moe_models):
    """generate on a Qwen3-MoE (no shared expert: 4 slots; one prompt routes 2 of 4 experts, so
    decode gathers them) with TEAL, whose thresholds are per expert."""
    model, _ = moe_models("qwen3_moe")
    method = popjax.TEAL(0.2).calibrate(model, moe_corpus())
    ids, _ = popjax.generate_ids(model, PROMPTS["qwen3_moe"], max_new_tokens=3, method=method, stop_ids=[])
    assert len(ids[0]) == 3 and np.shape(method.thresholds.get("x")) == (1, 4)


def test_generate_traces_a_model_mixing_dense_and_moe_layers(moe_models, moe_ready):
    """POP's trace (return_trace=True) on the mixed model: partitions, prefill and decode aux
    stacked over layers, the dense layer's entries zero-padded into the MoE layout."""
    model, _ = moe_models("qwen2_moe")
    method = popjax.POP(aggregate="shared")  # one partition for the batch: [L, ...] trace entries
    plan = method.bind(model.config)
    ids, trace = popjax.generate_ids(model, PROMPTS["qwen2_moe"], max_new_tokens=3, method=method,
                                     stop_ids=[], return_trace=True)
    assert [len(row) for row in ids] == [3, 3]
    assert trace["prefill"]["experts"]["importance"].shape == (2, 8, 16)
    n_r = plan.n_keep - plan.m
    part = trace["partition"]
    assert part["experts"]["retained_idx"].shape == (2, 8, n_r) and part["shared"]["retained_idx"].shape == (2, 3, n_r)
    assert not np.any(part["experts"]["retained_idx"][1])  # layer 1 has no experts: zeros
    assert not np.any(part["shared"]["retained_idx"][0, 2])  # layer 0 has two shared blocks
    assert len(set(part["shared"]["retained_idx"][1, 2].tolist())) == n_r  # layer 1's third block is real
    assert trace["decode"]["experts"]["selected"].shape == (2, 2, 8, plan.m)
    assert trace["decode"]["shared"]["selected"].shape == (2, 2, 3, plan.m)


def test_stack_aux_pads_to_the_union_and_names_a_rank_mismatch():
    sparse = {"experts": {"a": jnp.ones((4, 3))}, "shared": {"a": jnp.ones((2, 3))}, "router_topk": jnp.ones((1, 5, 2), jnp.int32)}
    dense = {"shared": {"a": 2 * jnp.ones((3, 3))}}
    out = engine.stack_aux([sparse, dense, {}])
    assert out["experts"]["a"].shape == (3, 4, 3) and out["shared"]["a"].shape == (3, 3, 3)
    np.testing.assert_array_equal(out["shared"]["a"][:, :, 0], [[1, 1, 0], [2, 2, 2], [0, 0, 0]])
    assert out["router_topk"].dtype == jnp.int32 and not np.any(out["router_topk"][1:])
    with pytest.raises(ValueError, match=r"aux\['x'\] differ in structure or rank"):
        engine.stack_aux([{"x": jnp.ones(3)}, {"x": jnp.ones((3, 1))}])


def test_unusable_cases_fail_with_clear_errors(moe_models):
    model, _ = moe_models("qwen3_moe")
    with pytest.raises(MethodError, match=r"rank=64 exceeds min\(d, f\)"):  # the default rank, expert width 16
        make_method("pop-lowrank").prepare(model)
    with pytest.raises(MethodError, match=r"prune_model: wanda-sp cannot write a pruned checkpoint of a mixture-of-experts model \(qwen3_moe\)"):
        popjax.pruned.prune_model(model, popjax.WandaSP(0.2))
    dense_thresholds = Thresholds((("gate", 0.45),), (("gate", (0.1,)),))  # one per layer: a dense model's
    with pytest.raises(MethodError, match=r"thresholds for 'gate' have shape \(1,\); this qwen3_moe model needs \(1, 4\)"):
        popjax.CATS(ffn_sparsity=0.45, thresholds=dense_thresholds).bind(model.config)
    n_keep = popjax.WandaSP(0.2).n_keep(model.config)
    per_layer = ChannelSelection("wanda-sp", 0.2, (tuple(range(n_keep)),))  # a dense model's: one entry per layer
    with pytest.raises(MethodError, match=r"for 1 layers; this model has 1 layers × 4 FFN block slots: calibrate again"):
        popjax.WandaSP(0.2, selection=per_layer).bind(model.config)
    with pytest.raises(MethodError, match=r"drift has 1 entries, the model has 1 layers × 4 FFN block slots"):
        popjax.LayerBandsPOP(0.2).with_drift([0.1]).bind(model.config)
    factors = popjax.methods.pop.low_rank.factors_from_weights([np.ones((2, 16, 32))], 4)  # one layer's, not per block
    with pytest.raises(MethodError, match=r"do not fit this model \(layers × block slots, d, rank, f\) = \(4, 32, 4, 16\)"):
        popjax.LowRankPOP(0.2, rank=4, factors=factors).bind(model.config)


# ---------------------------------------------------------------- per-block constants at run time


def _layer_fn(model, fn, state, x, valid=None):
    """Layer 0's MoE FFN under ``fn`` (the engine's FFN function), jitted -> (y, state, aux);
    ``valid`` [B, T] (default: every token)."""
    graphdef, params = nnx.split(nnx.merge(model.graphdef, model.params).layers[0].mlp)
    valid = jnp.ones(x.shape[:2], bool) if valid is None else jnp.asarray(valid)
    return jax.jit(lambda p, s, x, v: moe_mlp(nnx.merge(graphdef, p), fn, s, x, v, jnp.int32(0)))(params, state, x, valid)


def _combine(model, hf, x, per_slot):
    """Σ over blocks of router weight · block output (shared gate for always-active blocks)."""
    cfg, p = model.config, "layers.0.mlp."
    logits = x @ hf[p + "router"].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    y = np.zeros_like(x)
    for idx in np.ndindex(*x.shape[:2]):
        top = np.argsort(-probs[idx], kind="stable")[: cfg.moe.top_k]
        w = probs[idx][top] / (probs[idx][top].sum() if cfg.moe.norm_topk_prob else 1.0)
        for e, we in zip(top, w):
            y[idx] += we * per_slot(e, idx)
    shared_gate = 1 / (1 + np.exp(-(x @ hf[p + "shared_gate"].T))) if p + "shared_gate" in hf else np.ones((*x.shape[:2], 1))
    for slot in range(cfg.moe.num_experts, cfg.moe.slots(cfg.num_hidden_layers)):
        if cfg.moe.slot_mask(cfg.num_hidden_layers)[0, slot]:
            for idx in np.ndindex(*x.shape[:2]):
                y[idx] += shared_gate[idx][0] * per_slot(slot, idx)
    return y


def test_selection_plan_uses_each_blocks_channels_and_bias(moe_models):
    model, hf = moe_models("qwen2_moe")
    rng = np.random.default_rng(3)
    S, f, d = 11, 16, 32
    kept = [tuple(sorted(rng.choice(f, size=int(rng.integers(4, 13)), replace=False).tolist())) for _ in range(2 * S)]
    bias = rng.normal(size=(2 * S, d))
    plan = SelectionPlan(f=f, n_keep=8, n_max=max(map(len, kept)), blocks=S)
    data = selection_data(kept, bias.astype(np.float32), blocks=S)
    x = rng.normal(size=(2, 5, d))
    y, _, _ = _layer_fn(model, lambda w, s, x, rows: plan.prefill(w.replace(data=data), x, None), None,
                        jnp.asarray(x, jnp.float32))
    ffns = slot_ffns(model, hf, 0)

    def block(slot, idx):
        g, u, dn = ffns[slot]
        k = list(kept[slot])
        return block_hidden(g[k], u[k], x[idx]) @ dn[:, k].T + bias[slot]

    np.testing.assert_allclose(np.asarray(y), _combine(model, hf, x, block), atol=1e-5)


def test_teal_decode_uses_each_experts_thresholds(moe_models):
    model, hf = moe_models("qwen3_moe")
    rng = np.random.default_rng(4)
    t_x, t_h = rng.uniform(0.2, 0.8, size=(1, 4)), rng.uniform(0.01, 0.1, size=(1, 4))
    plan = popjax.methods.TEALPlan(f=16, n_keep=8, sparsity=0.5, aggregate="max")
    data = thresholds_data({"x": t_x, "h": t_h})
    x = rng.normal(size=(3, 1, 32))
    valid = np.array([[True], [True], [False]])  # a stopped row takes no part in any aggregate
    fn = lambda w, s, x, rows: plan.decode(w.replace(data=data), s, x, jnp.int32(0), rows)
    y, _, aux = _layer_fn(model, fn, None, jnp.asarray(x, jnp.float32), valid)
    routed = routed_tokens(model, hf, 0, x[:, :, :]) & valid[None]
    ffns = slot_ffns(model, hf, 0)

    def block(e, idx):
        g, u, dn = ffns[e]
        rows = routed[e]  # the expert's valid rows [B, 1]
        keep_x = np.abs(np.where(rows[..., None], x, 0)).max((0, 1)) > t_x[0, e]
        h = block_hidden(g, u, np.where(keep_x, x, 0))
        keep_h = np.abs(np.where(rows[..., None], h, 0)).max((0, 1)) > t_h[0, e]
        return np.where(keep_h, h[idx], 0) @ dn.T

    want = _combine(model, hf, x, block)
    np.testing.assert_allclose(np.asarray(y)[valid[:, 0]], want[valid[:, 0]], atol=1e-5)
    assert aux["experts"]["density_x"].shape == (4,)


# ---------------------------------------------------------------- helpers with their own MLP function


def test_kv_calibration_runs_moe_layers(moe_models):
    model, _ = moe_models("qwen2_moe")  # layer 1 skipped: layer 0 (MoE) runs in both streams
    cal = calibrate_kv(model, skip=(1,), prompts=moe_corpus(), cache=False)
    assert cal.fit["layers"]["1"]["k_err_before"] < 1e-6  # the same input in both streams
