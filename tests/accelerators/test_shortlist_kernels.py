"""Gate-scored POP, shortlisted POP and shortlisted dynamic selection through the Pallas kernels
(docs/kernels.md, "Gate-scored and shortlisted POP"): their steps read the up rows of the
candidates they score exactly through `decode_ffn.gather_row_dots` and the selected down columns
through `gather_matvec` (block shortlisted POP: its selected blocks through `block_matvec`); the
kernel path (interpret mode here) equals XLA's.

Everything else of a step is XLA's in both paths (the gate rows of C, the scores, the choices),
so the two differ only by the kernels' f32 accumulation order.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import popjax
from popjax import kernels
from popjax.kernels.ffn_layout import InputRows, OutputRows, channel_lines
from popjax.methods import MethodError
from popjax.methods.pop import POPPlan
from popjax.methods.pop.blocks import BlockBand
from popjax.methods.pop.gate_scored import GATE
from popjax.methods.pop.plan import UNKEPT_BAND
from popjax.methods.pop.shortlist import ShortlistScorer
from tests.accelerators.kernel_paths import check_method_kernel
from tests.accelerators.targets import ffn_weights

# Runs Pallas kernels in interpret mode: the full suite checks these, the quick loop does not.
pytestmark = pytest.mark.slow

PLANS = {  # one layer's plans, f = 48, n_keep = 30: POP's band (m = 6 of n_C = 12), and the unkept band (m = n_keep)
    "gate": POPPlan(f=48, n_keep=30, m=6, scorer=GATE),
    "shortlist": POPPlan(f=48, n_keep=30, m=6, scorer=ShortlistScorer(9, "up")),
    "dynamic-shortlist": POPPlan(f=48, n_keep=30, m=30, scorer=ShortlistScorer(36, "gated_up"), band=UNKEPT_BAND),
    "block-shortlist": POPPlan(f=48, n_keep=30, m=8, scorer=ShortlistScorer(12, "up", block=4), band=BlockBand(4)),  # 2 of 3 blocks of 4
}


@pytest.mark.parametrize("name, int8, aggregate", [("gate", True, "shared"), ("shortlist", False, "per_sequence"),
                                                    ("dynamic-shortlist", True, "per_sequence"), ("block-shortlist", True, "per_sequence"),
                                                    ("block-shortlist", False, "shared")])
def test_plan_step_through_the_kernels(name, int8, aggregate):
    """The kernel path keeps C's up rows as `OutputRows` (int8: their scales beside them) and its
    down columns as `InputRows`; its decode step equals XLA's in outputs and selections."""
    w = ffn_weights(int8)
    rng = np.random.default_rng(1)
    x, x_t = jnp.asarray(rng.normal(size=(2, 5, 40)), jnp.float32), jnp.asarray(rng.normal(size=(2, 1, 40)), jnp.float32)
    valid, valid_t = jnp.ones((2, 5), bool), jnp.ones((2, 1), bool)
    xla = dataclasses.replace(PLANS[name], aggregate=aggregate)
    outs = []
    for plan in (xla, dataclasses.replace(xla, kernel="pallas-interpret")):
        y, state, _ = plan.prefill(w, x, valid)
        y_t, _, aux = plan.decode(w, state, x_t, jnp.int32(0), valid_t)
        outs.append((y, state, y_t, aux))
    up, down = outs[1][1]["up_candidates"], outs[1][1]["down_candidates"]
    n_c = xla.n_candidates
    assert isinstance(up, OutputRows) and up.values.shape[-3:] == (n_c, channel_lines(40), 128) and (up.scale is not None) == int8
    assert isinstance(down, InputRows) and down.values.shape[-3:] == (n_c, channel_lines(40), 128)
    np.testing.assert_array_equal(outs[1][0], outs[0][0])  # prefill does not use the kernels
    np.testing.assert_allclose(outs[1][2], outs[0][2], atol=2e-4, rtol=1e-5)
    np.testing.assert_array_equal(outs[1][3]["selected"], outs[0][3]["selected"])


@pytest.mark.parametrize("method, family, layout", [
    (popjax.GateScoredPOP(ratio=0.4, gamma=0.4, aggregate="per_sequence", kernel="xla"), "llama", "unrolled"),
    (popjax.ShortlistPOP(ratio=0.4, gamma=0.4, shortlist=0.75, prior="up", aggregate="shared", kernel="xla"), "gemma3", "unrolled"),
    (popjax.ShortlistDynamic(ratio=0.4, shortlist=0.8, aggregate="shared", kernel="xla"), "llama", "scanned"),
    (popjax.ShortlistPOP(ratio=0.4, gamma=0.5, shortlist=0.75, block=8, aggregate="per_sequence", kernel="xla"), "llama", "scanned"),
], ids=["pop-gate", "pop-shortlist-gemma3", "dynamic-shortlist-scanned", "block-shortlist-scanned"])
def test_pallas_equals_xla(request, tiny_model, method, family, layout):
    """`kernel_paths.check_method_kernel`: the same greedy tokens and log-probs (the scanned
    model reads each layer's copies from the scan's stacked state)."""
    model = tiny_model if family == "llama" else request.getfixturevalue("gemma3")
    check_method_kernel(model, method, layout)


def test_bytes_say_what_the_kernels_read(tiny_model):
    """Through the TPU kernels (and interpret mode) each up row of the shortlist and each selected
    down row is read whole (L·128 ≥ d); through XLA or the GPU kernels, d."""
    cfg, d = tiny_model.config, tiny_model.config.hidden_size
    extra = channel_lines(d) * 128 - d
    for method in (popjax.GateScoredPOP(ratio=0.4, gamma=0.4), popjax.ShortlistPOP(ratio=0.4, gamma=0.4),
                   popjax.ShortlistDynamic(ratio=0.4)):
        xla = dataclasses.replace(method, kernel="xla").bind(cfg)
        pallas = dataclasses.replace(method, kernel="pallas").bind(cfg)
        rows = 2 * xla.m if xla.scorer is GATE else xla.scorer.s + xla.m
        assert xla.m > 0 and pallas.ffn_weights_read(d) - xla.ffn_weights_read(d) == extra * rows, method.name
        assert dataclasses.replace(pallas, kernel="pallas-gpu").ffn_weights_read(d) == xla.ffn_weights_read(d)


def test_kernel_hyper_parameter():
    """"auto" binds the kernels where they are compiled (`kernels.compiling_for`), XLA on this
    CPU; a bad value is one line naming the valid ones."""
    for method in (popjax.GateScoredPOP(ratio=0.4), popjax.ShortlistPOP(ratio=0.4), popjax.ShortlistDynamic(ratio=0.4)):
        assert method.kernel == "auto"
        with kernels.compiling_for("tpu"):
            assert method.plan_sizes(48, 30)["kernel"] == "pallas-tpu"
        assert method.plan_sizes(48, 30)["kernel"] == "xla"
    with pytest.raises(MethodError, match=r"kernel='mosaic' is not one of \('auto', 'xla', 'pallas'\)"):
        popjax.ShortlistDynamic(ratio=0.4, kernel="mosaic")
