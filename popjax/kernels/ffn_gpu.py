"""Pallas GPU (Triton backend) kernels for a decode step's pruned FFN over x [B, d] (B 1–64):
the same `block_ffn` and `gather_ffn` as `ffn_tpu`, and `gather_matvec` and `masked_matvec` as
`matvec_tpu`, on the same layouts and selections.

A GPU loads rows through indexed loads (``ref[ids[:, None], cols[None, :]]``, as jax's
``pallas/ops/gpu/paged_attention.py`` and TEAL's ``kernels/sparse_gemv.py`` do), so both
kernels run one pair of Triton kernels on a list of weight rows per position:

1. gate/up: a program per chunk of ``chunk`` positions loads their gate and up rows tile by
   tile over d, and writes h = act(gate · x) ⊙ (up · x) ⊙ mask [B, chunk] (f32);
2. down: a program per (d tile, split) adds h · down rows over its share of the chunks and
   writes a f32 partial [B, d tile]; the ``splits`` partials are summed after the call.

Split-K partials instead of TEAL's ``atomic_add`` keep the sum deterministic and any dtype (the
paper's anchors are fp16-only for that reason). Positions a selection does not keep are masked
in the loads, so they move no bytes. Lowered for CUDA with ``jax.jit(f).trace(...).lower(
lowering_platforms=("cuda",))``; ``interpret=True`` runs them on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .block_slab import BlockSlab, check_slab, slab_view
from .chips import gpu_spec
from .ffn_layout import (
    ChannelRows,
    InputRows,
    OutputRows,
    activation,
    check_channel_rows,
    check_gate,
    input_stack,
    masked_selection,
    output_stack,
    stack_view,
    values_stack,
)
from .selection import select_blocks, select_channels
from .triton_offsets import check_offsets

CHUNK = 32  # positions per gate/up program (the K of the down dot: Triton wants >= 16)
D_TILE = 128  # columns per load and per down program
PROGRAMS_PER_SM = 2  # down programs per streaming multiprocessor: enough to fill the GPU (`chips.gpu_spec`)
STAGES = 2  # Triton's software-pipelining stages: each stages one tile of x and of the weight rows


def target_programs(interpret: bool) -> int:
    """How many down programs a call aims for: two per SM of the GPU traced for (`chips`: 264 on
    an H100 or H200, 216 on an A100; an H100's in interpret mode)."""
    return PROGRAMS_PER_SM * gpu_spec(interpret).sms


def program_smem_bytes(batch: int, x_dtype, w_dtype) -> int:
    """Shared memory one gate/up program stages, an upper bound: `STAGES` copies of an x tile
    [M, D_TILE] (M = batch padded to a power of two ≥ 16: Triton's dot) and of the gate and up
    rows' tiles [CHUNK, D_TILE] (the down program stages less: one weight tile, h's)."""
    rows = max(16, _pow2(batch))
    per_stage = rows * D_TILE * jnp.dtype(x_dtype).itemsize + 2 * CHUNK * D_TILE * jnp.dtype(w_dtype).itemsize
    return STAGES * per_stage


def check_smem(batch: int, x_dtype, w_dtype, interpret: bool) -> None:
    """ValueError in one line when a program's staged tiles (`program_smem_bytes`) exceed what one
    thread block of the GPU may use (`chips.gpu_spec`): Triton would refuse it at compile."""
    spec, need = gpu_spec(interpret), program_smem_bytes(batch, x_dtype, w_dtype)
    if need > spec.smem_per_block:
        raise ValueError(f"the Triton FFN kernels at batch {batch} ({jnp.dtype(x_dtype)} x, {jnp.dtype(w_dtype)} rows) stage "
                         f"{need / 1024:.0f} KiB of shared memory per program, over {spec.name}'s "
                         f"{spec.smem_per_block / 1024:.0f} KiB per block; use a smaller batch")


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _gate_up_kernel(x_ref, w_ref, gid_ref, uid_ref, keep_ref, mask_ref, *refs, act, batch, d, chunk, d_tile, int8, gated):
    gs_ref, h_ref = refs if int8 else (None, refs[0])
    pos = pl.program_id(0) * chunk + jnp.arange(chunk)
    gid, uid, keep = gid_ref[pos], uid_ref[pos], keep_ref[pos] == 1
    rows = jnp.arange(max(16, _pow2(batch)))  # Triton's dot wants M >= 16
    live = rows < batch
    row_ix = jnp.minimum(rows, batch - 1)

    def tile(k, carry):
        g, u = carry
        cols = k * d_tile + jnp.arange(d_tile)
        in_d = cols < d
        cols = jnp.minimum(cols, d - 1)
        xs = plgpu.load(x_ref.at[row_ix[:, None], cols[None, :]], mask=live[:, None] & in_d[None, :], other=0)
        use = keep[:, None] & in_d[None, :]
        exact = xs.dtype == jnp.float32
        if not gated:  # given gate values (in the mask): no gate row is loaded
            gw = plgpu.load(w_ref.at[gid[:, None], cols[None, :]], mask=use, other=0).astype(xs.dtype)
            g += plgpu.dot(xs, gw, trans_b=True, allow_tf32=not exact)
        uw = plgpu.load(w_ref.at[uid[:, None], cols[None, :]], mask=use, other=0).astype(xs.dtype)
        u += plgpu.dot(xs, uw, trans_b=True, allow_tf32=not exact)
        return g, u

    zero = jnp.zeros((rows.shape[0], chunk), jnp.float32)
    g, u = lax.fori_loop(0, pl.cdiv(d, d_tile), tile, (zero, zero))
    if int8:  # gate_up_scale [2, U] (gate's, up's), or [1, U] (up's) when the gate values are given
        g = g if gated else g * gs_ref[0, pos][None, :]
        u = u * gs_ref[gs_ref.shape[0] - 1, pos][None, :]
    mask = plgpu.load(mask_ref.at[row_ix[:, None], pos[None, :]], mask=live[:, None], other=0)
    h = u * mask if gated else act(g) * u * mask
    # Stores index with the unclamped rows: masked lanes must not alias a live one (the CPU
    # interpreter writes a masked lane's old value back, in no particular order).
    plgpu.store(h_ref.at[rows[:, None], pos[None, :]], h, mask=live[:, None])


def _down_kernel(h_ref, w_ref, did_ref, keep_ref, part_ref, *, batch, d, chunk, d_tile, chunks, splits, dtype):
    j, s = pl.program_id(0), pl.program_id(1)
    out_cols = j * d_tile + jnp.arange(d_tile)
    in_d = out_cols < d
    cols = jnp.minimum(out_cols, d - 1)
    rows = jnp.arange(max(16, _pow2(batch)))
    live = rows < batch
    row_ix = jnp.minimum(rows, batch - 1)

    def step(t, acc):
        pos = (s + t * splits) * chunk + jnp.arange(chunk)
        keep = keep_ref[pos] == 1
        h = plgpu.load(h_ref.at[row_ix[:, None], pos[None, :]], mask=live[:, None], other=0).astype(dtype)
        w = plgpu.load(w_ref.at[did_ref[pos][:, None], cols[None, :]], mask=keep[:, None] & in_d[None, :], other=0)
        return acc + plgpu.dot(h, w.astype(dtype), allow_tf32=dtype != jnp.float32)

    acc = lax.fori_loop(0, pl.cdiv(chunks - s, splits), step, jnp.zeros((rows.shape[0], d_tile), jnp.float32))
    plgpu.store(part_ref.at[s, rows[:, None], out_cols[None, :]], acc, mask=live[:, None] & in_d[None, :])


def rows_ffn(
    x: jax.Array,
    weights: jax.Array,
    row_ids: jax.Array,
    keep: jax.Array,
    mask: jax.Array | None,
    gate_up_scale: jax.Array | None = None,
    down_scale: jax.Array | None = None,
    *,
    act: str = "silu",
    gated: bool = False,
    interpret: bool = False,
    splits: int | None = None,
) -> jax.Array:
    """The FFN over a list of weight rows: x [B, d]; weights [R, ≥d] (float or int8); row_ids
    [3, U] int32 (the gate, up and down row of each position); keep [U] int32; mask [U, B]
    fp32 or None; int8 scales gate_up_scale [2, U] ([1, U], up's, when ``gated``) and down_scale [1, ≥d]. -> y [B, d].
    ``gated``: the mask holds the gate values (h = (up · x) ⊙ mask); no gate row is loaded."""
    batch, d = x.shape
    act_fn = activation(act)
    n = keep.shape[0]
    chunks = -(-n // CHUNK)
    pad = chunks * CHUNK - n
    mask = keep[:, None].astype(jnp.float32) if mask is None else mask
    mask = jnp.pad(jnp.broadcast_to(mask, (n, batch)), ((0, pad), (0, 0))).T  # [B, U]
    row_ids = jnp.pad(row_ids, ((0, 0), (0, pad)), mode="edge")
    keep = jnp.pad(keep, (0, pad))
    int8 = gate_up_scale is not None
    d_tiles = -(-d // D_TILE)
    splits = splits or max(1, min(chunks, -(-target_programs(interpret) // d_tiles)))
    params = plgpu.CompilerParams(num_warps=4, num_stages=2)
    if not interpret:
        check_offsets("down_rows", weights=weights)
    h = _gate_up_rows(x, weights, row_ids[0], row_ids[1], keep, mask, gate_up_scale, act=act_fn, gated=gated, interpret=interpret)
    parts = pl.pallas_call(
        functools.partial(
            _down_kernel, batch=batch, d=d, chunk=CHUNK, d_tile=D_TILE, chunks=chunks, splits=splits, dtype=x.dtype
        ),
        grid=(d_tiles, splits),
        out_shape=jax.ShapeDtypeStruct((splits, batch, d), jnp.float32),
        compiler_params=params,
        interpret=interpret,
        name="down_rows",
    )(h, weights, row_ids[2], keep)
    y = parts.sum(axis=0)
    if int8:
        y = y * down_scale[:, :d]
    return y.astype(x.dtype)


def _gate_up_rows(x, weights, gate_ids, up_ids, keep, mask, scale, *, act, gated, interpret):
    """`rows_ffn`'s first kernel: h [B, U] (f32) over positions padded to the chunk: ids, keep
    [U] and mask [B, U] padded already; scale [2 or 1, U'] (int8) or None, padded here."""
    batch, d = x.shape
    check_smem(batch, x.dtype, weights.dtype, interpret)
    if not interpret:  # compiled Triton only: interpret mode indexes through XLA, in 64 bits
        check_offsets("gate_up_rows", weights=weights, x=x, mask=mask)
    chunks = keep.shape[0] // CHUNK
    extra = [jnp.pad(scale, ((0, 0), (0, chunks * CHUNK - scale.shape[1])))] if scale is not None else []
    return pl.pallas_call(
        functools.partial(_gate_up_kernel, act=act, batch=batch, d=d, chunk=CHUNK, d_tile=D_TILE, int8=scale is not None, gated=gated),
        grid=(chunks,),
        out_shape=jax.ShapeDtypeStruct((batch, chunks * CHUNK), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="gate_up_rows",
    )(x, weights, gate_ids, up_ids, keep, mask, *extra)


def gather_row_dots(x: jax.Array, rows: OutputRows, ids: jax.Array, *, count: int | jax.Array | None = None,
                    interpret: bool = False) -> jax.Array:
    """`matvec_tpu.gather_row_dots` on a GPU: u [B, m] f32 = x · W[ids]ᵀ, W as `OutputRows`
    [n, L, 128]: the gate/up kernel of `rows_ffn` given unit gate values, loading only the
    selected rows' first d columns (int8: times the rows' scales)."""
    n, values, row_scale, first = output_stack(rows, x)
    if ids.ndim != 1:
        raise ValueError(f"ids of shape {tuple(ids.shape)}: expected [m], one list for every row")
    sel = select_channels(ids, n, x.shape[0], count)
    m = ids.shape[0]
    pad = -(-m // CHUNK) * CHUNK - m
    fetch, keep = jnp.pad(sel.ids + first, (0, pad), mode="edge"), jnp.pad(sel.keep, (0, pad))
    mask = jnp.broadcast_to(keep.astype(jnp.float32)[None], (x.shape[0], keep.shape[0]))
    scale = None if row_scale is None else row_scale[sel.ids][None]
    flat = values.reshape(values.shape[0], -1)
    u = _gate_up_rows(x, flat, fetch, fetch, keep, mask, scale, act=None, gated=True, interpret=interpret)
    return u[:, :m]


def block_ffn(
    x: jax.Array,
    slab: BlockSlab,
    block_ids: jax.Array,
    row_mask: jax.Array | None = None,
    *,
    count: int | jax.Array | None = None,
    act: str = "silu",
    layer: jax.Array | int | None = None,
    interpret: bool = False,
    splits: int | None = None,
) -> jax.Array:
    """`ffn_tpu.block_ffn` on a GPU: x [B, d], slab values [nb, 3, b, d] (or a stack
    [S, nb, 3, b, d] read at ``layer``), block_ids [n] (+ count, + row_mask [B, nb]) -> y [B, d]."""
    nb, b, d = check_slab(slab, x, act, layer)
    sel = select_blocks(block_ids, nb, x.shape[0], count, row_mask)
    slab, first = slab_view(slab, layer)
    fetch = sel.ids + first
    base = fetch[:, None] * 3 * b + jnp.arange(b)[None, :]  # the gate row of each channel
    row_ids = jnp.stack([(base + k * b).reshape(-1) for k in range(3)])
    keep = jnp.repeat(sel.keep, b)
    mask = None if sel.mask is None else jnp.repeat(sel.mask, b, axis=0)
    gus = None if slab.gate_up_scale is None else slab.gate_up_scale[fetch].transpose(1, 0, 2).reshape(2, -1)
    flat = slab.values.reshape(-1, d)
    return rows_ffn(x, flat, row_ids, keep, mask, gus, slab.down_scale, act=act, interpret=interpret, splits=splits)


def gather_ffn(
    x: jax.Array,
    rows: ChannelRows,
    ids: jax.Array,
    *,
    count: int | jax.Array | None = None,
    act: str = "silu",
    gate: jax.Array | None = None,
    layer: jax.Array | int | None = None,
    interpret: bool = False,
    splits: int | None = None,
) -> jax.Array:
    """`ffn_tpu.gather_ffn` on a GPU: x [B, d], rows values [m, (S,) f, L, 128], ids [m] or
    [B, m] (+ count, + the given ``gate`` [B, m] beside ids [m], + ``layer`` of a stack) ->
    y [B, d]. The columns past d are never loaded."""
    f, lines, layers = check_channel_rows(rows, x, act, gated=gate is not None, layer=layer)
    batch = x.shape[0]
    check_gate(gate, ids, batch)
    sel = select_channels(ids, f, batch, count)
    values, gus, down_scale, offset = stack_view(rows, layer, layers)
    m, n_all = values.shape[0], values.shape[1]
    fetch = sel.ids + offset
    # the gate, up and down row of each position; given gate values, the "gate" row is up's, never loaded
    kinds = (m - 2, m - 2, m - 1) if gate is not None else (0, 1, 2)
    row_ids = jnp.stack([fetch + k * n_all for k in kinds])
    mask = sel.mask
    if gate is not None:
        mask = jnp.broadcast_to(sel.keep[:, None].astype(jnp.float32) if mask is None else mask, (sel.ids.shape[0], batch))
        mask = mask * gate.astype(jnp.float32).T
        gus = None if gus is None else gus[-1:]  # up's
    gus = None if gus is None else gus[:, fetch]
    flat = values.reshape(m * n_all, lines * 128)
    return rows_ffn(x, flat, row_ids, sel.keep, mask, gus, down_scale, act=act, gated=gate is not None, interpret=interpret,
                    splits=splits)


def gather_matvec(
    x: jax.Array,
    rows: InputRows,
    ids: jax.Array,
    *,
    out_features: int,
    count: int | jax.Array | None = None,
    layer: int | jax.Array | None = None,
    interpret: bool = False,
    splits: int | None = None,
) -> jax.Array:
    """`matvec_tpu.gather_matvec` on a GPU: y [B, n] = W · x over x's inputs ``ids`` ([m] or
    [B, m], + count), W as `InputRows` [k, L, 128], or a stack of layers [S, k, L, 128] read at
    ``layer`` (the loads offset into it). The down kernel of `rows_ffn` with x's values at the
    positions in place of h."""
    k, lines, values, scale, first = input_stack(rows, x, out_features, layer)
    sel = select_channels(ids, k, x.shape[0], count)
    mask = sel.keep[:, None].astype(jnp.float32) if sel.mask is None else sel.mask
    xs = x[:, sel.ids].astype(jnp.float32) * mask.T  # [B, U]
    return _rows_matvec(xs, values.reshape(-1, lines * 128), sel.ids + first, sel.keep, scale,
                        out_features=out_features, dtype=x.dtype, interpret=interpret, splits=splits)


def values_matvec(values: jax.Array, rows: InputRows, ids: jax.Array, *, out_features: int, interpret: bool = False,
                  splits: int | None = None) -> jax.Array:
    """`matvec_tpu.values_matvec` on a GPU: y [B, n] = Σ_p values[:, p] · W[ids[p]], values [B, m]
    beside ids [m], W as `InputRows` [k, L, 128] (or held rows, read by offset): the down kernel of
    `rows_ffn`."""
    k, lines, weights, scale, first = values_stack(values, rows, ids, out_features)
    sel = select_channels(ids, k, values.shape[0])
    xs = values.astype(jnp.float32) * sel.keep[None, :].astype(jnp.float32)
    return _rows_matvec(xs, weights.reshape(-1, lines * 128), sel.ids + first, sel.keep, scale,
                        out_features=out_features, dtype=values.dtype, interpret=interpret, splits=splits)


def masked_matvec(
    x: jax.Array,
    rows: InputRows,
    active: jax.Array,
    *,
    out_features: int,
    layer: int | jax.Array | None = None,
    interpret: bool = False,
    splits: int | None = None,
) -> jax.Array:
    """`matvec_tpu.masked_matvec` on a GPU: y [B, n] = W · (x where ``active``), rows [k, L, 128]
    or a stack [S, k, L, 128] read at ``layer``; the rows of inputs no row keeps are not loaded."""
    sel = masked_selection(rows, x, active, out_features, layer)
    flat = sel.values.reshape(sel.values.shape[0], -1)
    return _rows_matvec(sel.xs.T.astype(jnp.float32), flat, sel.ids, sel.keep, sel.scale,
                        out_features=out_features, dtype=x.dtype, interpret=interpret, splits=splits)


def _rows_matvec(xs, flat, ids, keep, scale, *, out_features, dtype, interpret, splits):
    """The down kernel of `rows_ffn` over input rows: position p adds xs[:, p] ([B, n] f32) times
    row ids[p] of flat [K, ≥out_features] where keep[p] == 1 (not loaded otherwise)."""
    batch, n = xs.shape
    chunks = -(-n // CHUNK)
    pad = chunks * CHUNK - n
    xs = jnp.pad(xs, ((0, 0), (0, pad)))
    d_tiles = -(-out_features // D_TILE)
    splits = splits or max(1, min(chunks, -(-target_programs(interpret) // d_tiles)))
    if not interpret:
        check_offsets("input_rows", weights=flat, xs=xs)
    kernel = functools.partial(
        _down_kernel, batch=batch, d=out_features, chunk=CHUNK, d_tile=D_TILE, chunks=chunks, splits=splits, dtype=dtype
    )
    parts = pl.pallas_call(
        kernel,
        grid=(d_tiles, splits),
        out_shape=jax.ShapeDtypeStruct((splits, batch, out_features), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="input_rows",
    )(xs, flat, jnp.pad(ids, (0, pad), mode="edge"), jnp.pad(keep, (0, pad)))
    y = parts.sum(axis=0)
    if scale is not None:
        y = y * scale[:, :out_features]
    return y.astype(dtype)
