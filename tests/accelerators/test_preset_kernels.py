"""Low-rank-scored POP and per-layer-band POP through the Pallas kernels (docs/kernels.md, "POP's
presets"): low-rank POP reads its m selected candidates' gate and up rows through
`decode_ffn.gather_row_dots` and their down columns through `values_matvec`; per-layer bands read
the m_max band-zone down rows a branch uses (its retained, then its selected) through
`values_matvec`. The kernel path (interpret mode here) equals XLA's."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import popjax
from popjax import kernels
from popjax.kernels.ffn_layout import InputRows, OutputRows, channel_lines
from popjax.kernels.int8 import Int8Weight
from popjax.methods.pop.layer_bands import layer_bands_plan
from popjax.methods.pop.low_rank import factors_from_weights, lowrank_data, lowrank_plan
from tests.accelerators.kernel_paths import check_method_kernel
from tests.accelerators.targets import ffn_weights

# Runs Pallas kernels in interpret mode: the full suite checks these, the quick loop does not.
pytestmark = pytest.mark.slow

F, N_KEEP, D = 48, 30, 40


def _lowrank(w, aggregate):
    gate_up = np.asarray(w.gate_up.dequantize() if isinstance(w.gate_up, Int8Weight) else w.gate_up)
    data = lowrank_data(factors_from_weights([gate_up], rank=5))
    return lowrank_plan(f=F, n_keep=N_KEEP, m=6, aggregate=aggregate, rank=5), w.replace(data=data)


def _bands(w, aggregate):  # layer 2 of a band table (0, 6, 3), m_max = 6: 3 zone rows retained, 3 selected of 6
    return layer_bands_plan(f=F, n_keep=N_KEEP, m=4, bands=(0, 6, 3), aggregate=aggregate), w.replace(layer=jnp.int32(2))


@pytest.mark.parametrize("preset, int8, aggregate", [("lowrank", True, "shared"), ("lowrank", False, "per_sequence"),
                                                     ("bands", False, "shared"), ("bands", True, "per_sequence")])
def test_plan_step_through_the_kernels(preset, int8, aggregate):
    """The kernel path keeps the rows it reads in the kernels' layouts (low-rank: C's gate and up
    rows as `OutputRows`, its down columns as `InputRows`; bands: the zone's down rows as
    `InputRows`) and its decode step equals XLA's in outputs and selections."""
    xla, w = (_lowrank if preset == "lowrank" else _bands)(ffn_weights(int8), aggregate)
    rng = np.random.default_rng(1)
    x, x_t = jnp.asarray(rng.normal(size=(2, 5, D)), jnp.float32), jnp.asarray(rng.normal(size=(2, 1, D)), jnp.float32)
    valid, valid_t = jnp.ones((2, 5), bool), jnp.ones((2, 1), bool)
    outs = []
    for plan in (xla, dataclasses.replace(xla, kernel="pallas-interpret")):
        y, state, _ = plan.prefill(w, x, valid)
        y_t, _, aux = plan.decode(w, state, x_t, jnp.int32(0), valid_t)
        outs.append((y, state, y_t, aux))
    state = outs[1][1]
    lines = channel_lines(D)
    if preset == "lowrank":
        for name in ("gate_candidates", "up_candidates"):
            assert isinstance(state[name], OutputRows) and state[name].values.shape[-3:] == (xla.n_candidates, lines, 128)
        assert isinstance(state["down_candidates"], InputRows) and "gate_up_candidates" not in state
    else:
        assert isinstance(state["band_down_rows"], InputRows) and state["band_down_rows"].values.shape[-3:] == (12, lines, 128)
        assert int(np.asarray(outs[1][3]["band"]).reshape(-1)[0]) == 3
    np.testing.assert_array_equal(outs[1][0], outs[0][0])  # prefill does not use the kernels
    np.testing.assert_allclose(outs[1][2], outs[0][2], atol=2e-4, rtol=1e-5)
    np.testing.assert_array_equal(outs[1][3]["selected"], outs[0][3]["selected"])


@pytest.mark.parametrize("layout", ["unrolled", "scanned"])
def test_pallas_equals_xla(tiny_model, layout):
    """`kernel_paths.check_method_kernel`: the same greedy tokens and log-probs, low-rank POP on
    the unrolled tiny LLaMA and per-layer bands (a band per layer, so each layer's branch) on its
    scanned form."""
    if layout == "unrolled":
        method = popjax.LowRankPOP(ratio=0.4, gamma=0.3, rank=8, aggregate="per_sequence", kernel="xla").prepare(tiny_model)
    else:
        drift = np.linspace(0.1, 0.9, tiny_model.config.num_hidden_layers)
        method = popjax.LayerBandsPOP(ratio=0.4, gamma=0.2, aggregate="shared", kernel="xla").with_drift(drift)
        assert len(set(method.bind(tiny_model.config).bands)) > 1
    check_method_kernel(tiny_model, method, layout)


def test_bytes_say_what_the_kernels_read(tiny_model):
    """Through the TPU kernels each row they read is read whole (L·128 ≥ d): low-rank POP's m
    selected gate, up and down rows, the bands' m_max zone down rows; XLA and the GPU kernels, d."""
    cfg, d = tiny_model.config, tiny_model.config.hidden_size
    extra = channel_lines(d) * 128 - d
    drift = np.linspace(0.1, 0.9, cfg.num_hidden_layers)
    lowrank = lowrank_plan(f=cfg.intermediate_size, n_keep=60, m=8, rank=4)
    bands = popjax.LayerBandsPOP(ratio=0.4, gamma=0.2, kernel="xla").with_drift(drift).bind(cfg)
    for xla, rows in ((lowrank, 3 * 8), (bands, bands.band.m_max)):
        pallas = dataclasses.replace(xla, kernel="pallas-interpret")
        assert pallas.ffn_weights_read(d) - xla.ffn_weights_read(d) == extra * rows
        assert dataclasses.replace(pallas, kernel="pallas-gpu").ffn_weights_read(d) == xla.ffn_weights_read(d)


def test_kernel_hyper_parameter():
    """"auto" binds the kernels where they are compiled (`kernels.compiling_for`), XLA on this CPU;
    "pallas" is accepted (interpret mode here)."""
    for method in (popjax.LowRankPOP(ratio=0.4, rank=4), popjax.LayerBandsPOP(ratio=0.4)):
        with kernels.compiling_for("tpu"):
            assert method.resolved_kernel() == "pallas-tpu"
        assert method.resolved_kernel() == "xla"
        assert dataclasses.replace(method, kernel="pallas").resolved_kernel() == "pallas-interpret"
