"""The decode-FFN kernels (popjax.kernels.ffn_tpu / ffn_gpu) against a plain NumPy reference,
run in Pallas interpret mode on the CPU: odd sizes, padding, repeated and out-of-range ids,
int8, batch 1 and > 1 with per-row masks, both activations. The compilers' side (Mosaic for
v5e, Triton for CUDA), the bytes each kernel moves and the bad-input errors are in
tests/accelerators/test_kernels_compile.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from popjax.kernels import block_slab, decode_ffn, ffn_gpu, ffn_layout, ffn_tpu, matvec_tpu, selection
from popjax.kernels.int8 import quantize

# Compiles for a TPU or a GPU, or runs Pallas kernels in interpret mode: the full suite checks these, the
# quick loop between edits (-m "not slow") does not.
pytestmark = pytest.mark.slow

D, F = 200, 96  # d not a multiple of 128, f not a power of two


# ------------------------------------------------------------------------- the reference
def _act(g: np.ndarray, name: str) -> np.ndarray:
    if name == "silu":
        return g / (1.0 + np.exp(-g))
    return 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g**3)))


def selected(ids, count, n) -> list[int]:
    """The selection contract (popjax.kernels.selection's docstring), written as loops: ids[:count], an id
    out of [0, n) dropped, a repeat of the previous kept-range id counted once."""
    out, prev = [], None
    for i, v in enumerate(ids):
        if i >= count or not 0 <= v < n:
            prev = None
            continue
        if v != prev:
            out.append(int(v))
        prev = v
    return out


def reference(x, gate_up, down, channels_per_row, act) -> np.ndarray:
    """y [B, d] in float64: row r sums act(g_c · x_r) · (u_c · x_r) · down[:, c] over its channels."""
    x, gate_up, down = (np.asarray(a, np.float64) for a in (x, gate_up, down))
    y = np.zeros((x.shape[0], down.shape[0]))
    for r, channels in enumerate(channels_per_row):
        for c in channels:
            y[r] += _act(x[r] @ gate_up[0, c], act) * (x[r] @ gate_up[1, c]) * down[:, c]
    return y


def weights(dtype: str, seed: int = 0):
    """(kernel args gate_up, down, scales..., float64 weights the reference uses)."""
    rng = np.random.default_rng(seed)
    gate_up = rng.standard_normal((2, F, D)).astype(np.float32) / 8
    down = rng.standard_normal((D, F)).astype(np.float32) / 8
    if dtype == "int8":
        (qg, sg), (qd, sd) = quantize(gate_up), quantize(down)
        args = (jnp.asarray(qg), jnp.asarray(qd), jnp.asarray(sg), jnp.asarray(sd))
        return args, qg * sg.astype(np.float64), qd * sd.astype(np.float64)
    gate_up, down = jnp.asarray(gate_up, dtype), jnp.asarray(down, dtype)
    return (gate_up, down), np.asarray(gate_up, np.float64), np.asarray(down, np.float64)


def inputs(batch: int, x_dtype: str, seed: int = 1):
    x = jnp.asarray(np.random.default_rng(seed).standard_normal((batch, D)), x_dtype)
    return x, np.asarray(x, np.float64)


def check(y, want, x_dtype: str) -> None:
    """Within float32 rounding, or bf16's (x, weights and h rounded to 8 bits) of max |y|."""
    tol = 1e-5 if x_dtype == "float32" else 2e-2
    assert y.shape == want.shape
    err = np.max(np.abs(np.asarray(y, np.float64) - want))
    assert err <= tol * np.max(np.abs(want)), f"max error {err} vs max |y| {np.max(np.abs(want))}"


KERNELS = {"tpu": ffn_tpu, "gpu": ffn_gpu}


# ------------------------------------------------------------------------- block-granular
BLOCK_CASES = [
    # (platform, weights, x, act, batch, block size, masked): both platforms share the selection
    # code, so the GPU runs the cases that differ in its own code (dtypes, masks)
    ("tpu", "float32", "float32", "silu", 1, 12, False),
    ("tpu", "bfloat16", "bfloat16", "gelu_pytorch_tanh", 5, 24, True),
    ("gpu", "bfloat16", "bfloat16", "gelu_pytorch_tanh", 5, 24, True),
    ("tpu", "int8", "float32", "silu", 3, 8, True),
    ("gpu", "int8", "float32", "silu", 3, 8, True),
]


@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[3]}-B{c[4]}-b{c[5]}")
def test_block_ffn_matches_numpy(case):
    platform, w_dtype, x_dtype, act, batch, b, masked = case
    args, gate_up, down = weights(w_dtype)
    slab = block_slab.block_layout(args[0], args[1], b, *args[2:])
    nb = F // b
    # a repeat, an id out of range, then padding that repeats the last one and garbage
    ids = np.array([3, 0, 0, nb + 2, nb - 1, 5, -4, 5], np.int32)[: nb + 1]
    count = len(ids) - 2
    x, x64 = inputs(batch, x_dtype)
    rng = np.random.default_rng(2)
    row_mask = rng.random((batch, nb)) < 0.6 if masked else None
    blocks = selected(ids, count, nb)
    rows = [[j for j in blocks if row_mask is None or row_mask[r, j]] for r in range(batch)]
    channels = [[j * b + c for j in row for c in range(b)] for row in rows]
    y = KERNELS[platform].block_ffn(
        x, slab, jnp.asarray(ids), None if row_mask is None else jnp.asarray(row_mask), count=count, act=act, interpret=True
    )
    assert y.dtype == x.dtype
    check(y, reference(x64, gate_up, down, channels, act), x_dtype)


