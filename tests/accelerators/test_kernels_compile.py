"""The decode-FFN kernels under the real compilers and their own accounting: Mosaic compiles
the TPU kernels for v5e (libtpu, compile-only) without a copy of the weights, within the VMEM
they state and with their own bytes as the cost; the GPU kernels lower to Triton for CUDA; the
bytes the TPU simulator sees them move are the bytes `ffn_layout` counts; bad input is one
clear error line. Correctness is tests/accelerators/test_kernels_ffn.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from popjax.analysis.topologies import resolve_topology
from popjax.kernels import block_slab, decode_ffn, ffn_gpu, ffn_layout, ffn_tpu, matvec_tpu, traffic
from tests.accelerators.targets import hbm_traffic

# Compiles for a TPU or a GPU, or runs Pallas kernels in interpret mode: the full suite checks these, the
# quick loop between edits (-m "not slow") does not.
pytestmark = pytest.mark.slow

S = jax.ShapeDtypeStruct


def block_args(batch, d, f, b, n, w_dtype, x_dtype="bfloat16", masked=False):
    int8 = w_dtype == "int8"
    nb = f // b
    slab = block_slab.BlockSlab(S((nb, 3, b, d), w_dtype), S((nb, 2, b), "float32") if int8 else None, S((1, d), "float32") if int8 else None)
    return [S((batch, d), x_dtype), slab, S((n,), "int32")] + ([S((batch, nb), "bool")] if masked else [])


def gather_args(batch, d, f, n, w_dtype, x_dtype="bfloat16", per_row=False):
    int8, width = w_dtype == "int8", ffn_layout.channel_lines(d) * 128
    rows = ffn_layout.ChannelRows(
        S((3, f, width // 128, 128), w_dtype), S((2, f), "float32") if int8 else None, S((1, width), "float32") if int8 else None
    )
    return [S((batch, d), x_dtype), rows, S((batch, n) if per_row else (n,), "int32")]


@pytest.fixture(scope="module")
def v5e():
    pytest.importorskip("libtpu", reason="compile-only TPU checks need libtpu (the test extra)")
    return jax.sharding.SingleDeviceSharding(resolve_topology("v5e:1x1").devices[0])


def compile_on(sharding, fn, args):
    placed = jax.tree.map(lambda s: S(s.shape, s.dtype, sharding=sharding), args)
    return jax.jit(fn).lower(*placed).compile()


# ------------------------------------------------------------------------- Mosaic for v5e
def test_block_kernel_compiles_for_v5e_within_its_stated_vmem(v5e):
    """bf16 slab, batch 8 with per-row masks: compiles with the VMEM limit set to exactly the
    kernel's own estimate; its cost is its own traffic; no copy of the weights is made."""
    batch, d, f, b, n = 8, 1024, 2048, 128, 9
    est = ffn_tpu.block_vmem_bytes(batch, b, d, "bfloat16", "bfloat16", masked=True)
    compiled = compile_on(v5e, lambda *a: ffn_tpu.block_ffn(*a, vmem_limit_bytes=est), block_args(batch, d, f, b, n, "bfloat16", masked=True))
    own = traffic.block_ffn_bytes(n, n, b, d, batch, "bfloat16", "bfloat16", masked=True)
    # the call's own traffic (+ XLA's id and mask preparation), not the whole 16-block slab
    assert own <= compiled.cost_analysis()["bytes accessed"] <= 1.05 * own < 0.6 * (f * 3 * d * 2)
    assert compiled.memory_analysis().temp_size_in_bytes < 3 * b * d * 2  # no slab copy


