"""The ``kernel`` hyper-parameter of the input-masking methods, TEAL and WINA (docs/kernels.md,
"TEAL's wiring"): the input-masked matvec (`kernels.decode_ffn.masked_matvec`, the TPU kernel in
interpret mode and the GPU one) against NumPy and under the real compilers, TEAL and WINA through
it equal to their XLA path (masks before dense matmuls) in greedy tokens and log-probabilities,
the input-major copies they read, the platform choice and the bad inputs.

With a Pallas kernel their decode FFN is two calls: the kept inputs' rows of the layer's
input-major gate/up copy, then the kept channels' rows of its down copy, from a stack of every
layer's copies read at the layer index (traced in a scanned model).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import popjax
from popjax import kernels
from popjax.analysis.topologies import resolve_topology
from popjax.kernels import decode_ffn, ffn_gpu, matvec_tpu
from popjax.kernels.ffn_layout import InputRows, channel_lines, stacked_input_layout
from popjax.kernels.traffic import gather_matvec_bytes
from popjax.kernels.int8 import quantize
from popjax.methods import MethodError
from popjax.methods.input_rows import input_major_rows
from popjax.methods.larosa import folded_rows
from tests.accelerators.targets import hbm_traffic
from tests.accelerators.kernel_paths import check_method_kernel, placeholder_thresholds, ready
from tests.reference.corpus import tiny_corpus

# Compiles for a TPU or a GPU, or runs Pallas kernels in interpret mode: the full suite checks these, the
# quick loop between edits (-m "not slow") does not.
pytestmark = pytest.mark.slow


# ------------------------------------------------------------------ the kernel against NumPy
def _reference(x, w, active):
    """y = W · (x where active), in float64: x [B, k], W [n, k], active [B, k] or [k]."""
    return np.where(active, x, 0).astype(np.float64) @ w.astype(np.float64).T


@pytest.mark.parametrize("gpu", [False, True])
@pytest.mark.parametrize("int8", [False, True])
def test_masked_matvec_reads_one_layer_of_a_stack(gpu, int8):
    """A stack of 3 layers (n = 40 outputs: one line of 128, padded; k = 72 inputs, chunks of 64
    padded), per-row and shared masks, the layer traced under jit; int8 with per-output scales."""
    rng = np.random.default_rng(0)
    S, n, k, B = 3, 40, 72, 3
    w = rng.normal(size=(S, n, k)).astype(np.float32)
    if int8:
        q, scale = quantize(w)
        rows, w = stacked_input_layout(jnp.asarray(q), jnp.asarray(scale)), q.astype(np.float32) * scale
    else:
        rows = stacked_input_layout(jnp.asarray(w))
    assert rows.values.shape == (S, k, channel_lines(n), 128)
    x = rng.normal(size=(B, k)).astype(np.float32)
    per_row = rng.random((B, k)) < 0.4
    shared = rng.random(k) < 0.5
    matvec = ffn_gpu.masked_matvec if gpu else matvec_tpu.masked_matvec
    run = jax.jit(lambda x, active, layer: matvec(x, rows, active, out_features=n, layer=layer, interpret=True))
    for layer in range(S):
        for active in (per_row, shared):
            got = np.asarray(run(jnp.asarray(x), jnp.asarray(active), jnp.int32(layer)))
            np.testing.assert_allclose(got, _reference(x, w[layer], active), atol=2e-5, rtol=1e-5)
    nothing = run(jnp.asarray(x), jnp.zeros(k, bool), jnp.int32(1))
    np.testing.assert_array_equal(np.asarray(nothing), 0.0)


def test_a_batch_above_the_kernels_rows_runs_in_chunks():
    """70 rows (above `ffn_layout.MAX_BATCH` = 64): the dispatch runs chunks of 64, per-row masks."""
    rng = np.random.default_rng(4)
    n, k, B = 40, 24, 70
    w = rng.normal(size=(2, n, k)).astype(np.float32)
    x = rng.normal(size=(B, k)).astype(np.float32)
    active = rng.random((B, k)) < 0.5
    got = decode_ffn.masked_matvec(jnp.asarray(x), stacked_input_layout(jnp.asarray(w)), jnp.asarray(active), out_features=n,
                                   layer=jnp.int32(1), expected_active=12, kernel="pallas-interpret")
    np.testing.assert_allclose(np.asarray(got), _reference(x, w[1], active), atol=2e-5, rtol=1e-5)


def test_masked_matvec_one_matrix_in_bf16():
    """One matrix [k, L, 128] (no layer), bf16 weights and x: f32 accumulation, bf16 out."""
    rng = np.random.default_rng(1)
    n, k = 200, 96
    w = rng.normal(size=(n, k)).astype(np.float32)
    x = rng.normal(size=(2, k)).astype(np.float32)
    active = rng.random((2, k)) < 0.6
    rows = stacked_input_layout(jnp.asarray(w, jnp.bfloat16)[None])
    one = type(rows)(rows.values[0])
    got = matvec_tpu.masked_matvec(jnp.asarray(x, jnp.bfloat16), one, jnp.asarray(active), out_features=n, interpret=True)
    assert got.dtype == jnp.bfloat16 and got.shape == (2, n)
    want = _reference(np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32), np.asarray(jnp.asarray(w, jnp.bfloat16), np.float32), active)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=0.1, rtol=2e-2)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda rows, x: matvec_tpu.masked_matvec(x, rows, jnp.ones(8, bool), out_features=40, interpret=True),
         "are a stack of layers: pass layer="),
        (lambda rows, x: matvec_tpu.masked_matvec(x, rows, jnp.ones(7, bool), out_features=40, layer=0, interpret=True),
         "active of shape (7,) does not fit x (2, 8); expected [8] or [B, 8]"),
        (lambda rows, x: matvec_tpu.masked_matvec(x, rows, jnp.ones(8, bool), out_features=2000, layer=0, interpret=True),
         "do not hold 2000 outputs"),
    ],
)
def test_bad_masked_input_is_one_line(call, message):
    rows = stacked_input_layout(jnp.ones((2, 40, 8), jnp.float32))
    with pytest.raises(ValueError) as err:
        call(rows, jnp.ones((2, 8), jnp.float32))
    assert message in str(err.value) and "\n" not in str(err.value)


# ------------------------------------------------------------------ under the real compilers
S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_masked_matvec_compiles_at_the_8b_shapes_without_slicing_the_stack(chip):
    """Llama-3.1-8B's gate/up (W [2f, d] = [28672, 4096]) and down ([4096, 14336]) read from the
    32-layer stacks at a traced layer: Mosaic compiles them within the VMEM they state, XLA makes
    no copy of a layer (temporaries far below one layer's rows) and the call's cost is the
    kernel's own count at TEAL 40%'s kept inputs, not the stack's bytes."""
    sharding = jax.sharding.SingleDeviceSharding(resolve_topology(f"{chip}:1x1").devices[0])
    L, d, f = 32, 4096, 14336
    for k, n in ((d, 2 * f), (f, d)):
        kept = round(0.6 * k)
        rows = InputRows(S((L, k, channel_lines(n), 128), "bfloat16", sharding=sharding))
        est = matvec_tpu.matvec_vmem_bytes(1, 64, n, "bfloat16", "bfloat16")
        fn = lambda x, rows, active, layer: matvec_tpu.masked_matvec(  # noqa: E731
            x, rows, active, out_features=n, layer=layer, expected_active=kept, chip=chip, vmem_limit_bytes=est)  # noqa: B023
        args = (S((1, k), "bfloat16", sharding=sharding), rows, S((1, k), "bool", sharding=sharding), S((), "int32", sharding=sharding))
        compiled = jax.jit(fn).lower(*args).compile()
        assert compiled.memory_analysis().temp_size_in_bytes < k * n * 2 // 100
        own = gather_matvec_bytes(kept, k, 64, n, 1, "bfloat16", "bfloat16")
        assert own <= compiled.cost_analysis()["bytes accessed"] <= 1.05 * own


def test_masked_matvec_moves_the_bytes_of_the_kept_rows():
    """In the TPU simulator: one row DMA per input some row keeps (5 of 40), of layer 1 of 2."""
    rng = np.random.default_rng(3)
    batch, k, n, chunk = 2, 40, 300, 8
    x = jnp.asarray(rng.normal(size=(batch, k)), jnp.float32)
    values = jnp.asarray(rng.normal(size=(2, k, 8, 128)), jnp.float32)
    active = np.zeros((batch, k), bool)
    active[0, [3, 7, 20]] = active[1, [7, 1, 39]] = True  # union: 1 3 7 20 39
    with hbm_traffic() as tally:
        jax.block_until_ready(matvec_tpu.masked_matvec(x, InputRows(values), jnp.asarray(active), out_features=n, layer=1,
                                                       chunk=chunk, interpret=pltpu.InterpretParams()))
    counted = gather_matvec_bytes(5, k, chunk, n, batch, "float32", "float32")
    assert tally["read"] + tally["written"] == counted - 2 * k * 4 + batch * 1024 * 4


def test_gpu_masked_matvec_lowers_to_triton_for_cuda():
    rows = InputRows(S((4, 1000, 16, 128), "bfloat16"))
    fn = lambda x, rows, active, layer: ffn_gpu.masked_matvec(x, rows, active, out_features=2000, layer=layer)  # noqa: E731
    lowered = jax.jit(fn).trace(S((4, 1000), "bfloat16"), rows, S((4, 1000), "bool"), S((), "int32")).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("__gpu$xla.gpu.triton") == 1


# ------------------------------------------------------------------ TEAL through the kernel
# (method, family, layout, aggregate): both FFN activations, the batch's shared mask and per-row
# masks, and the scanned model, where the layer index the kernel reads at is traced
CASES = [("teal", "llama", "unrolled", "max"), ("teal", "gemma3", "unrolled", "per_token"), ("teal", "llama", "scanned", "per_token"),
         ("wina", "llama", "unrolled", "per_token"), ("principal-teal", "gemma3", "unrolled", "per_token"),
         ("larosa", "llama", "scanned", "per_token")]


@pytest.mark.parametrize("name, family, layout, aggregate", CASES)
def test_pallas_equals_xla(request, tiny_model, tmp_path_factory, name, family, layout, aggregate):
    """`kernel_paths.check_method_kernel`: the same greedy tokens and log-probs, batch 2."""
    model = tiny_model if family == "llama" else request.getfixturevalue("gemma3")
    check_method_kernel(model, ready(name, model, aggregate, tmp_path_factory.mktemp("calibration")), layout)


def test_the_input_major_copies(tiny_model):
    """``data["rows"]``: gate/up [L, d, L(2f), 128] and down [L, f, L(d), 128], the model's
    weights transposed (row i = input i's column), built once per model."""
    cfg = tiny_model.config
    L, d, f = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size
    teal = placeholder_thresholds(cfg, popjax.TEAL(ratio=0.4, kernel="pallas"))
    rows = teal.data(tiny_model)["rows"]
    assert rows["gate_up"].values.shape == (L, d, channel_lines(2 * f), 128)
    assert rows["down"].values.shape == (L, f, channel_lines(d), 128)
    stack = tiny_model.ffn_stack()
    np.testing.assert_array_equal(rows["gate_up"].values[1, :, :, :].reshape(d, -1)[:, : 2 * f],
                                  np.asarray(stack.gate_up[1]).reshape(2 * f, d).T)
    np.testing.assert_array_equal(rows["down"].values[0].reshape(f, -1)[:, :d], np.asarray(stack.down[0]).T)
    assert teal.data(tiny_model)["rows"] is rows  # model.derived: not rebuilt per call
    assert popjax.WINA(ratio=0.4, kernel="pallas").prepare(tiny_model).data(tiny_model)["rows"] is rows  # and shared
    assert "rows" not in dataclasses.replace(teal, kernel="xla").data(tiny_model)
    (gu, gu_scale), (down, down_scale) = quantize(np.asarray(stack.gate_up)), quantize(np.asarray(stack.down))
    int8 = input_major_rows(type(stack)(*map(jnp.asarray, (gu, down, gu_scale, down_scale))))
    assert int8["gate_up"].values.dtype == jnp.int8 and int8["gate_up"].scale.shape == (L, 1, channel_lines(2 * f) * 128)
    np.testing.assert_array_equal(int8["gate_up"].scale[1, 0, : 2 * f], gu_scale[1].reshape(-1))
    np.testing.assert_array_equal(int8["down"].scale[0, 0, :d], down_scale[0, :, 0])


def test_larosa_folds_its_rotations_into_a_copy(tiny_model):
    """LaRoSa's kernel reads W_gu Q input-major ([L, d, L(2f), 128]: row e multiplies rotated entry
    e), built once per model and rotations, beside TEAL's down copy (shared); int8 weights are
    folded from their dequantized values and re-quantized per output channel."""
    cfg = tiny_model.config
    L, d, f = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size
    larosa = popjax.LaRoSa(ratio=0.4, kernel="pallas").calibrate(tiny_model, tiny_corpus(), cache=False)
    rows = larosa.data(tiny_model)["rows"]
    stack, q = tiny_model.ffn_stack(), larosa.rotations.q
    want = np.einsum("nd,de->ne", np.asarray(stack.gate_up[1], np.float64).reshape(2 * f, d), q[1])  # layer 1's W_gu Q
    np.testing.assert_allclose(rows["gate_up"].values[1].reshape(d, -1)[:, : 2 * f], want.T, atol=1e-5)
    assert larosa.data(tiny_model)["rows"]["gate_up"] is rows["gate_up"]
    assert rows["down"] is placeholder_thresholds(cfg, popjax.TEAL(ratio=0.4, kernel="pallas")).data(tiny_model)["rows"]["down"]
    (gu, gu_scale), (down, down_scale) = quantize(np.asarray(stack.gate_up)), quantize(np.asarray(stack.down))
    int8 = folded_rows(type(stack)(*map(jnp.asarray, (gu, down, gu_scale, down_scale))), jnp.asarray(q))
    assert int8.values.dtype == jnp.int8 and int8.scale.shape == (L, 1, channel_lines(2 * f) * 128)
    dequantized = int8.values[1].reshape(d, -1)[:, : 2 * f].astype(np.float32) * int8.scale[1, 0, : 2 * f]
    folded = np.einsum("nd,de->ne", (gu[1] * gu_scale[1]).reshape(2 * f, d), q[1]).T
    assert np.max(np.abs(dequantized - folded)) <= 0.51 * np.max(np.abs(folded), axis=0).max() / 127


def test_kernel_choice(tiny_model):
    """"auto" is XLA on this CPU and the platform's kernel where programs compile for a TPU or a
    GPU (`kernels.compiling_for`); a mixture-of-experts model keeps XLA and refuses "pallas"."""
    cfg = tiny_model.config
    teal = placeholder_thresholds(cfg, popjax.TEAL(ratio=0.4))
    assert teal.kernel == "auto" and teal.bind(cfg).kernel == "xla"
    with kernels.compiling_for("tpu"):
        assert teal.bind(cfg).kernel == "pallas-tpu"
    with kernels.compiling_for("gpu"):
        assert teal.bind(cfg).kernel == "pallas-gpu"
    moe = dataclasses.replace(cfg, moe=object())
    assert teal.resolved_kernel(moe) == "xla"
    with pytest.raises(MethodError) as err:
        dataclasses.replace(teal, kernel="pallas").resolved_kernel(moe)
    assert "reads a stack of equal dense FFN weights" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(MethodError, match="kernel='triton' is not one of"):
        popjax.TEAL(ratio=0.4, kernel="triton")
    with pytest.raises(MethodError, match="kernel='triton' is not one of"):
        popjax.WINA(ratio=0.4, kernel="triton")
    with kernels.compiling_for("tpu"):
        assert popjax.WINA(ratio=0.4).prepare(tiny_model).bind(cfg).kernel == "pallas-tpu"
