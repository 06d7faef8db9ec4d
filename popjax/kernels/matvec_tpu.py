"""Pallas TPU kernel for per-token input sparsity (TEAL, WINA, principal TEAL): y = W · x over
only x's active inputs, reading only those inputs' columns of W, for x [B, k] (B 1–64).

TEAL zeroes the inputs |x_i| ≤ t_x of gate/up and the channels |H_j| ≤ t_h of down, so its
decode FFN is two calls of `masked_matvec` on input-major weights (`ffn_layout.InputRows`, a
stack of every layer's, `ffn_layout.stacked_input_layout`):

    gu = masked_matvec(x, gate_up_rows, |x| > t_x, out_features=2f, layer=l)
    H  = act(gu[:, :f]) * gu[:, f:]
    y  = masked_matvec(H, down_rows, |H| > t_h, out_features=d, layer=l)

as TEAL's own Triton kernel reads W's transpose. `gather_matvec` takes a list of inputs instead
of a mask (channel POP's selected candidates), `values_matvec` a list of inputs with their
values (gate-scored and shortlisted POP's, computed for the chosen rows only). The rows are fetched with the same
double-buffered per-row DMAs as `ffn_tpu.gather_ffn` (`ffn_tpu.fetch_rows`); a batch is served
as the union of its rows' active inputs, a row adding only its own (its x there, else 0).

`block_matvec` is the block-granular form (block POP's down read over its candidate copy): whole
blocks of b consecutive input rows, fetched by a BlockSpec whose index map reads the
scalar-prefetched block ids, so the pipeline double-buffers one contiguous [b, L, 128] copy per
block instead of b row DMAs.

`gather_row_dots` is the other orientation: single outputs u_j = W[j] · x of the rows ``ids``
of output-major weights (`ffn_layout.OutputRows`), fetched by the same row DMAs, for a step
that needs them before choosing (shortlisted POP's up projection of its shortlist).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .ffn_layout import (
    InputRows, OutputRows, channel_lines, check_block, input_stack, masked_selection, output_stack, values_stack,
)
from .selection import counted_blocks, select_channels
from .traffic import block_matvec_bytes, gather_matvec_bytes, gather_row_dots_bytes
from .ffn_tpu import MOSAIC_OWN_VMEM, fetch_rows, finish, in_hbm, vmem_buffer_bytes, vmem_limit


def matvec_vmem_bytes(batch: int, chunk: int, n: int, weight_dtype, x_dtype) -> int:
    """VMEM of `gather_matvec`: the two-slot row scratch, x's values per step, y, the f32
    accumulator (rows, y and accumulator L·128 wide)."""
    lines = channel_lines(n)
    total = MOSAIC_OWN_VMEM + vmem_buffer_bytes((2, chunk, lines, 128), weight_dtype)
    total += 2 * vmem_buffer_bytes((batch, chunk), x_dtype) + 2 * vmem_buffer_bytes((batch, lines * 128), x_dtype)
    total += vmem_buffer_bytes((batch, lines * 128), jnp.float32)
    if jnp.dtype(weight_dtype) == jnp.int8:
        total += 2 * vmem_buffer_bytes((1, lines * 128), jnp.float32)
    return total


def _matvec_kernel(ids_ref, keep_ref, xs_ref, *refs, chunk, steps, scaled):
    scale_ref = refs[0] if scaled else None
    rows_hbm, o_ref, buf, sems, acc_ref = refs[1:] if scaled else refs
    c = pl.program_id(0)

    @pl.when(c == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    slot = fetch_rows(ids_ref, keep_ref, sems, chunk, steps, [(lambda i: rows_hbm.at[i], lambda s, r: buf.at[s, r])])
    xs = xs_ref[...]
    w = buf[slot].reshape(chunk, buf.shape[2] * buf.shape[3]).astype(xs.dtype)
    acc_ref[...] += jnp.dot(xs, w, preferred_element_type=jnp.float32)

    @pl.when(c == steps - 1)
    def _():
        finish(acc_ref, o_ref, scale_ref)


def gather_matvec(
    x: jax.Array,
    rows: InputRows,
    ids: jax.Array,
    *,
    out_features: int,
    count: int | jax.Array | None = None,
    chunk: int = 64,
    interpret: bool | pltpu.InterpretParams = False,
    chip: str | None = None,
    vmem_limit_bytes: int | None = None,
) -> jax.Array:
    """y [B, n] = W · x over the inputs ``ids`` of x [B, k] (W as `InputRows` [k, L, 128],
    n = ``out_features``): ids [m] for every row (ids[:count] active, `selection`'s contract)
    or [B, m] per row (count [B] or a scalar), an input a row did not choose adding nothing.
    Held rows (``rows.layer``: a stack [S, k, L, 128]) are read at their layer by offset."""
    k, _, values, scale, first = input_stack(rows, x, out_features)
    sel = select_channels(ids, k, x.shape[0], count)
    mask = sel.keep[:, None].astype(x.dtype) if sel.mask is None else sel.mask.astype(x.dtype)
    xs = x[:, sel.ids].T * mask  # [n, B]: each position's input value, 0 where not chosen
    n = sel.ids.shape[0]
    return _rows_matvec(xs, sel.ids + first, sel.keep, values, scale, out_features=out_features, rows_read=n,
                        chunk=chunk, interpret=interpret, chip=chip, vmem_limit_bytes=vmem_limit_bytes)


def values_matvec(
    values: jax.Array,
    rows: InputRows,
    ids: jax.Array,
    *,
    out_features: int,
    chunk: int = 64,
    interpret: bool | pltpu.InterpretParams = False,
    chip: str | None = None,
    vmem_limit_bytes: int | None = None,
) -> jax.Array:
    """y [B, n] = Σ_p values[:, p] · W[ids[p]] for values [B, m] given per position (a step that
    computed its inputs for the chosen rows only: nothing to gather from a wider x) and ids [m]
    into W as `InputRows` [k, L, 128] (`selection`'s contract: a position not kept adds nothing),
    or held rows read at their layer."""
    k, _, weights, scale, first = values_stack(values, rows, ids, out_features)
    sel = select_channels(ids, k, values.shape[0])
    xs = (values * sel.keep[None, :].astype(values.dtype)).T  # [m, B]
    return _rows_matvec(xs, sel.ids + first, sel.keep, weights, scale, out_features=out_features, rows_read=ids.shape[0],
                        chunk=chunk, interpret=interpret, chip=chip, vmem_limit_bytes=vmem_limit_bytes)


def masked_matvec(
    x: jax.Array,
    rows: InputRows,
    active: jax.Array,
    *,
    out_features: int,
    layer: int | jax.Array | None = None,
    expected_active: int | None = None,
    chunk: int = 64,
    interpret: bool | pltpu.InterpretParams = False,
    chip: str | None = None,
    vmem_limit_bytes: int | None = None,
) -> jax.Array:
    """y [B, n] = W · (x where ``active``) for x [B, k], reading only the rows of the inputs some
    row keeps (TEAL: ``active`` = |x| > t): rows `InputRows` [k, L, 128] or a stack of layers
    [S, k, L, 128] read at ``layer`` (`ffn_layout.masked_selection`: the kernel's fetch ids point
    into the whole stack, so no layer is sliced out first). ``expected_active`` (default k): the
    inputs a call is expected to keep, for the compiler's cost estimate (the kernel's own count
    at the method's target sparsity; what it reads is data-dependent)."""
    sel = masked_selection(rows, x, active, out_features, layer)
    k = sel.ids.shape[0]
    return _rows_matvec(sel.xs, sel.ids, sel.keep, sel.values, sel.scale, out_features=out_features,
                        rows_read=k if expected_active is None else min(expected_active, k),
                        chunk=chunk, interpret=interpret, chip=chip, vmem_limit_bytes=vmem_limit_bytes)


def _rows_matvec(xs, ids, keep, values, scale, *, out_features, rows_read, chunk, interpret, chip, vmem_limit_bytes):
    """The row-DMA matvec: position p adds xs[p] (x's values [n, B]) times row ids[p] of values
    [K, L, 128] when keep[p] == 1 (its DMA skipped otherwise) -> y [B, out_features]."""
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be a positive number of inputs per step")
    n, batch = xs.shape
    lines = values.shape[1]
    width = lines * 128
    steps = -(-n // chunk)
    pad = steps * chunk - n
    xs = jnp.pad(xs, ((0, pad), (0, 0))).reshape(steps, chunk, batch).transpose(0, 2, 1)
    est = matvec_vmem_bytes(batch, chunk, out_features, values.dtype, xs.dtype)
    limit = vmem_limit_bytes or vmem_limit(est, chip, f"gather_matvec (B={batch}, chunk={chunk}, n={out_features}, {values.dtype})", bool(interpret))

    scaled = scale is not None
    in_specs = [pl.BlockSpec((None, batch, chunk), lambda i, ids, keep: (i, 0, 0))]
    args = [xs]
    if scaled:
        in_specs.append(pl.BlockSpec((1, width), lambda i, ids, keep: (0, 0)))
        args.append(scale)
    in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
    args.append(in_hbm(values, interpret))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(steps,),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((batch, width), lambda i, ids, keep: (0, 0)),
        scratch_shapes=[
            pltpu.VMEM((2, chunk, lines, 128), values.dtype),
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.VMEM((batch, width), jnp.float32),
        ],
    )
    traffic = gather_matvec_bytes(rows_read, n, chunk, out_features, batch, values.dtype, xs.dtype)
    y = pl.pallas_call(
        functools.partial(_matvec_kernel, chunk=chunk, steps=steps, scaled=scaled),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((batch, width), xs.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",), vmem_limit_bytes=limit),
        cost_estimate=pl.CostEstimate(flops=2 * batch * width * rows_read, transcendentals=0, bytes_accessed=traffic),
        interpret=interpret,
        name="gather_matvec",
    )(jnp.pad(ids, (0, pad), mode="edge"), jnp.pad(keep, (0, pad)), *args)
    return y[:, :out_features]


def block_matvec_vmem_bytes(batch: int, block: int, n: int, weight_dtype, x_dtype) -> int:
    """VMEM of `block_matvec`: the pipeline's two [block, L, 128] weight buffers, x's values of
    two blocks, y twice and the f32 accumulator (L·128 wide)."""
    lines = channel_lines(n)
    total = MOSAIC_OWN_VMEM + 2 * vmem_buffer_bytes((block, lines, 128), weight_dtype)
    total += 2 * vmem_buffer_bytes((batch, block), x_dtype) + 2 * vmem_buffer_bytes((batch, lines * 128), x_dtype)
    total += vmem_buffer_bytes((batch, lines * 128), jnp.float32)
    if jnp.dtype(weight_dtype) == jnp.int8:
        total += 2 * vmem_buffer_bytes((1, lines * 128), jnp.float32)
    return total


def _block_matvec_kernel(ids_ref, xs_ref, *refs, steps, scaled):
    scale_ref = refs[0] if scaled else None
    w_ref, o_ref, acc_ref = refs[1:] if scaled else refs
    i = pl.program_id(0)

    @pl.when(i == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    xs = xs_ref[...]
    w = w_ref[...]
    acc_ref[...] += jnp.dot(xs, w.reshape(w.shape[0], w.shape[1] * w.shape[2]).astype(xs.dtype), preferred_element_type=jnp.float32)

    @pl.when(i == steps - 1)
    def _():
        finish(acc_ref, o_ref, scale_ref)


def block_matvec(
    x: jax.Array,
    rows: InputRows,
    block_ids: jax.Array,
    *,
    block: int,
    out_features: int,
    layer: int | jax.Array | None = None,
    interpret: bool | pltpu.InterpretParams = False,
    chip: str | None = None,
    vmem_limit_bytes: int | None = None,
) -> jax.Array:
    """y [B, n] = Σ_j x[:, block j's inputs] · W[block j]ᵀ over the blocks ``block_ids`` [nb]
    select (the same for every row; block j is inputs j·b … j·b + b − 1, W as `InputRows`
    [k, L, 128] with k a multiple of ``block`` = b, or a stack of layers [S, k, L, 128] read at
    ``layer``: the fetches offset into the stack, no layer copied out), under `selection`'s
    contract: an id out of [0, k/b) adds nothing, a repeat of the previous id counts once. Each
    grid step's [b, L, 128] block is fetched by a BlockSpec whose index map reads the
    scalar-prefetched ids (block-granular POP and dynamic selection), so the pipeline
    double-buffers whole contiguous blocks instead of issuing a DMA per row, and does not fetch a
    repeat again."""
    k, lines, values, scale, first = input_stack(rows, x, out_features, layer)
    check_block(block, k)
    if block_ids.ndim != 1 or block_ids.shape[0] < 1:
        raise ValueError(f"block_ids of shape {tuple(block_ids.shape)}: expected [nb] with nb >= 1 (one list for every row)")
    batch, width, steps = x.shape[0], lines * 128, block_ids.shape[0]
    raw, counted = counted_blocks(block_ids, k // block)
    ids = jnp.clip(raw, 0, k // block - 1)  # what the index map fetches: always a real block
    fetch = ids + first // block  # a stacked layer's blocks by offset
    # each block's inputs [nb, B, b], taken as whole blocks: an element-wise gather of their
    # positions costs XLA:TPU ~350 KB per block (its cost model), a block-row take a few KB
    xs = x.reshape(batch, k // block, block)[:, ids].transpose(1, 0, 2) * counted[:, None, None].astype(x.dtype)
    est = block_matvec_vmem_bytes(batch, block, out_features, rows.values.dtype, x.dtype)
    limit = vmem_limit_bytes or vmem_limit(est, chip, f"block_matvec (B={batch}, b={block}, n={out_features}, {rows.values.dtype})", bool(interpret))

    scaled = scale is not None
    in_specs = [pl.BlockSpec((None, batch, block), lambda i, ids: (i, 0, 0))]
    args = [xs]
    if scaled:
        in_specs.append(pl.BlockSpec((1, width), lambda i, ids: (0, 0)))
        args.append(scale)
    in_specs.append(pl.BlockSpec((block, lines, 128), lambda i, ids: (ids[i], 0, 0)))
    args.append(in_hbm(values, interpret))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(steps,),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((batch, width), lambda i, ids: (0, 0)),
        scratch_shapes=[pltpu.VMEM((batch, width), jnp.float32)],
    )
    traffic = block_matvec_bytes(steps, steps, block, out_features, batch, rows.values.dtype, x.dtype)
    y = pl.pallas_call(
        functools.partial(_block_matvec_kernel, steps=steps, scaled=scaled),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((batch, width), x.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",), vmem_limit_bytes=limit),
        cost_estimate=pl.CostEstimate(flops=2 * batch * width * block * steps, transcendentals=0, bytes_accessed=traffic),
        interpret=interpret,
        name="block_matvec",
    )(fetch, *args)
    return y[:, :out_features]


# Mosaic's scratch for converting int8 rows to x's dtype in `gather_row_dots` (bisected, libtpu
# 0.0.42, v5e, chunk 128: the smallest limit that compiles exceeds the buffers by up to 534 KiB
# for int8, of which MOSAIC_OWN_VMEM covers 256; bf16 needs none)
_INT8_CONVERT_VMEM = 512 << 10


def row_dots_vmem_bytes(batch: int, chunk: int, d: int, weight_dtype, x_dtype) -> int:
    """VMEM of `gather_row_dots`: the two-slot row scratch, x twice (L·128 wide), two f32
    output blocks [B, chunk] and, for int8 rows, Mosaic's conversion scratch."""
    lines = channel_lines(d)
    total = MOSAIC_OWN_VMEM + vmem_buffer_bytes((2, chunk, lines, 128), weight_dtype)
    total += _INT8_CONVERT_VMEM if jnp.dtype(weight_dtype) == jnp.int8 else 0
    return total + 2 * vmem_buffer_bytes((batch, lines * 128), x_dtype) + 2 * vmem_buffer_bytes((batch, chunk), jnp.float32)


def _row_dots_kernel(ids_ref, keep_ref, first_ref, *refs, chunk, steps, scaled):
    scale_ref = refs[0] if scaled else None  # every row's scale [n], in SMEM
    x_ref, rows_hbm, o_ref, buf, sems = refs[1:] if scaled else refs
    c = pl.program_id(0)
    row = lambda i: rows_hbm.at[first_ref[0] + i]  # noqa: E731 (held rows: the layer's offset in the stack)
    slot = fetch_rows(ids_ref, keep_ref, sems, chunk, steps, [(row, lambda s, r: buf.at[s, r])])
    x = x_ref[...]
    w = buf[slot].reshape(chunk, buf.shape[2] * buf.shape[3]).astype(x.dtype)
    u = lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    if scaled:  # the chunk's scales as a [1, chunk] vector, one scalar read per row (no XLA gather)
        lane = lax.broadcasted_iota(jnp.int32, (1, chunk), 1)

        def put(r, vec):
            return jnp.where(lane == r, scale_ref[ids_ref[c * chunk + r]], vec)

        u = u * lax.fori_loop(0, chunk, put, jnp.zeros((1, chunk), jnp.float32))
    o_ref[...] = u


def gather_row_dots(
    x: jax.Array,
    rows: OutputRows,
    ids: jax.Array,
    *,
    count: int | jax.Array | None = None,
    chunk: int = 128,
    interpret: bool | pltpu.InterpretParams = False,
    chip: str | None = None,
    vmem_limit_bytes: int | None = None,
) -> jax.Array:
    """u [B, m] f32 = x · W[ids]ᵀ for x [B, d] and W as `OutputRows` [n, L, 128], ids [m]
    (`selection`'s contract: a position not selected, out of range or repeating the previous
    id gives 0), reading only the rows of the selected ids, one DMA each; int8 rows times their
    scales (read from SMEM in the kernel). ``chunk`` rows per grid step (128: each step's output block fills the lanes)."""
    n, values, row_scale, first = output_stack(rows, x)
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be a positive number of rows per step")
    if ids.ndim != 1:
        raise ValueError(f"ids of shape {tuple(ids.shape)}: expected [m], one list for every row")
    sel = select_channels(ids, n, x.shape[0], count)
    m, batch, (lines, width) = ids.shape[0], x.shape[0], (values.shape[1], values.shape[1] * 128)
    steps = -(-m // chunk)
    pad = steps * chunk - m
    est = row_dots_vmem_bytes(batch, chunk, x.shape[1], rows.values.dtype, x.dtype)
    limit = vmem_limit_bytes or vmem_limit(est, chip, f"gather_row_dots (B={batch}, chunk={chunk}, d={x.shape[1]}, {rows.values.dtype})", bool(interpret))
    fetch, keep = jnp.pad(sel.ids, (0, pad), mode="edge"), jnp.pad(sel.keep, (0, pad))
    scaled = row_scale is not None
    # the DMAs read held rows at their layer's offset ``first``; the scales are the layer's own [n]
    scalars = (fetch, keep, jnp.reshape(first, (1,)).astype(jnp.int32)) + ((row_scale,) if scaled else ())
    fixed = lambda i, *scalars: (0, 0)  # noqa: E731
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars),
        grid=(steps,),
        in_specs=[pl.BlockSpec((batch, width), fixed), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((None, batch, chunk), lambda i, *scalars: (i, 0, 0)),
        scratch_shapes=[pltpu.VMEM((2, chunk, lines, 128), values.dtype), pltpu.SemaphoreType.DMA((2,))],
    )
    traffic = gather_row_dots_bytes(m, m, chunk, x.shape[1], batch, values.dtype, x.dtype, n)
    u = pl.pallas_call(
        functools.partial(_row_dots_kernel, chunk=chunk, steps=steps, scaled=scaled),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((steps, batch, chunk), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",), vmem_limit_bytes=limit),
        cost_estimate=pl.CostEstimate(flops=2 * batch * width * m, transcendentals=0, bytes_accessed=traffic),
        interpret=interpret,
        name="gather_row_dots",
    )(*scalars, jnp.pad(x, ((0, 0), (0, width - x.shape[1]))), in_hbm(values, interpret))
    return u.transpose(1, 0, 2).reshape(batch, steps * chunk)[:, :m]
