"""Block static selection (``Static(ratio, block=b)``, popjax/methods/static.py) against a plain
NumPy reference written here with loops: n_keep in whole blocks, the blocks kept by the L2 norm
of their channels' prompt importance, the prompt's output and every decode step's over those
channels, per batch and per sequence; through XLA's compact copy and through the fused block
kernel on a block slab (interpret mode: the full suite only); bad input in one line."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest

import popjax
from popjax.kernels.block_slab import stacked_block_layout
from popjax.methods import MethodError, make_method
from popjax.methods.static import StaticPlan
from tests.reference.methods import ref_prefill
from tests.reference.ffn import as_jax, random_batch, random_layer, ref_hidden

ATOL = 1e-5
KERNELS = ["xla", pytest.param("pallas-interpret", marks=pytest.mark.slow)]


def ref_kept_blocks(importance, n_keep, b):
    """The n_keep/b blocks of b consecutive channels with the largest L2 norm of importance
    (ties: the lower block), as their channels in block rank order."""
    norms = [math.sqrt(sum(importance[k * b + i] ** 2 for i in range(b))) for k in range(len(importance) // b)]
    blocks = sorted(range(len(norms)), key=lambda k: (-norms[k], k))[: n_keep // b]
    return [k * b + i for k in blocks for i in range(b)]


def with_slab(W, b, order=None):
    """The layer as a plan receives it, with its block slab (of the channels in ``order``, a
    permutation [f], and the order itself when given) as the method's data (stacks of one)."""
    w = as_jax(W)
    gate_up, down = (w.gate_up, w.down) if order is None else (w.gate_up[:, order], w.down[:, order])
    data = {"slab": stacked_block_layout(gate_up[None], down[None], b)}
    if order is not None:
        data["order"] = jnp.asarray(order, jnp.int32)[None]
    return as_jax(W, data=data)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("f, n_keep, b, aggregate, permuted", [(96, 56, 8, "shared", False), (96, 40, 4, "per_sequence", False),
                                                               (64, 48, 16, "per_sequence", False), (96, 40, 8, "per_sequence", True),
                                                               (64, 32, 16, "shared", True)])
def test_block_static_matches_the_reference(f, n_keep, b, aggregate, permuted, kernel):
    """Blocks of the model's channel order, or (``permuted``: block_order="calibrated") of a
    given channel order: block k holds channels order[k·b … k·b + b − 1]."""
    rng = np.random.default_rng(f + n_keep + b)
    d = 16
    W = random_layer(rng, d, f)
    X, valid = random_batch(rng, d, [5, 8, 3], T=8)
    order = rng.permutation(f) if permuted else np.arange(f)
    plan = StaticPlan(f=f, n_keep=n_keep, aggregate=aggregate, block=b, kernel=kernel, calibrated_order=permuted)
    w = with_slab(W, b, order if permuted else None)
    y, state, _ = plan.prefill(w, jnp.asarray(X, jnp.float32), jnp.asarray(valid))
    if kernel != "xla":
        assert set(state) == {"kept_blocks"}  # no copy of the weights
    rows = [slice(0, 3)] if aggregate == "shared" else [slice(r, r + 1) for r in range(3)]
    kept = []
    for row in rows:
        importance = ref_prefill(W, X[row], valid[row], n_keep, 0)[3]
        kept.append([int(order[p]) for p in ref_kept_blocks(importance[order], n_keep, b)])
        Y_ref = ref_hidden(W, X[row])[..., kept[-1]] @ W["down"][kept[-1]]
        np.testing.assert_allclose(np.asarray(y[row])[valid[row]], Y_ref[valid[row]], atol=ATOL)
    for step in range(2):
        x_t = rng.normal(0, 1.0, (3, 1, d))
        y_t, state, _ = plan.decode(w, state, jnp.asarray(x_t, jnp.float32), step, jnp.ones((3, 1), bool))
        for row, channels in zip(rows, kept):
            y_ref = ref_hidden(W, x_t[row])[..., channels] @ W["down"][channels]
            np.testing.assert_allclose(np.asarray(y_t[row]), y_ref, atol=ATOL)


