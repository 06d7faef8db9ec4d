"""Per-expert calibration statistics on tiny mixture-of-experts models (docs/moe.md) against NumPy
loops over the tokens the router sent to each block: FLAP's moments, Wanda-sp's in-order
statistic, TEAL's histograms, the layer bands' drift and the low-rank POP's factors."""

from __future__ import annotations

import numpy as np
import pytest

from popjax import calibration
from popjax.calibration import Statistic, calibrate, collect
from popjax.methods.flap import ActivationMoments, flap_selection, layer_floor
from popjax.methods.pop.layer_bands import BandDrift
from popjax.methods.teal import AbsHistograms, block_quantiles
from popjax.methods.wanda_sp import WandaSPInOrder
from tests.reference.moe import block_hidden, layer_inputs, moe_corpus, per_block, slot_ffns


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
def inputs(moe_models):
    """kind -> the dense model's MLP inputs on `moe_corpus()` by layer: [L, B, T, d] float64."""
    cache = {}

    def get(kind):
        if kind not in cache:
            model, _ = moe_models(kind)
            cache[kind] = layer_inputs(model, collect(model, MLPInputs(), moe_corpus(), batch_size=8)["input"])
        return cache[kind]

    return get


def test_flap_moments_per_expert_match_numpy(moe_models, moe_ready, inputs):
    model, hf = moe_models("qwen2_moe")
    method = moe_ready("flap")  # its calibration wrote these moments to the (test) cache
    sums = calibrate(model, ActivationMoments(), moe_corpus())
    assert sums["sum"].shape == (2, 11, 16)

    def reference(g, u, dn, x, mask):
        h = block_hidden(g, u, x[mask])
        return h.sum(0), (h * h).sum(0), mask.sum()

    ref = per_block(model, hf, inputs("qwen2_moe"), reference)
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
    downs = [slot_ffns(model, hf, l)[s][2] for l, s in units]
    stats = {"sum": np.stack([ref[u][0] for u in units]), "sumsq": np.stack([ref[u][1] for u in units]),
             "tokens": np.array([ref[u][2] for u in units])}
    kept, bias, _ = flap_selection(stats, downs, n_keep, layer_floor(16, method.min_keep))
    for (layer, slot), k, b in zip(units, kept, bias):
        assert sel.kept[layer * 11 + slot] == tuple(k)
        np.testing.assert_allclose(sel.bias[layer * 11 + slot], b, atol=1e-5)
    for row in set(range(22)) - {l * 11 + s for l, s in units}:  # no block or no token: first n_keep, no bias
        assert sel.kept[row] == tuple(range(n_keep)) and not np.any(sel.bias[row])


def test_wanda_sp_in_order_per_expert_matches_numpy(moe_models, moe_ready):
    model, hf = moe_models("qwen2_moe")
    method = moe_ready("wanda-sp")
    n_keep = method.n_keep(model.config)
    sums = collect(model, WandaInputs(n_keep=n_keep), moe_corpus(), batch_size=6)  # one batch, as Wanda-sp runs

    def reference(g, u, dn, x, mask):
        h = block_hidden(g, u, x[mask])
        scores = np.abs(dn).mean(0) * np.sqrt((h * h).sum(0) / max(mask.sum(), 1))
        return scores, tuple(sorted(np.lexsort((np.arange(16), -scores))[:n_keep].tolist()))

    ref = per_block(model, hf, layer_inputs(model, sums["input"]), reference)  # layer 1 sees the pruned layer 0
    for (layer, slot), (scores, kept) in ref.items():
        np.testing.assert_allclose(sums["scores"][layer, slot], scores, atol=1e-5, rtol=1e-5)
        assert method.selection.kept[layer * 11 + slot] == kept
    assert method.selection.blocks == 11 and method.selection.widths == (n_keep,) * 22
    assert method.selection.kept[10] == tuple(range(n_keep))  # layer 0, slot 10: no block


def test_abs_histograms_per_expert_match_numpy(moe_models, inputs):
    model, hf = moe_models("qwen3_moe")
    sums = calibrate(model, AbsHistograms(), moe_corpus())  # shared with TEAL's calibration above
    edges = calibration.hist_edges()

    def hist(v):
        return np.bincount(np.searchsorted(edges, np.abs(v).reshape(-1), side="right"), minlength=len(edges) + 1)

    def reference(g, u, dn, x, mask):
        x = x[mask]
        return {"x": hist(x), "h": hist(block_hidden(g, u, x)), "gate": hist((lambda a: a / (1 + np.exp(-a)))(x @ g.T))}

    for (layer, slot), want in per_block(model, hf, inputs("qwen3_moe"), reference).items():
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


def test_band_drift_per_expert_matches_numpy(moe_models, moe_ready, inputs):
    model, hf = moe_models("qwen2_moe")
    plan = moe_ready("pop-bands").bind(model.config)
    n_keep = plan.n_keep
    sums = calibrate(model, BandDrift(n_keep=n_keep), corpus=moe_corpus())  # shared with LayerBandsPOP.prepare

    def top(imp):
        return set(np.lexsort((np.arange(16), -imp))[:n_keep].tolist())

    def reference(g, u, dn, x, mask):  # Σ over windows (prompts) with tokens of the block's drift
        total, prompts = 0.0, 0
        for b in np.flatnonzero(mask.any(1)):
            h = block_hidden(g, u, x[b, mask[b]])
            first = 2 * np.arange(len(h)) < len(h)
            imp = [np.sqrt((h[m] ** 2).sum(0)) * np.linalg.norm(dn, axis=0) for m in (first, ~first)]
            total, prompts = total + 1 - len(top(imp[0]) & top(imp[1])) / n_keep, prompts + 1
        return total, prompts

    for (layer, slot), (total, prompts) in per_block(model, hf, inputs("qwen2_moe"), reference).items():
        np.testing.assert_allclose(sums["drift"][layer, slot], total, atol=1e-5)
        assert sums["prompts"][layer, slot] == prompts
    used = model.config.moe.slot_mask(2).reshape(-1)
    assert plan.blocks == 11 and len(plan.bands) == 22 and sum(np.asarray(plan.bands)[used]) <= used.sum() * plan.m


def test_lowrank_factors_per_block_match_numpy_svd(moe_models, moe_ready):
    model, hf = moe_models("qwen2_moe")
    factors = moe_ready("pop-lowrank").factors
    assert factors.blocks == 11 and factors.inputs.shape == (22, 2, 32, 4)
    for layer in range(2):
        for slot, ffn in enumerate(slot_ffns(model, hf, layer)):
            row = layer * 11 + slot
            if ffn is None:
                assert not np.any(factors.inputs[row] @ factors.outputs[row])
                continue
            for k, w in enumerate(ffn[:2]):  # gate, up [f, d]: rank-4 reconstruction of W
                u, s, vt = np.linalg.svd(w, full_matrices=False)
                want = (u[:, :4] * s[:4]) @ vt[:4]
                np.testing.assert_allclose((factors.inputs[row, k] @ factors.outputs[row, k]).T, want, atol=1e-5)
