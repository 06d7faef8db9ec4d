"""FFN-pruning methods on mixture-of-experts models (issue 14; docs/moe.md): generation on tiny
random Qwen3-MoE and Qwen2-MoE models, traces on a model that mixes dense and MoE layers, per-expert calibration statistics against NumPy loops over the tokens the router sent
to each expert, and per-block calibrated constants used at run time. Every registered method runs
on the mixed model in tests/methods/test_method_matrix.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import popjax
from popjax import calibration, engine
from popjax.methods.prefill_only.calibrate import calibrate_kv
from popjax.calibration import Corpus, Statistic, calibrate, collect
from popjax.convert import convert as conv
from popjax.loading import build_model
from popjax.methods import MethodError, make_method
from popjax.methods.flap import ActivationMoments, flap_selection, layer_floor
from popjax.methods.pop.layer_bands import BandDrift
from popjax.methods.teal import AbsHistograms, Thresholds, block_quantiles, thresholds_data
from popjax.methods.wanda_sp import ChannelSelection, SelectionPlan, WandaSPInOrder, selection_data
from popjax.models.config import ModelConfig
from popjax.models.moe import moe_mlp

BASE = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
# qwen2_moe: a sparse layer (8 experts + a 24-wide shared expert = 1.5 blocks) and a dense layer
# (mlp_only_layers, 40 wide = 2.5 blocks): 11 block slots, slot 10 empty in layer 0, 0-7 in layer 1.
# qwen3_moe: one layer of 4 routed experts (4 slots); a batch of one routes 2 of 4 (gathered decode).
CONFIGS = {
    "qwen2_moe": dict(num_hidden_layers=2, intermediate_size=40, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                      num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1]),
    "qwen3_moe": dict(num_hidden_layers=1, intermediate_size=48, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                      head_dim=8, norm_topk_prob=True),
}
PROMPTS = {"qwen2_moe": [[5, 6, 7, 8, 9], [10, 11, 12]], "qwen3_moe": [[5, 6, 7, 8]]}


def _build(kind: str, seed: int = 0):
    """A random model (float32) and its HF-layout weights (float64 numpy)."""
    cfg = ModelConfig.from_hf_dict({"model_type": kind, **BASE, **CONFIGS[kind]})
    rng = np.random.default_rng(seed)
    hf = {k: rng.normal(0, 0.3, size=s) for k, s in conv.checkpoint_shapes(cfg).items()}
    tree = conv.unflatten({k: v.astype(np.float32) for k, v in hf.items()})
    return build_model(cfg, tree, None, kind, "float32"), hf


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(kind):
        if kind not in cache:
            cache[kind] = _build(kind)
        return cache[kind]

    return get


def _corpus(windows: int = 6, window: int = 16) -> Corpus:
    return Corpus.from_token_ids("random", np.random.default_rng(1).integers(3, 64, windows * window), window=window)


# ---------------------------------------------------------------- methods ready for the mixed model

@pytest.fixture(scope="module")
def ready(models):
    """name -> the registered method ready for the mixed Qwen2-MoE model (memoised, as the method
    matrix readies it: prefill-only skips the MoE layer, its experts' states from the boundary token)."""
    from tests.methods.test_method_matrix import ready as ready_method  # (that module imports this one's configs)

    model, _ = models("qwen2_moe")
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = ready_method(name, "moe", model)
        return cache[name]

    return get


def test_generate_on_qwen3_moe_with_per_expert_constants(models):
    """generate on a Qwen3-MoE (no shared expert: 4 slots; one prompt routes 2 of 4 experts, so
    decode gathers them) with TEAL, whose thresholds are per expert."""
    model, _ = models("qwen3_moe")
    method = popjax.TEAL(0.2).calibrate(model, _corpus())
    ids, _ = popjax.generate_ids(model, PROMPTS["qwen3_moe"], max_new_tokens=3, method=method, stop_ids=[])
    assert len(ids[0]) == 3 and np.shape(method.thresholds.get("x")) == (1, 4)


def test_generate_traces_a_model_mixing_dense_and_moe_layers(models, ready):
    """POP's trace (return_trace=True) on the mixed model: partitions, prefill and decode aux
    stacked over layers, the dense layer's entries zero-padded into the MoE layout."""
    model, _ = models("qwen2_moe")
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


def test_unusable_cases_fail_with_clear_errors(models):
    model, _ = models("qwen3_moe")
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


# ---------------------------------------------------------------- per-expert statistics vs NumPy


class MLPInputs(Statistic):
    """The MLP input of every layer (unmasked: every block of a layer sees the same x)."""

    name = "test_mlp_inputs"

    def collect(self, w, x, valid, h):
        return {"input": x}


class WandaInputs(WandaSPInOrder):
    """Wanda-sp's in-order statistic plus the MLP input it saw (after the pruned earlier layers)."""

    def collect(self, w, x, valid, h):
        return {**super().collect(w, x, valid, h), "input": x}


@pytest.fixture(scope="module")
def inputs(models):
    """kind -> the dense model's MLP inputs on `_corpus()` by layer: [L, B, T, d] float64."""
    cache = {}

    def get(kind):
        if kind not in cache:
            model, _ = models(kind)
            cache[kind] = _layer_inputs(model, collect(model, MLPInputs(), _corpus(), batch_size=8)["input"])
        return cache[kind]

    return get


def _layer_inputs(model, by_slot_input: np.ndarray) -> np.ndarray:
    """[L, slots, B, T, d] (one copy per block) -> [L, B, T, d] from a slot each layer has."""
    mask = model.config.moe.slot_mask(model.config.num_hidden_layers)
    return np.stack([by_slot_input[l, np.flatnonzero(mask[l])[0]] for l in range(len(mask))]).astype(np.float64)


def _slot_ffns(model, hf, layer: int):
    """Per slot (gate [f, d], up [f, d], down [d, f]) float64 in the model's stored channel order
    (zeros for padding), taken from the HF-layout weights; None for a slot without a block."""
    moe, p = model.config.moe, f"layers.{layer}.mlp."
    mlp = nnx.merge(model.graphdef, model.params).layers[layer].mlp
    blocks = [(e, f"{p}experts.{e}.", mlp.experts.channel_order[e]) for e in range(moe.num_experts) if moe.is_sparse(layer)]
    if hasattr(mlp, "shared"):  # a shared expert, or a dense layer's FFN, split into blocks
        prefix = p + "shared." if moe.is_sparse(layer) else p
        blocks += [(moe.num_experts + b, prefix, order) for b, order in enumerate(mlp.shared.channel_order[...])]
    out = [None] * moe.slots(model.config.num_hidden_layers)
    for slot, prefix, order in blocks:
        real, ids = np.asarray(order) >= 0, np.maximum(np.asarray(order), 0)
        rows = lambda w: np.where(real[:, None], w[ids], 0.0)
        out[slot] = (rows(hf[prefix + "gate"]), rows(hf[prefix + "up"]), rows(hf[prefix + "down"].T).T)
    return out


def _routed(model, hf, layer: int, x: np.ndarray) -> np.ndarray:
    """[slots, B, T] bool: the tokens each block sees (top-k experts by router; always-active blocks: all)."""
    cfg = model.config
    S, E, k = cfg.moe.slots(cfg.num_hidden_layers), cfg.moe.num_experts, cfg.moe.top_k
    mask = np.zeros((S, *x.shape[:2]), bool)
    mask[E:] = True
    if cfg.moe.is_sparse(layer):
        logits = x @ hf[f"layers.{layer}.mlp.router"].T
        for idx in np.ndindex(*x.shape[:2]):
            mask[(np.argsort(-logits[idx], kind="stable")[:k], *idx)] = True  # softmax keeps the order
    return mask


def _h(g, u, x):
    a, b = x @ g.T, x @ u.T
    return a / (1 + np.exp(-a)) * b


def _per_block(model, hf, x_layers, fn):
    """fn(gate, up, down, x [B, T, d], mask [B, T] of the block's tokens) for every block, with
    x_layers [L, B, T, d] the MLP inputs -> {(layer, slot): value}."""
    out = {}
    for layer, x in enumerate(x_layers):
        routed = _routed(model, hf, layer, x)
        for slot, ffn in enumerate(_slot_ffns(model, hf, layer)):
            if ffn is not None:
                out[layer, slot] = fn(*ffn, x, routed[slot])
    return out


def test_flap_moments_per_expert_match_numpy(models, ready, inputs):
    model, hf = models("qwen2_moe")
    method = ready("flap")  # its calibration wrote these moments to the (test) cache
    sums = calibrate(model, ActivationMoments(), _corpus())
    assert sums["sum"].shape == (2, 11, 16)

    def reference(g, u, dn, x, mask):
        h = _h(g, u, x[mask])
        return h.sum(0), (h * h).sum(0), mask.sum()

    ref = _per_block(model, hf, inputs("qwen2_moe"), reference)
    assert len({ref[0, e][2] for e in range(8)}) > 1  # the experts saw different numbers of tokens
    for (layer, slot), (s, sq, n) in ref.items():
        np.testing.assert_allclose(sums["sum"][layer, slot], s, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(sums["sumsq"][layer, slot], sq, atol=1e-5, rtol=1e-5)
        assert sums["tokens"][layer, slot] == n
    empty = ~model.config.moe.slot_mask(2)
    assert not np.any(sums["tokens"][empty]) and not np.any(sums["sumsq"][empty])

    # FLAP over the blocks: the blocks with tokens are FLAP's units, one global threshold
    sel, n_keep = method.selection, method.n_keep(model.config)
    assert sel.blocks == 11 and len(sel.kept) == 22
    units = sorted(k for k, v in ref.items() if v[2] > 0)
    downs = [_slot_ffns(model, hf, l)[s][2] for l, s in units]
    stats = {"sum": np.stack([ref[u][0] for u in units]), "sumsq": np.stack([ref[u][1] for u in units]),
             "tokens": np.array([ref[u][2] for u in units])}
    kept, bias, _ = flap_selection(stats, downs, n_keep, layer_floor(16, method.min_keep))
    for (layer, slot), k, b in zip(units, kept, bias):
        assert sel.kept[layer * 11 + slot] == tuple(k)
        np.testing.assert_allclose(sel.bias[layer * 11 + slot], b, atol=1e-5)
    for row in set(range(22)) - {l * 11 + s for l, s in units}:  # no block or no token: first n_keep, no bias
        assert sel.kept[row] == tuple(range(n_keep)) and not np.any(sel.bias[row])


def test_wanda_sp_in_order_per_expert_matches_numpy(models, ready):
    model, hf = models("qwen2_moe")
    method = ready("wanda-sp")
    n_keep = method.n_keep(model.config)
    sums = collect(model, WandaInputs(n_keep=n_keep), _corpus(), batch_size=6)  # one batch, as Wanda-sp runs

    def reference(g, u, dn, x, mask):
        h = _h(g, u, x[mask])
        scores = np.abs(dn).mean(0) * np.sqrt((h * h).sum(0) / max(mask.sum(), 1))
        return scores, tuple(sorted(np.lexsort((np.arange(16), -scores))[:n_keep].tolist()))

    ref = _per_block(model, hf, _layer_inputs(model, sums["input"]), reference)  # layer 1 sees the pruned layer 0
    for (layer, slot), (scores, kept) in ref.items():
        np.testing.assert_allclose(sums["scores"][layer, slot], scores, atol=1e-5, rtol=1e-5)
        assert method.selection.kept[layer * 11 + slot] == kept
    assert method.selection.blocks == 11 and method.selection.widths == (n_keep,) * 22
    assert method.selection.kept[10] == tuple(range(n_keep))  # layer 0, slot 10: no block


def test_abs_histograms_per_expert_match_numpy(models, inputs):
    model, hf = models("qwen3_moe")
    sums = calibrate(model, AbsHistograms(), _corpus())  # shared with TEAL's calibration above
    edges = calibration.hist_edges()

    def hist(v):
        return np.bincount(np.searchsorted(edges, np.abs(v).reshape(-1), side="right"), minlength=len(edges) + 1)

    def reference(g, u, dn, x, mask):
        x = x[mask]
        return {"x": hist(x), "h": hist(_h(g, u, x)), "gate": hist((lambda a: a / (1 + np.exp(-a)))(x @ g.T))}

    for (layer, slot), want in _per_block(model, hf, inputs("qwen3_moe"), reference).items():
        for name, counts in want.items():
            got = sums[name][layer, slot]
            assert got.sum() == counts.sum()
            assert np.abs(got - counts).sum() <= 4, (name, slot)  # fp32 log10 may move a value over a bin edge
    # TEAL's per-block thresholds: a block without calibration tokens takes its layer's pooled quantile
    counts = np.asarray(sums["h"]).copy()
    counts[0, 1] = 0
    t = block_quantiles(counts, 0.4)
    assert np.shape(t) == (1, 4) and t[0][1] == calibration.histogram_quantile(counts[0].sum(0), 0.4)
    assert t[0][2] == calibration.histogram_quantile(counts[0, 2], 0.4)


def test_band_drift_per_expert_matches_numpy(models, ready, inputs):
    model, hf = models("qwen2_moe")
    plan = ready("pop-bands").bind(model.config)
    n_keep = plan.n_keep
    sums = calibrate(model, BandDrift(n_keep=n_keep), corpus=_corpus())  # shared with LayerBandsPOP.prepare

    def top(imp):
        return set(np.lexsort((np.arange(16), -imp))[:n_keep].tolist())

    def reference(g, u, dn, x, mask):  # Σ over windows (prompts) with tokens of the block's drift
        total, prompts = 0.0, 0
        for b in np.flatnonzero(mask.any(1)):
            h = _h(g, u, x[b, mask[b]])
            first = 2 * np.arange(len(h)) < len(h)
            imp = [np.sqrt((h[m] ** 2).sum(0)) * np.linalg.norm(dn, axis=0) for m in (first, ~first)]
            total, prompts = total + 1 - len(top(imp[0]) & top(imp[1])) / n_keep, prompts + 1
        return total, prompts

    for (layer, slot), (total, prompts) in _per_block(model, hf, inputs("qwen2_moe"), reference).items():
        np.testing.assert_allclose(sums["drift"][layer, slot], total, atol=1e-5)
        assert sums["prompts"][layer, slot] == prompts
    used = model.config.moe.slot_mask(2).reshape(-1)
    assert plan.blocks == 11 and len(plan.bands) == 22 and sum(np.asarray(plan.bands)[used]) <= used.sum() * plan.m


def test_lowrank_factors_per_block_match_numpy_svd(models, ready):
    model, hf = models("qwen2_moe")
    factors = ready("pop-lowrank").factors
    assert factors.blocks == 11 and factors.inputs.shape == (22, 2, 32, 4)
    for layer in range(2):
        for slot, ffn in enumerate(_slot_ffns(model, hf, layer)):
            row = layer * 11 + slot
            if ffn is None:
                assert not np.any(factors.inputs[row] @ factors.outputs[row])
                continue
            for k, w in enumerate(ffn[:2]):  # gate, up [f, d]: rank-4 reconstruction of W
                u, s, vt = np.linalg.svd(w, full_matrices=False)
                want = (u[:, :4] * s[:4]) @ vt[:4]
                np.testing.assert_allclose((factors.inputs[row, k] @ factors.outputs[row, k]).T, want, atol=1e-5)


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


def test_selection_plan_uses_each_blocks_channels_and_bias(models):
    model, hf = models("qwen2_moe")
    rng = np.random.default_rng(3)
    S, f, d = 11, 16, 32
    kept = [tuple(sorted(rng.choice(f, size=int(rng.integers(4, 13)), replace=False).tolist())) for _ in range(2 * S)]
    bias = rng.normal(size=(2 * S, d))
    plan = SelectionPlan(f=f, n_keep=8, n_max=max(map(len, kept)), blocks=S)
    data = selection_data(kept, bias.astype(np.float32), blocks=S)
    x = rng.normal(size=(2, 5, d))
    y, _, _ = _layer_fn(model, lambda w, s, x, rows: plan.prefill(w.replace(data=data), x, None), None,
                        jnp.asarray(x, jnp.float32))
    ffns = _slot_ffns(model, hf, 0)

    def block(slot, idx):
        g, u, dn = ffns[slot]
        k = list(kept[slot])
        return _h(g[k], u[k], x[idx]) @ dn[:, k].T + bias[slot]

    np.testing.assert_allclose(np.asarray(y), _combine(model, hf, x, block), atol=1e-5)


def test_teal_decode_uses_each_experts_thresholds(models):
    model, hf = models("qwen3_moe")
    rng = np.random.default_rng(4)
    t_x, t_h = rng.uniform(0.2, 0.8, size=(1, 4)), rng.uniform(0.01, 0.1, size=(1, 4))
    plan = popjax.methods.TEALPlan(f=16, n_keep=8, sparsity=0.5, aggregate="max")
    data = thresholds_data({"x": t_x, "h": t_h})
    x = rng.normal(size=(3, 1, 32))
    valid = np.array([[True], [True], [False]])  # a stopped row takes no part in any aggregate
    fn = lambda w, s, x, rows: plan.decode(w.replace(data=data), s, x, jnp.int32(0), rows)
    y, _, aux = _layer_fn(model, fn, None, jnp.asarray(x, jnp.float32), valid)
    routed = _routed(model, hf, 0, x[:, :, :]) & valid[None]
    ffns = _slot_ffns(model, hf, 0)

    def block(e, idx):
        g, u, dn = ffns[e]
        rows = routed[e]  # the expert's valid rows [B, 1]
        keep_x = np.abs(np.where(rows[..., None], x, 0)).max((0, 1)) > t_x[0, e]
        h = _h(g, u, np.where(keep_x, x, 0))
        keep_h = np.abs(np.where(rows[..., None], h, 0)).max((0, 1)) > t_h[0, e]
        return np.where(keep_h, h[idx], 0) @ dn.T

    want = _combine(model, hf, x, block)
    np.testing.assert_allclose(np.asarray(y)[valid[:, 0]], want[valid[:, 0]], atol=1e-5)
    assert aux["experts"]["density_x"].shape == (4,)


# ---------------------------------------------------------------- helpers with their own MLP function


def test_kv_calibration_runs_moe_layers(models):
    model, _ = models("qwen2_moe")  # layer 1 skipped: layer 0 (MoE) runs in both streams
    cal = calibrate_kv(model, skip=(1,), prompts=_corpus(), cache=False)
    assert cal.fit["layers"]["1"]["k_err_before"] < 1e-6  # the same input in both streams
