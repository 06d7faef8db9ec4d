"""The ``kernel`` hyper-parameter of the methods that choose H's channels per step from values
computed densely, CATS and dynamic POP (docs/kernels.md, "CATS and dynamic POP"), through the
Pallas kernels (the TPU ones in interpret mode here) equal to their XLA path in greedy tokens and
log-probabilities; the copies of the weights they carry; what they read per step; the platform
choice and the bad inputs.

Dynamic POP scores every channel from H, so gate and up stay XLA's dense matmuls and only its
down read goes through `kernels.decode_ffn.masked_matvec` (the input-major down copy, shared with
TEAL's). CATS keeps a channel by its gate value: the gate stays dense, and one
`kernels.decode_ffn.gated_ffn` call reads the kept channels' up and down rows.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import pytest

import popjax
from popjax import kernels
from popjax.methods import MethodError
from popjax.kernels import decode_ffn, ffn_gpu, ffn_layout
from popjax.kernels.int8 import quantize
from tests.accelerators.kernel_paths import check_method_kernel, placeholder_thresholds, ready

# Runs Pallas kernels in interpret mode: the full suite checks these, the quick loop does not.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llama_int8(tiny_checkpoints):
    """The tiny LLaMA with int8 weights and float activations (the kernels' int8 form: int8
    rows, per-channel scales, float x), loaded once for this file."""
    directory, _ = tiny_checkpoints("llama-gqa")
    return popjax.load(directory, cache=False, weights="int8", activations="float")


# (method, family, layout, aggregate): both FFN activations for CATS (dynamic POP's kernel reads H,
# after the activation), the batch's shared selection and per-row ones (CATS's per-token masks;
# dynamic's per-sequence selection: the kernel under vmap), and the scanned model, where the layer
# index the kernel reads the stacked copy at is traced (there block dynamic selection, whose
# blocks the block kernel reads, also in a calibrated channel order); int8 weights (their scales in CATS's copy)
CASES = [("cats", "llama", "unrolled", "max"), ("cats", "gemma3", "scanned", "per_token"), ("cats", "llama_int8", "unrolled", "per_token"),
         ("dynamic", "llama", "unrolled", "per_sequence"), ("dynamic-block", "llama", "scanned", "shared"),
         ("dynamic-block-calibrated", "llama", "scanned", "per_sequence")]


@pytest.mark.parametrize("name, family, layout, aggregate", CASES)
def test_pallas_equals_xla(request, tiny_model, tmp_path_factory, name, family, layout, aggregate):
    """`kernel_paths.check_method_kernel`: the same greedy tokens and log-probs, batch 2."""
    model = tiny_model if family == "llama" else request.getfixturevalue(family)
    check_method_kernel(model, ready(name, model, aggregate, tmp_path_factory.mktemp("calibration")), layout, seed=1)


@pytest.mark.parametrize("kernel", ["pallas-interpret", "pallas-gpu"])
def test_gated_ffn_above_the_kernels_rows_and_at_one_layer(kernel, monkeypatch):
    """`decode_ffn.gated_ffn`, CATS's call: 70 rows (above `ffn_layout.MAX_BATCH` = 64: chunks of
    64, each with its own union and its rows' gate values) with per-row masks, from a stack of 2
    layers at layer 1; and one layer's rows (``layer=None``) with a shared mask. Against NumPy:
    y[r] = Σ_j kept gate[r, j] · (up_j · x_r) · down[:, j]."""
    # the GPU kernel in its own interpret mode (this CPU has no GPU)
    monkeypatch.setattr(ffn_gpu, "gather_ffn", functools.partial(ffn_gpu.gather_ffn, interpret=True))
    rng = np.random.default_rng(7)
    layers, f, d, batch = 2, 48, 40, 70
    up, down = rng.normal(size=(layers, f, d)).astype(np.float32), rng.normal(size=(layers, d, f)).astype(np.float32)
    x, gate = rng.normal(size=(batch, d)).astype(np.float32), rng.normal(size=(batch, f)).astype(np.float32)
    active = rng.random((batch, f)) < 0.4
    stack = ffn_layout.stacked_up_down_layout(jnp.asarray(up), jnp.asarray(down))
    got = decode_ffn.gated_ffn(jnp.asarray(x), stack, jnp.asarray(active), jnp.asarray(gate), layer=1, act="silu",
                               expected_active=20, kernel=kernel)
    np.testing.assert_allclose(np.asarray(got), (np.where(active, gate, 0) * (x @ up[1].T)) @ down[1].T, atol=2e-4, rtol=1e-4)
    one, shared = ffn_layout.ChannelRows(stack.values[:, 0]), active[0]
    got = decode_ffn.gated_ffn(jnp.asarray(x[:3]), one, jnp.asarray(shared), jnp.asarray(gate[:3]), layer=None, act="silu",
                               expected_active=20, kernel=kernel)
    np.testing.assert_allclose(np.asarray(got), (np.where(shared, gate[:3], 0) * (x[:3] @ up[0].T)) @ down[0].T, atol=2e-4, rtol=1e-4)

def test_the_copies_they_read(tiny_model):
    """Dynamic POP carries ``rows = {"down": ...}``, W_d input-major (row j = channel j's
    column), the same array TEAL's kernel reads (built once per model); CATS ``up_down``, every
    layer's up rows and down columns as channel rows [2, L, f, L_d, 128]; with XLA no copy."""
    cfg = tiny_model.config
    L, f, d = cfg.num_hidden_layers, cfg.intermediate_size, cfg.hidden_size
    cats = placeholder_thresholds(cfg, popjax.CATS(ffn_sparsity=0.5, kernel="pallas"))
    dynamic = popjax.Dynamic(ratio=0.4, kernel="pallas")
    teal = placeholder_thresholds(cfg, popjax.TEAL(ratio=0.4, kernel="pallas"))
    rows = dynamic.data(tiny_model)["rows"]
    assert set(rows) == {"down"} and rows["down"].values.shape == (L, f, ffn_layout.channel_lines(d), 128)
    stack = tiny_model.ffn_stack()
    np.testing.assert_array_equal(np.asarray(rows["down"].values[1]).reshape(f, -1)[:, :d], np.asarray(stack.down[1]).T)
    assert teal.data(tiny_model)["rows"]["down"] is rows["down"]  # one down copy per model
    up_down = cats.data(tiny_model)["up_down"]
    assert up_down.values.shape == (2, L, f, ffn_layout.channel_lines(d), 128) and up_down.gate_up_scale is None
    np.testing.assert_array_equal(np.asarray(up_down.values[0, 1]).reshape(f, -1)[:, :d], np.asarray(stack.gate_up[1, 1]))
    np.testing.assert_array_equal(np.asarray(up_down.values[1, 0]).reshape(f, -1)[:, :d], np.asarray(stack.down[0]).T)
    assert cats.data(tiny_model)["up_down"] is up_down and "rows" not in cats.data(tiny_model)
    assert "up_down" not in dataclasses.replace(cats, kernel="xla").data(tiny_model)
    assert dataclasses.replace(dynamic, kernel="xla").data(tiny_model) is None
    assert popjax.Dynamic(ratio=0.0, kernel="pallas").data(tiny_model) is None  # keeps every channel: dense


