"""The HBM bytes of a compiled TPU program, counted from its optimized HLO
(popjax.analysis.hbm_traffic): small programs compiled by XLA:TPU (libtpu, no TPU) whose HBM
traffic is known by hand — a feed-forward layer's weights read once although the compiler
stages them into VMEM, a cache updated in place, a loop reading a buffer block by block, a
Pallas kernel's declared bytes — and bad input."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from popjax.analysis.hbm_traffic import hbm_traffic
from popjax.analysis.hlo_text import parse_module
from popjax.analysis.tpu_compile import step_cost

pytestmark = pytest.mark.slow  # compiles for a TPU
pytest.importorskip("libtpu")


@functools.cache
def _chip():
    from popjax.analysis.topologies import resolve_topology

    return jax.sharding.SingleDeviceSharding(resolve_topology("v5e:1x1").devices[0])


def _compiled(fn, *shapes, donate=()):
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=_chip()) for shape, dtype in shapes]
    return jax.jit(fn, donate_argnums=donate).lower(*args).compile()


def _bytes(shape, dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * jnp.dtype(dtype).itemsize


@pytest.mark.parametrize("batch", [1, 2, 8])
def test_a_feed_forward_reads_its_weights_once_though_the_compiler_stages_them(batch):
    d, f = 640, 2048

    def ffn(x, gate_up, down):
        return (jax.nn.silu(x @ gate_up[0].T) * (x @ gate_up[1].T)) @ down.T

    compiled = _compiled(ffn, ((batch, d), jnp.bfloat16), ((2, f, d), jnp.bfloat16), ((d, f), jnp.bfloat16))
    weights = _bytes((3, f, d), jnp.bfloat16)
    cost = step_cost(compiled)
    # x and the output are 1.3 KB per row: the step moves its weights and nearly nothing else (at
    # batch > 1 the dots are convolutions whose weight operand passes through a bitcast fusion)
    assert weights <= cost["hbm_bytes"] <= weights + 8 * _bytes((batch, d), jnp.bfloat16)
    # the cost analysis counts the staging into VMEM as well (docs/tpu.md): far above the HBM bytes
    assert cost["bytes_accessed"] > 1.5 * cost["hbm_bytes"]
    # some weights go through VMEM buffers (S(1)) the count leaves out
    computations, entry = parse_module(compiled.as_text())
    spaces = {leaf.space for ins in computations[entry].instructions.values() for leaf in ins.leaves}
    assert {0, 1} <= spaces


@pytest.mark.parametrize("batch", [1, 2, 8])
def test_a_weight_passed_through_a_bitcast_fusion_is_read_whole(batch):
    """An LM head's product at batch > 1: XLA:TPU emits a convolution whose weight operand is a
    nested fusion that only bitcasts it; the weight is read whole (it was counted as 0 bytes)."""
    n, d = 32768, 4096

    def head(x, w):
        return jnp.einsum("bd,vd->bv", (x * 2).astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)

    compiled = _compiled(head, ((batch, d), jnp.float32), ((n, d), jnp.bfloat16))
    weight = _bytes((n, d), jnp.bfloat16)
    assert weight <= hbm_traffic(compiled.as_text())["bytes"] <= weight * 1.01


def test_a_cache_updated_in_place_counts_only_the_update():
    slots, heads, dim = 4096, 8, 128

    def write(cache, new, position):
        return jax.lax.dynamic_update_slice(cache, new, (position, 0, 0))

    compiled = _compiled(write, ((slots, heads, dim), jnp.bfloat16), ((1, heads, dim), jnp.bfloat16),
                         ((), jnp.int32), donate=(0,))
    update = _bytes((1, heads, dim), jnp.bfloat16)
    traffic = hbm_traffic(compiled.as_text())
    assert update <= traffic["bytes"] <= 4 * update  # read the update, write it: not the 8 MB cache


@pytest.mark.parametrize("static_trips", [True, False], ids=["static-trips", "dynamic-trips"])
def test_a_loop_over_a_buffer_in_blocks_reads_it_whole(static_trips):
    rows, width, block = 1024, 512, 16  # 64 trips: XLA:TPU keeps the loop (a while without a trip count)

    def blockwise(buffer, n):
        def step(j, acc):
            return acc + jax.lax.dynamic_slice_in_dim(buffer, j * block, block).astype(jnp.float32).sum(0)

        trips = rows // block if static_trips else n
        return jax.lax.fori_loop(0, trips, step, jnp.zeros((width,), jnp.float32))

    compiled = _compiled(blockwise, ((rows, width), jnp.bfloat16), ((), jnp.int32))
    assert " while(" in compiled.as_text()
    traffic = hbm_traffic(compiled.as_text())
    whole = _bytes((rows, width), jnp.bfloat16)
    # a dynamic trip count counts as many trips as read the buffer whole, as the analytic ideal counts a cache
    assert whole <= traffic["bytes"] <= whole * 1.05
    assert traffic["unknown_trip_loops"] == 0


def test_a_loop_over_a_buffer_in_blocks_reads_only_its_filled_blocks_when_told():
    # decode attention at a step: the cache's first `filled` slots are written and read, no more
    rows, width, block = 1024, 512, 16

    def blockwise(buffer, n):
        step = lambda j, acc: acc + jax.lax.dynamic_slice_in_dim(buffer, j * block, block).astype(jnp.float32).sum(0)
        return jax.lax.fori_loop(0, n, step, jnp.zeros((width,), jnp.float32))

    text = _compiled(blockwise, ((rows, width), jnp.bfloat16), ((), jnp.int32)).as_text()
    per_block = _bytes((block, width), jnp.bfloat16)
    for filled in (1, 100, 1024, 5000):
        blocks = min(-(-filled // block), rows // block)
        assert blocks * per_block <= hbm_traffic(text, filled=filled)["bytes"] <= blocks * per_block + 64 * 1024


def test_a_scan_over_stacked_layers_reading_each_layers_blocks_reads_the_stack_once():
    # a scanned model's decode attention: a scan over L layers (a counted loop), each running a
    # loop with a dynamic trip count over its own blocks of the stacked cache [L, S, w]
    layers, rows, width, block = 4, 1024, 512, 16

    def scanned(stack, weights, x, n):
        def layer(h, xs):
            index, w = xs

            def step(j, acc):
                piece = jax.lax.dynamic_slice(stack, (index, j * block, 0), (1, block, width))[0]
                return acc + (piece.astype(jnp.float32) * h).sum(0)

            attended = jax.lax.fori_loop(0, n, step, jnp.zeros((width,), jnp.float32))
            return (attended @ w.astype(jnp.float32)).astype(h.dtype), None

        return jax.lax.scan(layer, x, (jnp.arange(layers), weights))[0]

    compiled = _compiled(scanned, ((layers, rows, width), jnp.bfloat16), ((layers, width, width), jnp.bfloat16),
                         ((width,), jnp.bfloat16), ((), jnp.int32))
    traffic = hbm_traffic(compiled.as_text())
    whole = _bytes((layers, rows, width), jnp.bfloat16) + _bytes((layers, width, width), jnp.bfloat16)
    # each layer's blocks once (not the whole stack per block trip), each layer's weights once
    assert whole <= traffic["bytes"] <= whole * 1.05
    assert traffic["unknown_trip_loops"] == 0


@pytest.mark.parametrize("columns, moved", [(6519, 3.0), (6520, 1.0)])
def test_a_scan_over_a_stack_of_a_width_not_a_multiple_of_8_copies_it(columns, moved):
    # why compact copies are padded to a multiple of 8 channels (sharding.pad_ids): POP's retained
    # down columns of the 8B at 40%, n_R = 6519, stacked over layers and read one layer per trip
    layers, d = 4, 4096

    def matvecs(stack, h):
        def layer(acc, w):
            return acc + jnp.einsum("bn,dn->bd", h, w).astype(acc.dtype), None

        return jax.lax.scan(layer, jnp.zeros((1, d), jnp.bfloat16), stack)[0]

    compiled = _compiled(matvecs, ((layers, d, columns), jnp.bfloat16), ((1, columns), jnp.bfloat16))
    stack = _bytes((layers, d, columns), jnp.bfloat16)
    # 6519: XLA:TPU re-lays the stack out for the loop, a whole copy (read and written) per call
    assert hbm_traffic(compiled.as_text())["bytes"] == pytest.approx(moved * stack, rel=0.02)


def test_a_pallas_kernel_counts_the_bytes_it_declares():
    rows, width = 1024, 512
    declared = 8 * width * 2  # the kernel says it reads one 8-row block of its 1 MB operand

    def first_block(x):
        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] * 2

        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, width), x.dtype), grid=(1,),
                              in_specs=[pl.BlockSpec((8, width), lambda i: (0, 0))],
                              out_specs=pl.BlockSpec((8, width), lambda i: (0, 0)),
                              cost_estimate=pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=declared))(x)

    traffic = hbm_traffic(_compiled(first_block, ((rows, width), jnp.bfloat16)).as_text())
    assert traffic["by_opcode"]["pallas"] == declared
    assert traffic["bytes"] < _bytes((rows, width), jnp.bfloat16) / 10


def test_text_without_an_entry_computation_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^the HLO text holds no ENTRY computation$"):
        hbm_traffic("HloModule empty\n")