def test_union_of_rows_gives_each_rows_own_blocks():
    """BWAP's batch: rows choose different blocks; the kernel reads their union once, and each
    row gets exactly its own FFN."""
    args, gate_up, down = weights("float32", seed=3)
    b, nb, batch = 8, F // 8, 4
    chose = np.zeros((batch, nb), bool)
    for r, picks in enumerate([[0, 5], [5, 7], [1], [2, 3, 11]]):
        chose[r, picks] = True
    ids, count = selection.union_of_rows(jnp.asarray(chose), size=8)
    assert int(count) == 7 and list(np.asarray(ids)[:7]) == [0, 1, 2, 3, 5, 7, 11]
    x, x64 = inputs(batch, "float32")
    y = ffn_tpu.block_ffn(
        x, block_slab.block_layout(*args, b), ids, jnp.asarray(chose), count=count, act="silu", interpret=True
    )
    channels = [[j * b + c for j in np.flatnonzero(chose[r]) for c in range(b)] for r in range(batch)]
    check(y, reference(x64, gate_up, down, channels, "silu"), "float32")


# ------------------------------------------------------------------------- channel-granular
GATHER_CASES = [
    # (platform, weights, x, act, batch, per-row ids)
    ("tpu", "float32", "float32", "gelu_pytorch_tanh", 2, False),
    ("gpu", "float32", "float32", "gelu_pytorch_tanh", 2, False),
    ("tpu", "int8", "bfloat16", "silu", 3, True),
    ("gpu", "int8", "bfloat16", "silu", 3, True),
    ("tpu", "bfloat16", "bfloat16", "silu", 1, False),
]


@pytest.mark.parametrize("case", GATHER_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[3]}-B{c[4]}-{'rows' if c[5] else 'shared'}")
def test_gather_ffn_matches_numpy(case):
    platform, w_dtype, x_dtype, act, batch, per_row = case
    args, gate_up, down = weights(w_dtype)
    rows = ffn_layout.channel_layout(*args)
    x, x64 = inputs(batch, x_dtype)
    if per_row:  # each row its own channels (some shared), with its own count and a repeat
        ids = np.array([[4, 9, 9, 50, 95, 1], [9, 2, 60, 77, 0, 0], [95, 4, 33, -1, 7, 8]], np.int32)[:batch]
        counts = np.array([5, 4, 6])[:batch]
        channels = [selected(ids[r], counts[r], F) for r in range(batch)]
        y = KERNELS[platform].gather_ffn(x, rows, jnp.asarray(ids), count=jnp.asarray(counts), act=act, interpret=True)
    else:  # 37 ids: not a multiple of the chunk; a repeat, an id past f, padding
        ids = np.random.default_rng(4).permutation(F)[:40].astype(np.int32)
        ids[6], ids[20] = ids[5], F + 3
        channels = [selected(ids, 37, F)] * batch
        kwargs = {"chunk": 8} if platform == "tpu" else {}
        y = KERNELS[platform].gather_ffn(x, rows, jnp.asarray(ids), count=37, act=act, interpret=True, **kwargs)
    check(y, reference(x64, gate_up, down, channels, act), x_dtype)