def test_weights_read_per_step(tiny_model):
    """XLA's dynamic gathers the n_keep down columns; the TPU kernel reads each selected row of
    the down copy whole (L·128 lanes), the GPU kernel its d entries. CATS: all of W_g, then the
    kept channels' rows of W_u and W_d (L·128 lanes each on TPU)."""
    cfg = tiny_model.config
    f, d = cfg.intermediate_size, cfg.hidden_size
    lanes = ffn_layout.channel_lines(d) * 128
    xla = popjax.Dynamic(ratio=0.4, kernel="xla").bind(cfg)
    n_keep = xla.n_keep
    assert xla.ffn_weights_read(d) == 2 * d * f + d * n_keep
    tpu, gpu = (dataclasses.replace(xla, kernel=k) for k in ("pallas-tpu", "pallas-gpu"))
    assert tpu.ffn_weights_read(d) == 2 * d * f + lanes * n_keep and gpu.ffn_weights_read(d) == 2 * d * f + d * n_keep
    cats = placeholder_thresholds(cfg, popjax.CATS(ffn_sparsity=0.5, kernel="xla")).bind(cfg)
    kept = round(f * (1 - cats.sparsity))
    assert cats.ffn_weights_read(d) == round(d * f * (1 + 2 * (1 - cats.sparsity)))
    assert dataclasses.replace(cats, kernel="pallas-tpu").ffn_weights_read(d) == d * f + 2 * lanes * kept
    assert dataclasses.replace(cats, kernel="pallas-gpu").ffn_weights_read(d) == cats.ffn_weights_read(d)