def test_sizes_bytes_and_bad_input(tiny_model):
    """n_keep whole blocks; through the kernel a per-sequence batch reads the union of its rows'
    blocks (at most B·n_keep channels, at most f), not a copy per row."""
    cfg = tiny_model.config
    f, d = cfg.intermediate_size, cfg.hidden_size
    channel = popjax.Static(0.4).bind(cfg)
    plan = make_method("static", ratio=0.4, block=8).bind(cfg)  # the registry spec "static:block=8"
    assert plan.n_keep == round(channel.n_keep / 8) * 8 and plan.kernel == "xla"
    assert popjax.Static(0.4, block=1).bind(cfg) == channel
    pallas = popjax.Static(0.4, block=8, kernel="pallas").bind(cfg)
    assert pallas.kernel == "pallas-interpret" and pallas.ffn_weights_read(d) == 3 * d * plan.n_keep
    assert pallas.ffn_weights_read_per_step(d, 2) == 3 * d * min(f, 2 * plan.n_keep)
    assert plan.ffn_weights_read_per_step(d, 2) == 2 * 3 * d * plan.n_keep  # a compact copy per row
    with pytest.raises(MethodError, match=r"^kernel='pallas' reads whole blocks of channels: use block > 1"):
        popjax.Static(0.4, kernel="pallas")
    with pytest.raises(MethodError, match=rf"^block=7 does not divide the FFN width f={f}"):
        popjax.Static(0.4, block=7).bind(cfg)
    with pytest.raises(MethodError, match=r"^block=0 is invalid"):
        popjax.Static(0.4, block=0)
    with pytest.raises(MethodError, match=r"^kernel='mosaic' is not one of \('auto', 'xla', 'pallas'\)"):
        popjax.Static(0.4, block=8, kernel="mosaic")
    with pytest.raises(MethodError, match=r"^block_order='calibrated' applies to block > 1 \(block=1\)$"):
        popjax.Static(0.4, block_order="calibrated")
    with pytest.raises(MethodError, match=r"^Static: block_order='calibrated' has no channel order: use Static\(...\).calibrate"):
        popjax.Static(0.4, block=8, block_order="calibrated").bind(cfg)
    with pytest.raises(MethodError, match=r"^Dynamic: block_order='calibrated' has no channel order: use Dynamic\(...\).calibrate"):
        popjax.Dynamic(0.4, block=8, block_order="calibrated").bind(cfg)
    with pytest.raises(MethodError, match=r"^block_order='sorted' is not one of \('model', 'calibrated'\)"):
        popjax.Dynamic(0.4, block=8, block_order="sorted")


def test_calibrated_order_ranks_each_layers_channels_by_corpus_importance(tiny_model):
    """`Static.calibrate`: each layer's channels by decreasing √Σ_t H[t, j]² · ‖W_d[:, j]‖₂ over
    the corpus's tokens (Σ H² is the calibration pipeline's, checked against transformers in
    test_calibration.py; the ranking is checked here, in NumPy)."""
    from popjax.calibration import collect
    from popjax.methods.flap import ActivationMoments
    from tests.reference.corpus import tiny_corpus

    corpus = tiny_corpus()
    method = popjax.Static(0.4, block=8, block_order="calibrated").calibrate(tiny_model, corpus, cache=False)
    assert method.needs_calibration and method.prepare(tiny_model) is method
    order, cfg = method.order.order, tiny_model.config
    assert order.shape == (cfg.num_hidden_layers, cfg.intermediate_size) and order.dtype == np.int32
    sumsq = collect(tiny_model, ActivationMoments(), corpus)["sumsq"]
    importance = np.sqrt(sumsq) * np.linalg.norm(np.asarray(tiny_model.ffn_stack().down, np.float64), axis=1)
    for layer in range(cfg.num_hidden_layers):
        assert sorted(order[layer].tolist()) == list(range(cfg.intermediate_size))
        assert np.all(np.diff(importance[layer][order[layer]]) <= 0)  # decreasing
    plan = method.bind(cfg)
    assert plan.calibrated_order and set(method.data(tiny_model)) == {"order"}
    pallas = dataclasses.replace(method, kernel="pallas")
    assert set(pallas.data(tiny_model)) == {"order", "slab"}