# (platform, weights, batch, stacked): the gate values given (CATS), from a channel layout's three
# rows (its gate row never read) or from a stack of layers' up/down rows read at a traced layer
GATED_CASES = [("tpu", "float32", 2, True), ("gpu", "float32", 2, True), ("tpu", "int8", 3, False), ("gpu", "int8", 3, True),
               ("tpu", "bfloat16", 1, False)]


@pytest.mark.parametrize("case", GATED_CASES, ids=lambda c: f"{c[0]}-{c[1]}-B{c[2]}-{'stack' if c[3] else 'rows'}")
def test_gather_ffn_given_the_gate_values(case):
    """y[r] = Σ_p gate[r, p] · (up_c · x_r) · down[:, c] over the selected positions p (channel
    c = ids[p]: count 7 of 8, a repeat, an id past f, an id −1); the gate values by position are
    used as given, a row's zeros leaving out the channels it does not keep."""
    platform, w_dtype, batch, stacked = case
    layers = [weights(w_dtype, seed=seed) for seed in range(3)]
    layer = 1
    args, gate_up, down = layers[layer]
    if stacked:
        stack = [np.stack([np.asarray(a[k]) for a, _, _ in layers]) for k in range(len(args))]
        up_scale = stack[2][:, 1] if w_dtype == "int8" else None
        down_scale = stack[3] if w_dtype == "int8" else None
        rows = ffn_layout.stacked_up_down_layout(*(None if a is None else jnp.asarray(a)
                                                   for a in (stack[0][:, 1], stack[1], up_scale, down_scale)))
    else:
        rows = ffn_layout.channel_layout(*args)
    x, x64 = inputs(batch, "bfloat16" if w_dtype == "bfloat16" else "float32")
    ids = np.array([4, 9, 9, 50, -1, 95, F + 2, 1], np.int32)
    gate = np.random.default_rng(5).standard_normal((batch, ids.size)).astype(np.float32)
    gate[0, 3] = gate[-1, 0] = 0.0  # channels those rows do not keep
    positions = [p for p in range(7) if 0 <= ids[p] < F and not (p and ids[p] == ids[p - 1])]

    def call(at):
        return KERNELS[platform].gather_ffn(x, rows, jnp.asarray(ids), count=7, gate=jnp.asarray(gate),
                                            layer=at if stacked else None, interpret=True)

    y = jax.jit(call)(jnp.asarray(layer, jnp.int32))
    want = np.zeros((batch, D))
    for r in range(batch):
        for p in positions:
            c = ids[p]
            want[r] += gate[r, p] * (x64[r] @ gate_up[1, c]) * down[:, c]
    check(y, want, "bfloat16" if w_dtype == "bfloat16" else "float32")


def test_tpu_gather_dma_semantics_in_the_tpu_simulator():
    """TPU interpret mode simulates VMEM, DMAs and semaphores, and fills memory nobody wrote
    with NaN: the double-buffered copies must be waited on before use and a skipped position's
    scratch rows must be zeroed (0 · NaN is NaN)."""
    args, gate_up, down = weights("float32", seed=5)
    rows = ffn_layout.channel_layout(*args)
    x, x64 = inputs(2, "float32")
    ids = np.array([7, 3, 3, 90, 12, 40, 41, 42, 43, 44, 0, 0], np.int32)
    params = pltpu.InterpretParams(uninitialized_memory="nan", dma_execution_mode="on_wait")
    y = ffn_tpu.gather_ffn(x, rows, jnp.asarray(ids), count=10, chunk=4, act="silu", interpret=params)
    check(y, reference(x64, gate_up, down, [selected(ids, 10, F)] * 2, "silu"), "float32")


# ------------------------------------------------------------------------- input-channel gathers
MATVECS = {"tpu": matvec_tpu.gather_matvec, "gpu": ffn_gpu.gather_matvec}


def _active(v: np.ndarray, t: float) -> tuple[np.ndarray, np.ndarray]:
    """Per-row ids of |v| > t, padded with -1 to the longest row, and their counts."""
    on = [np.flatnonzero(np.abs(row) > t) for row in v]
    ids = np.full((v.shape[0], max(map(len, on))), -1, np.int32)
    for r, row in enumerate(on):
        ids[r, : len(row)] = row
    return ids, np.array([len(row) for row in on], np.int32)