def test_kernel_choice_and_bad_input(tiny_model):
    """"auto" is XLA on this CPU and the platform's kernel where programs compile for a TPU or a
    GPU (`kernels.compiling_for`); a mixture-of-experts model keeps XLA and refuses "pallas" in
    one line; an unknown kernel is one line."""
    cfg = tiny_model.config
    for method in (popjax.Dynamic(ratio=0.4), placeholder_thresholds(cfg, popjax.CATS(ffn_sparsity=0.5))):
        assert method.kernel == "auto" and method.bind(cfg).kernel == "xla"
        with kernels.compiling_for("tpu"):
            assert method.bind(cfg).kernel == "pallas-tpu"
        with kernels.compiling_for("gpu"):
            assert method.bind(cfg).kernel == "pallas-gpu"
    moe = dataclasses.replace(cfg, moe=object())  # what `loaded.uniform_ffn` asks: a mixture of experts
    assert popjax.Dynamic(ratio=0.4).resolved_kernel(moe) == "xla"
    with pytest.raises(MethodError) as err:
        popjax.Dynamic(ratio=0.4, kernel="pallas").resolved_kernel(moe)
    assert str(err.value).startswith("Dynamic: kernel='pallas' reads a stack of equal dense FFN weights") and "\n" not in str(err.value)
    for make in (popjax.Dynamic, popjax.CATS):
        with pytest.raises(MethodError, match="kernel='triton' is not one of"):
            make(ratio=0.4, kernel="triton")
    # block dynamic selection: n_keep in whole blocks, a block that does not divide f refused
    channel, block = popjax.Dynamic(ratio=0.4).bind(cfg), popjax.Dynamic(ratio=0.4, block=8).bind(cfg)
    assert block.n_keep % 8 == 0 and abs(block.n_keep - channel.n_keep) <= 4 and block.block == 8
    with pytest.raises(MethodError, match=f"block=5 does not divide the FFN width f={cfg.intermediate_size}"):
        popjax.Dynamic(ratio=0.4, block=5).bind(cfg)
    with pytest.raises(MethodError, match="block=0 is invalid"):
        popjax.Dynamic(ratio=0.4, block=0)


@pytest.mark.parametrize("kernel", ["pallas-interpret", "pallas-gpu"])
def test_block_matvec_reads_a_layer_of_a_stack(kernel, monkeypatch):
    """`decode_ffn.block_matvec` on a stack of 3 layers' int8 input rows read at layer 2 (block
    dynamic selection's down read of the model's copy): blocks 5, 2, 2 (a repeat, counted once),
    11, −1 (nothing) and 5 again after another (counted again), against NumPy."""
    monkeypatch.setattr(ffn_gpu, "gather_matvec", functools.partial(ffn_gpu.gather_matvec, interpret=True))
    rng = np.random.default_rng(8)
    layers, k, n, b, batch = 3, 96, 40, 8, 2
    w = rng.normal(size=(layers, n, k)).astype(np.float32)
    q, s = quantize(w)
    rows = ffn_layout.stacked_input_layout(jnp.asarray(q), jnp.asarray(s))
    x = rng.normal(size=(batch, k)).astype(np.float32)
    ids = [5, 2, 2, 11, -1, 5]
    got = decode_ffn.block_matvec(jnp.asarray(x), rows, jnp.asarray(ids, jnp.int32), block=b, out_features=n, layer=2, kernel=kernel)
    w2, want, prev = q[2] * s[2], np.zeros((batch, n)), None
    for j in ids:
        if 0 <= j < k // b and j != prev:
            want += x[:, j * b : (j + 1) * b] @ w2[:, j * b : (j + 1) * b].T
        prev = j
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-3, rtol=1e-5)
