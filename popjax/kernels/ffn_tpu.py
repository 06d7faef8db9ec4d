"""Pallas TPU kernels for a decode step's pruned FFN: y = down · (act(gate · x) ⊙ up · x) over
only the selected channels, for x [B, d] (B 1–64), f32 accumulation, bf16/f32/int8 weights.

* `block_ffn` (block-granular): the grid walks the selected blocks; each step's `BlockSlab`
  block [3, b, d] is fetched by a BlockSpec whose index map reads the scalar-prefetched ids
  (jax's megablox/paged-attention pattern), so the pipeline double-buffers the fetches and a
  block asked for twice in a row is not fetched again (padding repeats the last id for that).
* `gather_ffn` (channel-granular, POP as the paper defines it): the grid walks chunks of
  channel ids; each channel's three rows are DMA'd from HBM (`ChannelRows` [3, f, L, 128], left
  in place with ``memory_space=ANY``: a channel is whole (8, 128) tiles, `ffn_layout`) into a
  [2, 3, chunk, L, 128] VMEM scratch, the next chunk's copies started before this chunk's dot
  (paged attention's double buffering).

Both add a position's contribution only where its keep flag (and the row's mask) says so
(`selection.Selection`). Each sets ``vmem_limit_bytes`` from its own VMEM estimate, refuses
one over the chip's VMEM, and passes the compiler its own traffic as ``pl.CostEstimate`` (the
TPU cost model otherwise counts whole operands as read). ``interpret=True`` (or a
``pltpu.InterpretParams``) runs them on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .block_slab import BlockSlab, check_slab, slab_view
from .chips import TPU_CHIPS, tpu_chip
from .ffn_layout import ChannelRows, activation, channel_lines, check_channel_rows, check_gate, stack_view
from .selection import select_blocks, select_channels
from .traffic import block_ffn_bytes, gather_ffn_bytes

# Default scoped VMEM per chip (the floor of a kernel's limit) and physical VMEM per core: the
# device kind's figures (`chips`: their sources, measured or assumed)
DEFAULT_SCOPED_VMEM = {name: chip.default_scoped_vmem for name, chip in TPU_CHIPS.items()}
_VMEM_MARGIN = 2 << 20  # headroom over the estimate in the limit a kernel is built with
# Mosaic's own scoped VMEM beside the buffers (semaphores, its temporaries): the smallest
# vmem_limit_bytes that compiles (bisected, libtpu 0.0.42, v5e) exceeds the buffers below by up
# to 190 KiB (int8 gather, Llama-3.1-8B, batch 1) and falls short of them for bf16. The
# estimates carry 256 KiB so that they bound what the compiler allocates; the benchmark
# (benchmarks/kernels_compile.py) compiles every shipped shape with the limit set to them.
MOSAIC_OWN_VMEM = 256 << 10
_NT = (((1,), (1,)), ((), ()))  # x [B, d] · rows [n, d]ᵀ


def chip_vmem_bytes(chip: str) -> int:
    """Physical VMEM of one TensorCore of ``chip`` ("v4", "v5e", "v5p", "v6e", "v7x": `chips`)."""
    return tpu_chip(chip).vmem_bytes


def vmem_buffer_bytes(shape: tuple[int, ...], dtype) -> int:
    """VMEM a buffer takes: the last two dims padded to Mosaic's tile (lanes to 128; sublanes to
    the packing, doubled up to 8 while under the dim: `tpu_info.infer_tiling` for TPU v4+)."""
    item = jnp.dtype(dtype).itemsize
    shape = (1,) * (2 - len(shape)) + tuple(shape)
    rows, tile = shape[-2], 4 // item
    while tile < min(rows, 8):
        tile *= 2
    lead = 1
    for n in shape[:-2]:
        lead *= n
    return lead * -(-rows // tile) * tile * -(-shape[-1] // 128) * 128 * item


def in_hbm(weights: jax.Array, interpret: bool) -> jax.Array:
    """``weights`` pinned to HBM for a kernel that reads parts of them (its DMAs, or a BlockSpec
    pipeline over selected blocks). Left to choose, XLA:TPU stages an operand that fits into VMEM
    before the call: a decode step then reads the whole copy from HBM, which is what the kernel is
    there to avoid (POP's candidate rows: docs/kernels.md, "The whole decode step on a TPU").
    Interpret mode has no memory spaces, an eager call's operand is an argument already in HBM,
    and under vmap the weights stay unpinned (`_pinned_to_hbm_batched`)."""
    if interpret or not isinstance(weights, jax.core.Tracer):
        return weights
    return _pinned_to_hbm(weights)


@jax.custom_batching.custom_vmap
def _pinned_to_hbm(weights):
    return pltpu.with_memory_space_constraint(weights, pltpu.HBM)


@_pinned_to_hbm.def_vmap
def _pinned_to_hbm_batched(axis_size, in_batched, weights):
    # Under vmap (a per-sequence method at batch > 1) batched weights stay unpinned: JAX has no batching
    # rule for the constraint, and the batched pallas_call slices its operands per row, which an
    # operand constrained to HBM does not allow (XLA may then stage a small copy into VMEM again).
    # Weights the map leaves whole (held rows, `held_rows.per_row`) are pinned as outside it.
    return (weights if in_batched[0] else pltpu.with_memory_space_constraint(weights, pltpu.HBM)), in_batched[0]


def vmem_limit(estimate: int, chip: str | None, what: str, interpret: bool = False) -> int:
    """The vmem_limit_bytes for a kernel needing ``estimate``: the chip's default scoped VMEM or
    the estimate plus headroom; ValueError naming ``what`` when it exceeds the chip's VMEM.
    ``chip`` None: the device the program is traced for (`chips.tpu_chip`: its device kind; a
    v5e in interpret mode)."""
    target = tpu_chip(chip, interpret)
    if estimate > target.vmem_bytes:
        raise ValueError(f"{what} needs {estimate / 2**20:.1f} MiB of VMEM, over {target.name}'s "
                         f"{target.vmem_bytes / 2**20:.0f} MiB; use a smaller block, chunk or batch")
    return min(target.vmem_bytes, max(target.default_scoped_vmem, estimate + _VMEM_MARGIN))


def block_vmem_bytes(batch: int, block_size: int, d: int, weight_dtype, x_dtype, masked: bool) -> int:
    """VMEM of `block_ffn`: double-buffered slab blocks, x, y and masks, the f32 accumulator."""
    total = MOSAIC_OWN_VMEM + 2 * vmem_buffer_bytes((3, block_size, d), weight_dtype)
    total += 4 * vmem_buffer_bytes((batch, d), x_dtype) + vmem_buffer_bytes((batch, d), jnp.float32)
    total += 2 * vmem_buffer_bytes((batch, 1), jnp.float32) if masked else 0
    if jnp.dtype(weight_dtype) == jnp.int8:
        total += 2 * vmem_buffer_bytes((2, block_size), jnp.float32) + 2 * vmem_buffer_bytes((1, d), jnp.float32)
    return total


def gather_vmem_bytes(batch: int, chunk: int, d: int, weight_dtype, x_dtype, matrices: int = 3) -> int:
    """VMEM of `gather_ffn`: the two-slot row scratch (``matrices`` rows per channel), x, y,
    masks, the accumulator (x, y and the rows L·128 wide, `ffn_layout.channel_lines`)."""
    lines = channel_lines(d)
    d = lines * 128
    total = MOSAIC_OWN_VMEM + vmem_buffer_bytes((2, matrices, chunk, lines, 128), weight_dtype)
    total += 4 * vmem_buffer_bytes((batch, d), x_dtype) + vmem_buffer_bytes((batch, d), jnp.float32)
    total += 2 * vmem_buffer_bytes((batch, chunk), jnp.float32)
    if jnp.dtype(weight_dtype) == jnp.int8:
        total += 2 * vmem_buffer_bytes((2, chunk), jnp.float32) + 2 * vmem_buffer_bytes((1, d), jnp.float32)
    return total


def _ffn_step(x, gate, up, down, gate_up_scale, mask, act):
    """One selected piece: x [B, d], gate/up/down rows [n, d] -> its [B, d] contribution (f32).
    gate_up_scale [2, n] (int8) or None; mask [B, 1] or [B, n] or None. gate None: the gate
    values are given, folded into the mask (h = (up · x) ⊙ mask), and the scale is up's [1, n]."""
    u = lax.dot_general(x, up.astype(x.dtype), _NT, preferred_element_type=jnp.float32)
    if gate_up_scale is not None:
        u = u * gate_up_scale[-1:]
    h = u
    if gate is not None:
        g = lax.dot_general(x, gate.astype(x.dtype), _NT, preferred_element_type=jnp.float32)
        h = act(g if gate_up_scale is None else g * gate_up_scale[0:1]) * u
    if mask is not None:
        h = h * mask
    return jnp.dot(h.astype(x.dtype), down.astype(x.dtype), preferred_element_type=jnp.float32)


def finish(acc_ref, o_ref, down_scale_ref) -> None:
    """o = the f32 accumulator (times the int8 output scale, when there is one) in o's dtype."""
    y = acc_ref[...]
    if down_scale_ref is not None:
        y = y * down_scale_ref[...]
    o_ref[...] = y.astype(o_ref.dtype)


def _block_kernel(ids_ref, keep_ref, *refs, act, masked, int8):
    del ids_ref  # read by the index maps
    x_ref, slab_ref, *refs = refs
    mask_ref = refs.pop(0) if masked else None
    gus_ref, ds_ref = (refs.pop(0), refs.pop(0)) if int8 else (None, None)
    o_ref, acc_ref = refs
    i = pl.program_id(0)

    @pl.when(i == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(keep_ref[i] == 1)
    def _():
        w = slab_ref[...]
        scale = gus_ref[...] if int8 else None
        mask = mask_ref[...] if masked else None
        acc_ref[...] += _ffn_step(x_ref[...], w[0], w[1], w[2], scale, mask, act)

    @pl.when(i == pl.num_programs(0) - 1)
    def _():
        finish(acc_ref, o_ref, ds_ref)


def block_ffn(
    x: jax.Array,
    slab: BlockSlab,
    block_ids: jax.Array,
    row_mask: jax.Array | None = None,
    *,
    count: int | jax.Array | None = None,
    act: str = "silu",
    layer: jax.Array | int | None = None,
    interpret: bool | pltpu.InterpretParams = False,
    chip: str | None = None,
    vmem_limit_bytes: int | None = None,
) -> jax.Array:
    """y [B, d] = the FFN of x [B, d] over the blocks ``block_ids [n]`` (ids[:count] selected,
    `selection`'s docstring) of ``slab`` (`block_slab.BlockSlab`, values [nb, 3, b, d], or a
    stack [S, nb, 3, b, d] read at ``layer`` by offset ids); with ``row_mask [B, nb]`` (bool)
    row r adds only the blocks it chose (block_ids then being the union,
    `selection.union_of_rows`). ``act`` is "silu" or "gelu_pytorch_tanh"; ``chip`` sizes the
    VMEM check; ``vmem_limit_bytes`` overrides the limit derived from it."""
    nb, b, d = check_slab(slab, x, act, layer)
    batch = x.shape[0]
    sel = select_blocks(block_ids, nb, batch, count, row_mask)
    slab, first = slab_view(slab, layer)
    n = sel.ids.shape[0]
    masked, int8 = sel.mask is not None, slab.gate_up_scale is not None
    est = block_vmem_bytes(batch, b, d, slab.values.dtype, x.dtype, masked)
    limit = vmem_limit_bytes or vmem_limit(est, chip, f"block_ffn (B={batch}, b={b}, d={d}, {slab.values.dtype})", bool(interpret))

    fixed = lambda i, ids, keep: (0, 0)  # noqa: E731
    in_specs = [pl.BlockSpec((batch, d), fixed), pl.BlockSpec((None, 3, b, d), lambda i, ids, keep: (ids[i], 0, 0, 0))]
    args = [x, in_hbm(slab.values, interpret)]
    if masked:
        in_specs.append(pl.BlockSpec((None, batch, 1), lambda i, ids, keep: (i, 0, 0)))
        args.append(sel.mask[:, :, None])
    if int8:
        in_specs += [pl.BlockSpec((None, 2, b), lambda i, ids, keep: (ids[i], 0, 0)), pl.BlockSpec((1, d), fixed)]
        args += [slab.gate_up_scale, slab.down_scale]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(n,),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((batch, d), fixed),
        scratch_shapes=[pltpu.VMEM((batch, d), jnp.float32)],
    )
    traffic = block_ffn_bytes(n, n, b, d, batch, slab.values.dtype, x.dtype, masked)
    return pl.pallas_call(
        functools.partial(_block_kernel, act=activation(act), masked=masked, int8=int8),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((batch, d), x.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",), vmem_limit_bytes=limit),
        cost_estimate=pl.CostEstimate(flops=6 * batch * d * b * n, transcendentals=batch * b * n, bytes_accessed=traffic),
        interpret=interpret,
        name="block_ffn",
    )(sel.ids + first, sel.keep, *args)


def fetch_rows(ids_ref, keep_ref, sems, chunk: int, steps: int, pairs) -> jax.Array:
    """Grid step c's rows, double-buffered: at step c the DMAs of chunk c + 1 start (chunk 0's
    at step 0) and those of chunk c are waited on; returns the slot (0/1) holding chunk c.
    ``pairs``: one (src(id) -> HBM view, dst(slot, r) -> VMEM view) per matrix. A position not
    kept moves nothing; its rows are zeroed instead (its h is 0, but 0 · NaN is NaN)."""
    c = pl.program_id(0)

    def each(step, slot, kept, skipped=None):
        def one(r, carry):
            pos = step * chunk + r
            pl.when(keep_ref[pos] == 1)(lambda: kept(pos, r))
            if skipped is not None:
                pl.when(keep_ref[pos] != 1)(lambda: skipped(r))
            return carry

        lax.fori_loop(0, chunk, one, 0)

    def copies(pos, slot, r):
        return [pltpu.make_async_copy(src(ids_ref[pos]), dst(slot, r), sems.at[slot]) for src, dst in pairs]

    def start(step, slot):
        def zero(r):
            for _, dst in pairs:
                view = dst(slot, r)
                view[...] = jnp.zeros(view.shape, view.dtype)

        def go(pos, r):
            for cp in copies(pos, slot, r):
                cp.start()

        each(step, slot, go, zero)

    def wait(step, slot):
        def done(pos, r):
            for cp in copies(pos, slot, r):
                cp.wait()

        each(step, slot, done)

    pl.when(c == 0)(lambda: start(0, 0))
    slot = c % 2
    pl.when(c + 1 < steps)(lambda: start(c + 1, 1 - slot))
    wait(c, slot)
    return slot


def _gather_kernel(ids_ref, keep_ref, *refs, act, chunk, steps, int8, matrices):
    x_ref, mask_ref, *refs = refs
    gus_ref, ds_ref = (refs.pop(0), refs.pop(0)) if int8 else (None, None)
    rows_hbm, o_ref, buf, sems, acc_ref = refs
    c = pl.program_id(0)

    @pl.when(c == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    # the matrices fetched per channel: (gate, up, down), or (up, down) when the gate is given
    pairs = [(lambda i, k=k: rows_hbm.at[k, i], lambda slot, r, j=j: buf.at[slot, j, r]) for j, k in enumerate(matrices)]
    slot = fetch_rows(ids_ref, keep_ref, sems, chunk, steps, pairs)
    d = buf.shape[3] * buf.shape[4]
    w = [buf[slot, j].reshape(chunk, d) for j in range(len(matrices))]
    gate, up, down = ([None] + w) if len(w) == 2 else w
    scale = gus_ref[...] if int8 else None
    acc_ref[...] += _ffn_step(x_ref[...], gate, up, down, scale, mask_ref[...], act)

    @pl.when(c == steps - 1)
    def _():
        finish(acc_ref, o_ref, ds_ref)


def gather_ffn(
    x: jax.Array,
    rows: ChannelRows,
    ids: jax.Array,
    *,
    count: int | jax.Array | None = None,
    act: str = "silu",
    gate: jax.Array | None = None,
    layer: jax.Array | int | None = None,
    expected_rows: int | None = None,
    chunk: int = 64,
    interpret: bool | pltpu.InterpretParams = False,
    chip: str | None = None,
    vmem_limit_bytes: int | None = None,
) -> jax.Array:
    """y [B, d] = the FFN of x [B, d] over channels ``ids`` of ``rows`` (`ChannelRows`, values
    [3, f, L, 128]): ids [m] for every row (ids[:count] selected), or [B, m] per row (count [B]
    or a scalar), served as their union with a per-row mask. ``chunk`` channels per grid step.
    ``gate`` [B, m] fp32 beside ids [m]: each row's activated gate value of the channel at each
    position (computed before the call: CATS thresholds them; 0 where the row does not add the
    channel): then only the up and down rows are fetched and h = gate ⊙ (up · x) (``rows`` may
    hold just those two, [2, f, L, 128]). ``layer``: with ``rows`` a stack of S layers
    (`ffn_layout.stacked_up_down_layout`), the one to read (traced or not; no layer is copied).
    ``expected_rows``: the channels a call is expected to read, for the compiler's cost estimate
    (default: every position; a threshold's count is known only at run time)."""
    f, lines, layers = check_channel_rows(rows, x, act, gated=gate is not None, layer=layer)
    check_gate(gate, ids, x.shape[0])
    d = x.shape[-1]
    width = lines * 128
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be a positive number of channels per step")
    batch = x.shape[0]
    sel = select_channels(ids, f, batch, count)
    n = sel.ids.shape[0]
    steps = -(-n // chunk)
    pad = steps * chunk - n
    m = rows.values.shape[0]
    matrices = tuple(range(m))[-2:] if gate is not None else (0, 1, 2)
    values, gus, down_scale, offset = stack_view(rows, layer, layers)
    fetch = jnp.pad(sel.ids, (0, pad), mode="edge") + offset
    keep = jnp.pad(sel.keep, (0, pad))
    if gate is None:
        mask = sel.keep[:, None].astype(jnp.float32) if sel.mask is None else sel.mask
        mask = jnp.broadcast_to(mask, (n, batch)).T
    else:  # h = gate ⊙ (up · x) ⊙ keep: the values by position, no gather
        mask = gate.astype(jnp.float32) * sel.keep[None, :]
    mask = jnp.pad(mask, ((0, 0), (0, pad))).reshape(batch, steps, chunk).transpose(1, 0, 2)  # [steps, B, chunk]
    int8 = rows.gate_up_scale is not None
    est = gather_vmem_bytes(batch, chunk, d, rows.values.dtype, x.dtype, len(matrices))
    limit = vmem_limit_bytes or vmem_limit(est, chip, f"gather_ffn (B={batch}, chunk={chunk}, d={d}, {rows.values.dtype})", bool(interpret))

    fixed = lambda i, ids, keep: (0, 0)  # noqa: E731
    per_step = lambda i, ids, keep: (i, 0, 0)  # noqa: E731
    in_specs = [pl.BlockSpec((batch, width), fixed), pl.BlockSpec((None, batch, chunk), per_step)]
    args = [jnp.pad(x, ((0, 0), (0, width - d))), mask]
    if int8:
        # XLA gathers the kept channels' scales before the call (the cost model charges it more
        # than the few KB it moves: docs/kernels.md, "What is left"); two 1-D takes cost more
        scales = (gus[-1:] if gate is not None else gus)[:, fetch]
        k = scales.shape[0]
        in_specs += [pl.BlockSpec((None, k, chunk), per_step), pl.BlockSpec((1, width), fixed)]
        args += [scales.reshape(k, steps, chunk).transpose(1, 0, 2), down_scale]
    in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
    args.append(in_hbm(values, interpret))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(steps,),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((batch, width), fixed),
        scratch_shapes=[
            pltpu.VMEM((2, len(matrices), chunk, lines, 128), rows.values.dtype),
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.VMEM((batch, width), jnp.float32),
        ],
    )
    traffic = gather_ffn_bytes(n if expected_rows is None else expected_rows, n, chunk, d, batch, rows.values.dtype, x.dtype,
                               len(matrices))
    y = pl.pallas_call(
        functools.partial(_gather_kernel, act=activation(act), chunk=chunk, steps=steps, int8=int8, matrices=matrices),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((batch, width), x.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",), vmem_limit_bytes=limit),
        cost_estimate=pl.CostEstimate(flops=2 * len(matrices) * batch * width * n, transcendentals=batch * n, bytes_accessed=traffic),
        interpret=interpret,
        name="gather_ffn",
    )(fetch, keep, *args)
    return y[:, :d]
