"""Block static selection (``Static(ratio, block=b)``, popjax/methods/static.py) against a plain
NumPy reference written here with loops: n_keep in whole blocks, the blocks kept by the L2 norm
of their channels' prompt importance, the prompt's output and every decode step's over those
channels, per batch and per sequence; through XLA's compact copy and through the fused block
kernel on a block slab (interpret mode: the full suite only); bad input in one line."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

import popjax
from popjax.kernels.block_slab import stacked_block_layout
from popjax.methods import MethodError, make_method
from popjax.methods.static import StaticPlan
from tests.methods.test_methods_reference import ref_prefill
from tests.reference import as_jax, random_batch, random_layer, ref_hidden

ATOL = 1e-5
KERNELS = ["xla", pytest.param("pallas-interpret", marks=pytest.mark.slow)]


def ref_kept_blocks(importance, n_keep, b):
    """The n_keep/b blocks of b consecutive channels with the largest L2 norm of importance
    (ties: the lower block), as their channels in block rank order."""
    norms = [math.sqrt(sum(importance[k * b + i] ** 2 for i in range(b))) for k in range(len(importance) // b)]
    blocks = sorted(range(len(norms)), key=lambda k: (-norms[k], k))[: n_keep // b]
    return [k * b + i for k in blocks for i in range(b)]


def with_slab(W, b):
    """The layer as a plan receives it, with its block slab as the method's data (a stack of one)."""
    w = as_jax(W)
    return as_jax(W, data={"slab": stacked_block_layout(w.gate_up[None], w.down[None], b)})


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("f, n_keep, b, aggregate", [(96, 56, 8, "shared"), (96, 40, 4, "per_sequence"), (64, 48, 16, "per_sequence")])
def test_block_static_matches_the_reference(f, n_keep, b, aggregate, kernel):
    rng = np.random.default_rng(f + n_keep + b)
    d = 16
    W = random_layer(rng, d, f)
    X, valid = random_batch(rng, d, [5, 8, 3], T=8)
    plan = StaticPlan(f=f, n_keep=n_keep, aggregate=aggregate, block=b, kernel=kernel)
    w = with_slab(W, b)
    y, state, _ = plan.prefill(w, jnp.asarray(X, jnp.float32), jnp.asarray(valid))
    if kernel != "xla":
        assert set(state) == {"kept_blocks"}  # no copy of the weights
    rows = [slice(0, 3)] if aggregate == "shared" else [slice(r, r + 1) for r in range(3)]
    kept = []
    for row in rows:
        importance = ref_prefill(W, X[row], valid[row], n_keep, 0)[3]
        kept.append(ref_kept_blocks(importance, n_keep, b))
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