def test_gather_kernel_compiles_for_v5e_without_a_relayout(v5e):
    """int8 rows, per-row ids, d = 1000 (padded to 8 lines of 128): compiles at its own VMEM
    estimate, and XLA keeps the [3, f, L, 128] operand as it is (a [f, 1, d] or L = 7 layout
    makes it copy the whole matrix first: docs/kernels.md)."""
    batch, d, f, m = 4, 1000, 2048, 100
    est = ffn_tpu.gather_vmem_bytes(batch, 64, d, "int8", "bfloat16")
    compiled = compile_on(v5e, lambda *a: ffn_tpu.gather_ffn(*a, vmem_limit_bytes=est), gather_args(batch, d, f, m, "int8", per_row=True))
    weights = 3 * f * 1024
    assert compiled.memory_analysis().temp_size_in_bytes < weights // 20


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_gated_gather_compiles_at_the_8b_stack(chip):
    """CATS's kernel at Llama-3.1-8B's shapes: the gate values given, 32 layers' up/down rows
    [2, 32, 14336, 32, 128] bf16 (a 7.5 GB stack) read at a traced layer, batch 8 with the batch's
    union of 40% of the channels: Mosaic compiles it within the chip's VMEM, XLA copies no layer
    out of the stack, and the call's cost is its own count at the expected rows."""
    topology = resolve_topology(f"{chip}:1x1")
    sharding = jax.sharding.SingleDeviceSharding(topology.devices[0])
    batch, d, f, layers = 8, 4096, 14336, 32
    lines = ffn_layout.channel_lines(d)
    rows = ffn_layout.ChannelRows(S((2, layers, f, lines, 128), "bfloat16"))
    kept = round(0.4 * f)

    def call(x, rows, ids, count, gate, layer):
        return ffn_tpu.gather_ffn(x, rows, ids, count=count, gate=gate, layer=layer, expected_rows=kept, chip=chip)

    args = [S((batch, d), "bfloat16"), rows, S((f,), "int32"), S((), "int32"), S((batch, f), "float32"), S((), "int32")]
    compiled = compile_on(sharding, call, args)
    stack_bytes = 2 * layers * f * lines * 128 * 2
    assert compiled.memory_analysis().temp_size_in_bytes < stack_bytes // (layers * 20)  # not a layer's copy
    own = traffic.gather_ffn_bytes(kept, f, 64, d, batch, "bfloat16", "bfloat16", matrices=2)
    # + XLA's preparation of the gate values [B, f] into the kernel's [steps, B, 64] blocks (each
    # padded to 128 lanes) and of the ids: 4.8 MB here, 5.1% of the call's 94.7 MB
    assert own <= compiled.cost_analysis()["bytes accessed"] <= 1.06 * own
    assert ffn_tpu.gather_vmem_bytes(batch, 64, d, "bfloat16", "bfloat16", matrices=2) < ffn_tpu.chip_vmem_bytes(chip)

def test_input_gather_compiles_for_v5e(v5e):
    """TEAL's gate/up matvec (x's active inputs of W [2f, d]), int8, batch 8 per-row ids."""
    batch, d, n, m = 8, 1024, 2 * 1536, 300
    est = matvec_tpu.matvec_vmem_bytes(batch, 64, n, "int8", "bfloat16")
    rows = ffn_layout.InputRows(S((d, ffn_layout.channel_lines(n), 128), "int8"), S((1, ffn_layout.channel_lines(n) * 128), "float32"))
    fn = lambda x, r, i: matvec_tpu.gather_matvec(x, r, i, out_features=n, vmem_limit_bytes=est)  # noqa: E731
    compiled = compile_on(v5e, fn, [S((batch, d), "bfloat16"), rows, S((batch, m), "int32")])
    assert compiled.memory_analysis().temp_size_in_bytes < d * n // 10  # ids and x values, no copy of W