@pytest.mark.parametrize("platform, w_dtype", [("tpu", "float32"), ("gpu", "int8")])
def test_teal_decode_ffn_from_two_input_gathers(platform, w_dtype):
    """TEAL's step (x's inputs under t_x zeroed, then H's channels under t_h) as two
    `gather_matvec` calls on input-major weights, per row of a batch of 3, against NumPy."""
    args, gate_up, down = weights(w_dtype, seed=6)
    x, x64 = inputs(3, "float32", seed=7)
    t_x, t_h = 0.6, 0.35  # about half of x and of H kept
    gate_up_scale = args[2].reshape(2 * F, 1) if w_dtype == "int8" else None
    gu_rows = ffn_layout.input_layout(args[0].reshape(2 * F, D), gate_up_scale)
    down_rows = ffn_layout.input_layout(args[1], args[3] if w_dtype == "int8" else None)
    matvec = MATVECS[platform]
    ids, counts = _active(x64, t_x)
    gu = matvec(x, gu_rows, jnp.asarray(ids), count=jnp.asarray(counts), out_features=2 * F, interpret=True)
    h = np.asarray(ffn_layout.activation("silu")(gu[:, :F]) * gu[:, F:])
    ids, counts = _active(h, t_h)
    y = matvec(jnp.asarray(h), down_rows, jnp.asarray(ids), count=jnp.asarray(counts), out_features=D, interpret=True)

    xs = np.where(np.abs(x64) > t_x, x64, 0.0)
    g, u = xs @ gate_up[0].T, xs @ gate_up[1].T
    h64 = _act(g, "silu") * u
    want = np.where(np.abs(h64) > t_h, h64, 0.0) @ down.T
    assert 0 < counts.min() and counts.max() < 0.75 * F  # the thresholds do drop channels
    check(y, want, "float32")


def test_count_zero_gives_zeros():
    args, _, _ = weights("float32")
    x, _ = inputs(2, "float32")
    slab = block_slab.block_layout(*args, 24)
    y = ffn_tpu.block_ffn(x, slab, jnp.asarray([1, 2], jnp.int32), count=0, interpret=True)
    assert np.all(np.asarray(y) == 0)


def test_layouts_hold_the_ffn_weights():
    """Block j of the slab is channels j·b..j·b+b-1 (gate rows, up rows, down columns); a
    channel's row in `ChannelRows` is its weights, zero past d."""
    (gate_up, down), _, _ = weights("float32")
    slab = np.asarray(block_slab.block_layout(gate_up, down, 12).values)
    np.testing.assert_array_equal(slab[3, 0], np.asarray(gate_up)[0, 36:48])
    np.testing.assert_array_equal(slab[3, 1], np.asarray(gate_up)[1, 36:48])
    np.testing.assert_array_equal(slab[3, 2], np.asarray(down)[:, 36:48].T)
    rows = np.asarray(ffn_layout.channel_layout(gate_up, down).values)
    assert rows.shape == (3, F, ffn_layout.channel_lines(D), 128) and ffn_layout.channel_lines(D) == 8
    flat = rows.reshape(3, F, -1)
    np.testing.assert_array_equal(flat[2, 17, :D], np.asarray(down)[:, 17])
    assert np.all(flat[:, :, D:] == 0)


# ------------------------------------------------------------------------- block-granular input gathers
def laid_out(w: np.ndarray, w_dtype: str, layout):
    """W [n, k] in ``w_dtype`` (int8: `quantize`'s values and scales) through ``layout``
    (`ffn_layout.input_layout` or `output_layout`) -> (the kernel's rows, W as the kernel sees
    it in float64)."""
    if w_dtype == "int8":
        q, s = quantize(w)
        return layout(jnp.asarray(q), jnp.asarray(s)), q * s.astype(np.float64)
    return layout(jnp.asarray(w, w_dtype)), np.asarray(jnp.asarray(w, w_dtype), np.float64)


BLOCK_MATVECS = {  # the TPU kernel; on a GPU, decode_ffn's single-row ids for the Triton matvec
    "tpu": lambda x, rows, ids, b, n: matvec_tpu.block_matvec(x, rows, ids, block=b, out_features=n, interpret=True),
    "gpu": lambda x, rows, ids, b, n: ffn_gpu.gather_matvec(x, rows, decode_ffn.block_positions(ids, b, rows.values.shape[0]),
                                                            out_features=n, interpret=True),
}


@pytest.mark.parametrize("platform, w_dtype, x_dtype, batch", [("tpu", "float32", "float32", 1), ("tpu", "int8", "float32", 3),
                                                               ("tpu", "bfloat16", "bfloat16", 2), ("gpu", "int8", "float32", 3)])
def test_block_matvec_matches_numpy(platform, w_dtype, x_dtype, batch):
    """Block POP's down read (`matvec_tpu.block_matvec`; on a GPU `decode_ffn.block_positions`
    into `ffn_gpu.gather_matvec`) against loops over the blocks: k = 96 inputs in blocks of 8,
    n = 200 outputs (padded to 256), ids with a repeat (counted once), one past the last block
    and one below 0 (both add nothing), then the repeated block again after another (counted
    again)."""
    rng = np.random.default_rng(11)
    k, n, b = F, D, 8
    w = rng.standard_normal((n, k)).astype(np.float32) / 8  # W [n, k]: down's shape, [d, f]
    rows, w64 = laid_out(w, w_dtype, ffn_layout.input_layout)
    x, x64 = inputs(batch, x_dtype, seed=12)
    x, x64 = x[:, :k], x64[:, :k]
    ids = [5, 2, 2, 12, -1, 7, 5]
    y = BLOCK_MATVECS[platform](x, rows, jnp.asarray(ids, jnp.int32), b, n)
    want, prev = np.zeros((batch, n)), None
    for j in ids:
        if 0 <= j < k // b and j != prev:
            want += x64[:, j * b : (j + 1) * b] @ w64[:, j * b : (j + 1) * b].T
        prev = j
    check(y, want, x_dtype)


@pytest.mark.parametrize("platform, w_dtype, x_dtype, batch", [("tpu", "float32", "float32", 1), ("tpu", "int8", "bfloat16", 3),
                                                               ("gpu", "int8", "float32", 2)])
def test_row_dots_match_numpy(platform, w_dtype, x_dtype, batch):
    """`gather_row_dots` (shortlisted POP's up rows: single outputs u_j = W[j] · x) against loops:
    W [96, 200] (rows padded to 256 lanes), 37 ids (not a multiple of the TPU chunk of 16) with a
    repeat (its second position 0), one past the end and one below 0 (0), count 35 (the last two: 0)."""
    rng = np.random.default_rng(13)
    rows, w64 = laid_out(rng.standard_normal((F, D)).astype(np.float32) / 8, w_dtype, ffn_layout.output_layout)
    x, x64 = inputs(batch, x_dtype, seed=14)
    ids = [int(i) for i in rng.integers(0, F, 37)]
    ids[4], ids[9], ids[20] = ids[3], F, -1
    count = 35
    if platform == "tpu":
        u = matvec_tpu.gather_row_dots(x, rows, jnp.asarray(ids, jnp.int32), count=count, chunk=16, interpret=True)
    else:
        u = ffn_gpu.gather_row_dots(x, rows, jnp.asarray(ids, jnp.int32), count=count, interpret=True)
    want = np.zeros((batch, len(ids)))
    for p, j in enumerate(ids):
        repeat = p > 0 and j == ids[p - 1] and 0 <= j < F
        if p < count and 0 <= j < F and not repeat:
            want[:, p] = x64 @ w64[j]
    check(u, want, x_dtype)


@pytest.mark.parametrize("platform, w_dtype", [("tpu", "int8"), ("gpu", "float32")])
def test_values_matvec_matches_numpy(platform, w_dtype):
    """`values_matvec` (the down read of gate-scored and shortlisted POP: values computed for the
    chosen rows only) against loops: W [200, 96] input-major, 7 positions with a repeat (its
    second position adds nothing) and an id past the end (nothing)."""
    rng = np.random.default_rng(15)
    rows, w64 = laid_out(rng.standard_normal((D, F)).astype(np.float32) / 8, w_dtype, ffn_layout.input_layout)
    ids = [4, 90, 90, 17, F, 0, 33]
    values = rng.standard_normal((3, len(ids))).astype(np.float32)
    fn = matvec_tpu.values_matvec if platform == "tpu" else ffn_gpu.values_matvec
    y = fn(jnp.asarray(values), rows, jnp.asarray(ids, jnp.int32), out_features=D, interpret=True)
    want = sum(values[:, [p]] * w64[:, j][None, :] for p, j in enumerate(ids) if j < F and not (p and ids[p - 1] == j))
    check(y, want, "float32")