def test_mosaic_refuses_a_limit_below_the_estimate(v5e):
    """The limit matters to the real compiler (interpret mode never checks VMEM): half the
    estimate does not compile."""
    batch, d, f, b = 8, 2048, 2048, 256
    est = ffn_tpu.block_vmem_bytes(batch, b, d, "bfloat16", "bfloat16", masked=False)
    with pytest.raises(Exception, match="(?i)vmem"):
        compile_on(v5e, lambda *a: ffn_tpu.block_ffn(*a, vmem_limit_bytes=est // 2), block_args(batch, d, f, b, 4, "bfloat16"))


# ------------------------------------------------------------------------- Triton for CUDA
@pytest.mark.parametrize("kind", ["block-int8-masked", "gather-bf16-rows", "gated-int8-stack", "matvec-bf16", "row-dots-int8"])
def test_gpu_kernels_lower_to_triton_for_cuda(kind):
    if kind.startswith(("matvec", "row-dots")):  # one Triton kernel each
        if kind.startswith("matvec"):
            rows = ffn_layout.InputRows(S((1000, 16, 128), "bfloat16"))
            fn = lambda x, r, i: ffn_gpu.gather_matvec(x, r, i, out_features=2000)  # noqa: E731
        else:  # shortlisted POP's up rows: int8 W [1000, 2000] with its per-row scales
            rows = ffn_layout.OutputRows(S((1000, 16, 128), "int8"), S((1000,), "float32"))
            fn = lambda x, r, i: ffn_gpu.gather_row_dots(x, r, i)  # noqa: E731
        x = S((4, 1000 if kind.startswith("matvec") else 2000), "bfloat16")
        text = jax.jit(fn).trace(x, rows, S((300,), "int32")).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 1
        return
    if kind.startswith("block"):
        fn = lambda x, s, i, m: ffn_gpu.block_ffn(x, s, i, m, act="gelu_pytorch_tanh")  # noqa: E731
        args = block_args(5, 1000, 1024, 128, 6, "int8", masked=True)
    elif kind.startswith("gated"):  # CATS's: the gate values given, a stack of 4 layers' int8 up/down rows at a traced layer
        fn = lambda x, r, i, g, layer: ffn_gpu.gather_ffn(x, r, i, gate=g, layer=layer)  # noqa: E731
        rows = ffn_layout.ChannelRows(S((2, 4, 1024, 8, 128), "int8"), S((1, 4, 1024), "float32"), S((4, 1, 1024), "float32"))
        args = [S((8, 1000), "bfloat16"), rows, S((1024,), "int32"), S((8, 1024), "float32"), S((), "int32")]
    else:
        fn = lambda x, r, i: ffn_gpu.gather_ffn(x, r, i)  # noqa: E731
        args = gather_args(8, 1000, 1024, 40, "bfloat16", per_row=True)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2  # gate/up, then down


# ------------------------------------------------------------------------- bytes, in the TPU simulator
def _simulated(rng, *shapes_dtypes):
    return [jnp.asarray(rng.standard_normal(s) * 0.1, dt) if dt != "int8" else jnp.asarray(rng.integers(-127, 128, s), dt) for s, dt in shapes_dtypes]


def test_block_kernel_moves_the_bytes_it_counts():
    """int8 slab, batch 3 with masks, ids [3, 3, 0, 2, 2] (+ padding): 3 slab fetches, not 5."""
    rng = np.random.default_rng(0)
    batch, d, nb, b = 3, 256, 4, 16
    x, values = _simulated(rng, ((batch, d), "float32"), ((nb, 3, b, d), "int8"))
    slab = block_slab.BlockSlab(values, jnp.ones((nb, 2, b)), jnp.ones((1, d)))
    ids = jnp.asarray([3, 3, 0, 2, 2, 1], jnp.int32)
    with hbm_traffic() as tally:
        jax.block_until_ready(ffn_tpu.block_ffn(x, slab, ids, jnp.ones((batch, nb), bool), count=5, interpret=pltpu.InterpretParams()))
    n = 6
    fetches = traffic.count_distinct_fetches(np.asarray([3, 3, 0, 2, 2, 2]))
    counted = traffic.block_ffn_bytes(fetches, n, b, d, batch, "int8", "float32", masked=True)
    # the simulator keeps the scalar-prefetched ids in SMEM and reads the output block in once
    assert fetches == 3 and tally["read"] + tally["written"] == counted - 2 * n * 4 + batch * d * 4


def test_gather_kernel_moves_the_bytes_it_counts():
    """Channel DMAs: one per kept position and matrix; repeats, padding and the tail of the
    last chunk move nothing."""
    rng = np.random.default_rng(1)
    batch, f, chunk = 2, 64, 4
    (x, values), width = _simulated(rng, ((batch, 1024), "bfloat16"), ((3, f, 8, 128), "bfloat16")), 1024
    ids = jnp.asarray([5, 9, 9, 30, 2, 63, 7, 0, 0], jnp.int32)  # 6 kept of count 7; 9 positions
    with hbm_traffic() as tally:
        jax.block_until_ready(ffn_tpu.gather_ffn(x, ffn_layout.ChannelRows(values), ids, count=7, chunk=chunk, interpret=pltpu.InterpretParams()))
    counted = traffic.gather_ffn_bytes(6, 9, chunk, 1024, batch, "bfloat16", "bfloat16")
    assert tally["read"] + tally["written"] == counted - 2 * 12 * 4 + batch * width * 2


def test_gated_gather_moves_the_bytes_it_counts():
    """The gate values given: two DMAs per kept position (up, down), none for the gate, from a
    stack of 3 layers read at layer 2 (the ids offset into the stack)."""
    rng = np.random.default_rng(3)
    batch, f, chunk = 2, 64, 4
    (x, values, gate), width = _simulated(rng, ((batch, 1024), "bfloat16"), ((2, 3, f, 8, 128), "bfloat16"), ((batch, 9), "float32")), 1024
    ids = jnp.asarray([5, 9, 9, 30, 2, 63, 7, 0, 0], jnp.int32)  # 6 kept of count 7; 9 positions
    with hbm_traffic() as tally:
        y = ffn_tpu.gather_ffn(x, ffn_layout.ChannelRows(values), ids, count=7, gate=gate, layer=2, chunk=chunk,
                               interpret=pltpu.InterpretParams())
        jax.block_until_ready(y)
    counted = traffic.gather_ffn_bytes(6, 9, chunk, 1024, batch, "bfloat16", "bfloat16", matrices=2)
    assert tally["read"] + tally["written"] == counted - 2 * 12 * 4 + batch * width * 2

def test_input_gather_moves_the_bytes_it_counts():
    rng = np.random.default_rng(2)
    batch, k, n, chunk = 2, 40, 300, 8  # W [300, 40]: rows of 1024 (8 lines)
    x, values = _simulated(rng, ((batch, k), "float32"), ((k, 8, 128), "float32"))
    ids = jnp.asarray([[3, 7, 7, 20, 39, 0], [7, 1, 2, 0, 0, 0]], jnp.int32)  # union of the counted: 1 2 3 7 20 39
    with hbm_traffic() as tally:
        y = matvec_tpu.gather_matvec(x, ffn_layout.InputRows(values), ids, count=jnp.asarray([5, 3]), out_features=n, chunk=chunk, interpret=pltpu.InterpretParams())
        jax.block_until_ready(y)
    positions = min(k, batch * 6)  # the union's static size
    counted = traffic.gather_matvec_bytes(6, positions, chunk, n, batch, "float32", "float32")
    assert tally["read"] + tally["written"] == counted - 2 * 16 * 4 + batch * 1024 * 4


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_block_matvec_compiles_at_the_8b_shapes(chip):
    """Block POP's down read on Llama-3.1-8B (POP 40%, γ = 0.1, b = 128: n_C = 1536 candidate
    rows of d = 4096, 6 blocks per step), bf16 and int8: Mosaic compiles it at exactly its own
    VMEM estimate, within the chip's VMEM, with its own traffic as the cost and no copy of the rows."""
    pytest.importorskip("libtpu", reason="compile-only TPU checks need libtpu (the test extra)")
    sharding = jax.sharding.SingleDeviceSharding(resolve_topology(f"{chip}:1x1").devices[0])
    d, n_c, b, nb = 4096, 1536, 128, 6
    for w_dtype in ("bfloat16", "int8"):
        est = matvec_tpu.block_matvec_vmem_bytes(1, b, d, w_dtype, "bfloat16")
        assert est <= ffn_tpu.chip_vmem_bytes(chip)
        scale = S((1, d), "float32") if w_dtype == "int8" else None
        rows = ffn_layout.InputRows(S((n_c, d // 128, 128), w_dtype), scale)
        fn = lambda x, r, i: matvec_tpu.block_matvec(x, r, i, block=b, out_features=d, chip=chip, vmem_limit_bytes=est)  # noqa: E731,B023
        compiled = compile_on(sharding, fn, [S((1, n_c), "bfloat16"), rows, S((nb,), "int32")])
        own = traffic.block_matvec_bytes(nb, nb, b, d, 1, w_dtype, "bfloat16")
        assert own <= compiled.cost_analysis()["bytes accessed"] <= 1.05 * own < 0.6 * n_c * d * jnp.dtype(w_dtype).itemsize
        assert compiled.memory_analysis().temp_size_in_bytes < b * d  # ids and x's values, no copy of the rows


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_row_dots_compile_at_the_8b_shapes(chip):
    """Shortlisted POP's up read on Llama-3.1-8B (POP 40%, γ = 0.1: n_C = 1434 candidate rows of
    d = 4096, a shortlist of s = 1075, σ = 0.75), bf16 and int8 (the rows' scales prefetched into
    SMEM, no XLA gather of them): Mosaic compiles it at exactly its own VMEM estimate, within the
    chip's VMEM, with its own traffic as the cost and no copy of the rows."""
    pytest.importorskip("libtpu", reason="compile-only TPU checks need libtpu (the test extra)")
    sharding = jax.sharding.SingleDeviceSharding(resolve_topology(f"{chip}:1x1").devices[0])
    d, n_c, s = 4096, 1434, 1075
    for w_dtype in ("bfloat16", "int8"):
        est = matvec_tpu.row_dots_vmem_bytes(1, 128, d, w_dtype, "bfloat16")
        assert est <= ffn_tpu.chip_vmem_bytes(chip)
        rows = ffn_layout.OutputRows(S((n_c, d // 128, 128), w_dtype), S((n_c,), "float32") if w_dtype == "int8" else None)
        fn = lambda x, r, i: matvec_tpu.gather_row_dots(x, r, i, chip=chip, vmem_limit_bytes=est)  # noqa: E731,B023
        compiled = compile_on(sharding, fn, [S((1, d), "bfloat16"), rows, S((s,), "int32")])
        own = traffic.gather_row_dots_bytes(s, s, 128, d, 1, w_dtype, "bfloat16", n_c)
        assert own <= compiled.cost_analysis()["bytes accessed"] <= 1.03 * own < 0.8 * n_c * d * jnp.dtype(w_dtype).itemsize
        assert compiled.memory_analysis().temp_size_in_bytes < 128 * d  # ids and outputs, no copy of the rows


def test_row_dots_move_the_bytes_they_count():
    """One DMA per kept row: ids with a repeat, one out of range and padding past count move nothing."""
    rng = np.random.default_rng(4)
    batch, n, chunk = 2, 40, 4
    x, values = _simulated(rng, ((batch, 1000), "float32"), ((n, 8, 128), "int8"))
    ids = jnp.asarray([3, 7, 7, 20, 45, 0, 39, 1, 1], jnp.int32)  # 6 kept of count 8; 9 positions
    rows = ffn_layout.OutputRows(values, jnp.ones((n,), jnp.float32))
    with hbm_traffic() as tally:
        jax.block_until_ready(matvec_tpu.gather_row_dots(x, rows, ids, count=8, chunk=chunk, interpret=pltpu.InterpretParams()))
    counted = traffic.gather_row_dots_bytes(6, 9, chunk, 1000, batch, "int8", "float32", n)
    # the simulator keeps the scalar-prefetched ids, keep flags and scales in SMEM, and reads
    # each output block in once
    assert tally["read"] + tally["written"] == counted - 2 * 12 * 4 - n * 4 + 12 * batch * 4


def test_block_matvec_moves_the_bytes_it_counts():
    """Block fetches by the BlockSpec pipeline: ids [3, 3, 0, 2]: 3 fetches, not 4."""
    rng = np.random.default_rng(3)
    batch, k, n, b = 2, 64, 300, 16  # W [300, 64]: rows of 1024 (8 lines)
    x, values = _simulated(rng, ((batch, k), "float32"), ((k, 8, 128), "float32"))
    ids = np.asarray([3, 3, 0, 2], np.int32)
    with hbm_traffic() as tally:
        jax.block_until_ready(matvec_tpu.block_matvec(x, ffn_layout.InputRows(values), jnp.asarray(ids), block=b, out_features=n,
                                                      interpret=pltpu.InterpretParams()))
    fetches = traffic.count_distinct_fetches(ids)
    counted = traffic.block_matvec_bytes(fetches, len(ids), b, n, batch, "float32", "float32")
    # the simulator keeps the scalar-prefetched ids in SMEM and reads the output block in once
    assert fetches == 3 and tally["read"] + tally["written"] == counted - len(ids) * 4 + batch * 1024 * 4


# ------------------------------------------------------------------------- bad input, one line each
def _fail(fn, *args, match, **kwargs):
    with pytest.raises(ValueError, match=match) as err:
        jax.eval_shape(lambda *a: fn(*a, **kwargs), *args)
    assert "\n" not in str(err.value)


def test_bad_input_is_one_clear_line():
    gate_up, down = jnp.zeros((2, 96, 64)), jnp.zeros((64, 96))
    with pytest.raises(ValueError, match="block size 40 does not divide the 96 channels"):
        block_slab.block_layout(gate_up, down, 40)
    with pytest.raises(ValueError, match="int8 weights need gate_up_scale"):
        ffn_layout.channel_layout(gate_up.astype(jnp.int8), down.astype(jnp.int8))
    with pytest.raises(ValueError, match="not an FFN's weights"):
        block_slab.block_layout(gate_up, down.T, 8)
    big = block_args(8, 16384, 16384, 2048, 4, "bfloat16")  # 2 × 192 MiB slab buffers
    _fail(ffn_tpu.block_ffn, *big, match=r"needs 3\d\d\.\d MiB of VMEM, over v5e's 128 MiB")
    _fail(ffn_tpu.gather_ffn, *gather_args(64, 8192, 512, 600, "float32"), chunk=1024, match="over v6e's 128 MiB", chip="v6e")
    _fail(ffn_tpu.block_ffn, *block_args(65, 256, 256, 128, 2, "bfloat16"), match="batch 65 is outside the kernels' range; use 1 to 64")
    _fail(ffn_gpu.block_ffn, *block_args(2, 256, 256, 128, 2, "bfloat16"), act="relu", match="act='relu' is not a kernel activation")
    _fail(ffn_tpu.block_ffn, *block_args(2, 256, 256, 128, 2, "bfloat16"), chip="v3", match="chip='v3' is not a known TPU")
    x, slab, _ = block_args(2, 256, 256, 128, 2, "bfloat16")
    _fail(ffn_tpu.block_ffn, x, slab, S((2, 2), "int32"), match=r"block_ids of shape \(2, 2\) must be a non-empty vector")
    _fail(ffn_tpu.block_ffn, x, slab, S((2,), "int32"), S((3, 2), "bool"), match=r"row_mask of shape \(3, 2\) does not fit")
    _fail(ffn_gpu.block_ffn, S((2, 200), "bfloat16"), slab, S((2,), "int32"), match=r"x of shape \(2, 200\) does not fit the weights")
    x, rows, _ = gather_args(2, 2048, 256, 4, "bfloat16")
    _fail(ffn_tpu.gather_ffn, S((2, 1000), "bfloat16"), rows, S((4,), "int32"), match=r"do not fit x's d=1000; expected \[3, \(S,\) f, 8, 128\]")
    up_down = ffn_layout.ChannelRows(S((2, 3, 256, 16, 128), "bfloat16"))  # a stack of 3 layers' up and down rows
    _fail(ffn_tpu.gather_ffn, x, up_down, S((4,), "int32"), match=r"expected \[3, \(S,\) f, 16, 128\]")  # no gate values given
    _fail(ffn_gpu.gather_ffn, x, up_down, S((4,), "int32"), gate=S((2, 4), "float32"),
          match=r"a stack \[m, S, f, L, 128\] needs a layer index, one matrix none")
    _fail(ffn_tpu.gather_ffn, x, up_down, S((4,), "int32"), gate=S((2, 256), "float32"), layer=1,
          match=r"gate of shape \(2, 256\) with ids of shape \(4,\): given gate values are \[B, m\] = \[2, m\] beside ids \[m\]")
    _fail(ffn_tpu.gather_ffn, x, rows, S((3, 4), "int32"), match=r"ids of shape \(3, 4\) do not fit")
    _fail(ffn_tpu.gather_ffn, x, rows, S((4,), "int32"), chunk=0, match="chunk=0 must be a positive")
    _fail(ffn_tpu.gather_ffn, S((2, 2048), "int8"), rows, S((4,), "int32"), match="x of dtype int8 is not supported")
    inputs = ffn_layout.InputRows(S((64, 8, 128), "bfloat16"))
    _fail(matvec_tpu.gather_matvec, S((2, 64), "bfloat16"), inputs, S((4,), "int32"), out_features=2000, match="do not hold 2000 outputs; expected")
    _fail(ffn_gpu.gather_matvec, S((2, 63), "bfloat16"), inputs, S((4,), "int32"), out_features=1000, match=r"x of shape \(2, 63\) does not fit")
    _fail(matvec_tpu.block_matvec, S((2, 64), "bfloat16"), inputs, S((2,), "int32"), block=24, out_features=1000,
          match="block=24 does not divide the 64 input rows; use a positive divisor of 64")
    with pytest.raises(ValueError, match="block=24 does not divide the 64 input rows; use a positive divisor of 64"):
        decode_ffn.block_positions(jnp.zeros((2,), jnp.int32), 24, 64)  # the GPU's block read
    _fail(matvec_tpu.block_matvec, S((2, 64), "bfloat16"), inputs, S((2, 2), "int32"), block=16, out_features=1000,
          match=r"block_ids of shape \(2, 2\): expected \[nb\] with nb >= 1")
    _fail(matvec_tpu.block_matvec, S((64, 64), "bfloat16"), ffn_layout.InputRows(S((64, 1024, 128), "float32")), S((4,), "int32"),
          block=64, out_features=131072, match="over v5e's 128 MiB")
    with pytest.raises(ValueError, match=r"int8 W needs scale \[10, 1\]"):
        ffn_layout.input_layout(jnp.zeros((10, 4), jnp.int8))
    with pytest.raises(ValueError, match=r"int8 W needs scale \[10, 1\]"):
        ffn_layout.output_layout(jnp.zeros((10, 4), jnp.int8))
    outputs = ffn_layout.OutputRows(S((64, 8, 128), "bfloat16"))
    _fail(matvec_tpu.gather_row_dots, S((2, 2000), "bfloat16"), outputs, S((4,), "int32"),
          match=r"rows of shape \(64, 8, 128\) do not fit x's d=2000; expected \[n, 16, 128\] \(ffn_layout.output_layout\)")
    _fail(ffn_gpu.gather_row_dots, S((2, 1000), "bfloat16"), outputs, S((2, 4), "int32"), match=r"ids of shape \(2, 4\): expected \[m\]")
    _fail(matvec_tpu.values_matvec, S((2, 5), "float32"), inputs, S((4,), "int32"), out_features=1000,
          match=r"values of shape \(2, 5\) with ids of shape \(4,\): expected values \[B, m\] beside ids \[m\]")
    _fail(matvec_tpu.gather_row_dots, S((2, 1000), "bfloat16"), ffn_layout.OutputRows(outputs.values, S((63,), "float32")),
          S((4,), "int32"), match=r"scale of shape \(63,\) does not fit rows \(64, 8, 128\); expected \[64\]")
