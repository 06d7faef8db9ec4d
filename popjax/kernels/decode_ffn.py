"""The decode-FFN kernel a resolved ``kernel`` names (`popjax.kernels.choose`, `RESOLVED`):
what a method's plan calls, so that the plan names no platform.

"pallas-tpu" runs the Mosaic kernels (`matvec_tpu`), "pallas-interpret" the same kernels in
Pallas' interpret mode (a CPU), "pallas-gpu" the Triton ones (`ffn_gpu`). `gather_matvec` reads
single rows (channel POP's selected candidates), `block_matvec` whole blocks of consecutive rows
(block POP's), `masked_matvec` the rows of a mask's active inputs (TEAL's), `gated_ffn` the up
and down rows of the channels a mask keeps, given their gate values (CATS's), `gather_row_dots`
single output rows (gate-scored and shortlisted POP's up rows of the candidates they score) and
`values_matvec` the rows of inputs whose values the step computed for them alone (their down rows),
and `block_ffn` gate, up and down of whole blocks of channels from a block slab (block static's).

On a mesh of several devices (the jit's abstract mesh) the kernel runs on every device under
``shard_map`` with every operand replicated: POP's candidate rows are held whole by each device
(`popjax.sharding.take_replicated`), so each device reads the m selected rows, as XLA's gather
of that replicated copy does, and holds the whole result. A Pallas call outside ``shard_map``
would leave XLA's partitioner to guess how to split an opaque custom call.

Each call builds its kernel alone first, at its operands' shapes (`run_tried`, `fallback.trial`): a
compiled kernel that does not build raises `fallback.KernelUnavailable` while the program is
traced, before XLA compiles it, which the layer that binds the method turns into XLA
(``kernel="auto"``) or a one-line error (``kernel="pallas"``; docs/kernels.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from . import RESOLVED, TPU_KERNELS, ffn_gpu, ffn_tpu, matvec_tpu
from .block_slab import BlockSlab
from .fallback import trial
from .ffn_layout import MAX_BATCH, ChannelRows, InputRows, OutputRows, check_block
from .selection import counted_blocks, union_of_rows


def gather_matvec(x: jax.Array, rows: InputRows, ids: jax.Array, *, out_features: int, kernel: str) -> jax.Array:
    """y [B, n] = W · x over x's inputs ``ids`` ([m] or [B, m]; `selection`'s
    contract) with W as `ffn_layout.InputRows` [k, L, 128], x [B, k], by the Pallas ``kernel``
    (one of `RESOLVED` but "xla"); ValueError naming any other value."""
    call = platform_call(kernel, ffn_gpu.gather_matvec, matvec_tpu.gather_matvec, out_features=out_features)
    return run_tried("gather_matvec", kernel, call, (x, rows, ids), out_features)


def values_matvec(values: jax.Array, rows: InputRows, ids: jax.Array, *, out_features: int, kernel: str) -> jax.Array:
    """y [B, n] = Σ_p values[:, p] · W[ids[p]] (values [B, m] given per position beside ids [m],
    W as `ffn_layout.InputRows` [k, L, 128]) by the Pallas ``kernel``: only the m rows are read."""
    call = platform_call(kernel, ffn_gpu.values_matvec, matvec_tpu.values_matvec, out_features=out_features)
    return run_tried("values_matvec", kernel, call, (values, rows, ids), out_features)


def gather_row_dots(x: jax.Array, rows: OutputRows, ids: jax.Array, *, kernel: str) -> jax.Array:
    """u [B, m] f32 = x · W[ids]ᵀ for x [B, d] and W as `ffn_layout.OutputRows` [n, L, 128],
    ids [m] (`selection`'s contract), by the Pallas ``kernel``: only the m rows are read."""
    return run_tried("gather_row_dots", kernel, platform_call(kernel, ffn_gpu.gather_row_dots, matvec_tpu.gather_row_dots), (x, rows, ids))


def platform_call(kernel: str, gpu, tpu, **kwargs):
    """The Pallas function a resolved ``kernel`` names, ``gpu`` (Triton) or ``tpu`` (Mosaic, or
    its interpret mode for "pallas-interpret"), with ``kwargs``; ValueError on "xla" or another
    value."""
    if kernel == "pallas-gpu":
        return functools.partial(gpu, **kwargs)
    if kernel in TPU_KERNELS:
        return functools.partial(tpu, interpret=kernel == "pallas-interpret", **kwargs)
    raise ValueError(f"kernel={kernel!r} is not a Pallas kernel; use one of {RESOLVED[1:]}")


def masked_matvec(x: jax.Array, rows: InputRows, active: jax.Array, *, out_features: int, layer, expected_active: int,
                  kernel: str) -> jax.Array:
    """y [B, n] = W · (x where ``active`` [B, k] or [k]) with W as `ffn_layout.InputRows`, one
    matrix [k, L, 128] or a stack of layers [S, k, L, 128] read at ``layer`` (TEAL's gate/up and
    down), by the Pallas ``kernel``: the rows of inputs no row keeps are not read.
    ``expected_active``: the inputs a call keeps at the method's target, for the TPU compiler's
    cost estimate (`matvec_tpu.masked_matvec`)."""
    if kernel == "pallas-gpu":
        call = lambda x, rows, active, layer: ffn_gpu.masked_matvec(x, rows, active, out_features=out_features, layer=layer)  # noqa: E731
    elif kernel in TPU_KERNELS:
        interpret = kernel == "pallas-interpret"

        def call(x, rows, active, layer):
            return matvec_tpu.masked_matvec(x, rows, active, out_features=out_features, layer=layer,
                                            expected_active=expected_active, interpret=interpret)
    else:
        raise ValueError(f"kernel={kernel!r} is not a Pallas kernel; use one of {RESOLVED[1:]}")
    args = (x, rows, active, None if layer is None else jnp.asarray(layer, jnp.int32))
    return run_tried("masked_matvec", kernel, _in_row_chunks(call), args, (out_features, expected_active))


def gated_ffn(x: jax.Array, rows: ChannelRows, active: jax.Array, gate: jax.Array, *, layer, act: str, expected_active: int,
              kernel: str) -> jax.Array:
    """y [B, d] = Σ_{j active} gate[:, j] · (W_u[j] · x) · W_d[:, j] for x [B, d], the gate
    values gate [B, f] (act(W_g x), computed densely before the call: CATS keeps a channel by
    them) and active [B, f] or [f]: from ``rows``, a stack of up/down rows [2, S, f, L, 128]
    (`ffn_layout.stacked_up_down_layout`) read at ``layer`` (one layer's [m, f, L, 128]:
    ``layer=None``), only the up and down rows of the
    channels some row keeps (their union; a row adds its own). ``expected_active``: the channels
    a call keeps at the method's target, for the TPU compiler's cost estimate."""
    def call(x, rows, active, layer, gate):
        # positions are the channels in order (as `masked_matvec`'s inputs), so the gate values
        # need no gather: a channel no row keeps has id −1 (no DMA), a row adds only its own
        mask = jnp.broadcast_to(active, gate.shape)
        ids = jnp.where(jnp.any(mask, axis=0), jnp.arange(gate.shape[-1], dtype=jnp.int32), -1)
        given = jnp.where(mask, gate, 0)
        if kernel == "pallas-gpu":
            return ffn_gpu.gather_ffn(x, rows, ids, act=act, gate=given, layer=layer)
        return ffn_tpu.gather_ffn(x, rows, ids, act=act, gate=given, layer=layer, expected_rows=expected_active,
                                  interpret=kernel == "pallas-interpret")

    if kernel not in ("pallas-gpu", *TPU_KERNELS):
        raise ValueError(f"kernel={kernel!r} is not a Pallas kernel; use one of {RESOLVED[1:]}")
    args = (x, rows, active, None if layer is None else jnp.asarray(layer, jnp.int32), gate)
    return run_tried("gather_ffn", kernel, _in_row_chunks(call), args, (act, expected_active))


def block_ffn(x: jax.Array, slab: BlockSlab, blocks: jax.Array, *, layer, act: str, kernel: str) -> jax.Array:
    """y [B, d] = the FFN of x [B, d] over whole blocks of channels of ``slab``
    (`block_slab.BlockSlab`: one [nb, 3, b, d], or a stack read at ``layer``) by the Pallas
    ``kernel``: ``blocks`` [k] (every row's) or [B, k] (each row its own, served as their
    union with a per-row mask: a block two rows chose is fetched once)."""
    run = platform_call(kernel, ffn_gpu.block_ffn, ffn_tpu.block_ffn, act=act)

    def call(x, slab, blocks, layer):
        if blocks.ndim == 1:
            return run(x, slab, blocks, layer=layer)
        rows = jnp.arange(x.shape[0])[:, None]
        row_mask = jnp.zeros((x.shape[0], slab.values.shape[-4]), bool).at[rows, blocks].set(True)
        ids, count = union_of_rows(row_mask, min(row_mask.shape[1], blocks.size))
        return run(x, slab, ids, row_mask, count=count, layer=layer)

    args = (x, slab, blocks, None if layer is None else jnp.asarray(layer, jnp.int32))
    return run_tried("block_ffn", kernel, _in_row_chunks(call), args, act)


def _in_row_chunks(call):
    """``call(x [B, k], rows, active [B, k] or [k], layer, *per_row)`` for any B (``per_row``:
    more [B, ...] operands): a batch above the kernels' `ffn_layout.MAX_BATCH` rows runs as
    consecutive calls of at most that many rows (padded rows masked out; each call reads its own
    union of kept rows)."""
    def chunked(x, rows, active, layer, *per_row):
        batch = x.shape[0]
        if batch <= MAX_BATCH:
            return call(x, rows, active, layer, *per_row)
        n = -(-batch // MAX_BATCH)
        pad = n * MAX_BATCH - batch

        def split(a):
            return jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1)).reshape(n, MAX_BATCH, *a.shape[1:])

        parts = tuple(split(a) for a in (x, jnp.broadcast_to(active, x.shape[:1] + active.shape[-1:]), *per_row))
        ys = jax.lax.map(lambda xm: call(xm[0], rows, xm[1], layer, *xm[2:]), parts)
        return ys.reshape(n * MAX_BATCH, -1)[:batch]

    return chunked


def block_matvec(x: jax.Array, rows: InputRows, block_ids: jax.Array, *, block: int, out_features: int, layer=None,
                 kernel: str) -> jax.Array:
    """y [B, n] = W · x over x's inputs in the blocks ``block_ids`` [nb] of ``block`` consecutive
    rows (`matvec_tpu.block_matvec`'s contract; ``rows`` one matrix, or a stack of layers read
    at ``layer``) by the Pallas ``kernel``: on TPU the BlockSpec pipeline fetches each block
    whole; on a GPU the Triton matvec reads the blocks' rows (each block contiguous) through
    their positions, a block the contract does not count (out of range, a repeat of the previous
    one) given positions out of range, which add nothing."""
    if kernel == "pallas-gpu":
        def call(x, rows, block_ids, layer):
            positions = block_positions(block_ids, block, rows.values.shape[-3])
            return ffn_gpu.gather_matvec(x, rows, positions, out_features=out_features, layer=layer)
    elif kernel in TPU_KERNELS:
        def call(x, rows, ids, layer):
            return matvec_tpu.block_matvec(x, rows, ids, block=block, out_features=out_features, layer=layer,
                                           interpret=kernel == "pallas-interpret")
    else:
        raise ValueError(f"kernel={kernel!r} is not a Pallas kernel; use one of {RESOLVED[1:]}")
    args = (x, rows, block_ids, None if layer is None else jnp.asarray(layer, jnp.int32))
    return run_tried("block_matvec", kernel, call, args, (block, out_features))


def block_positions(block_ids: jax.Array, block: int, rows: int) -> jax.Array:
    """The input rows [nb·b] of the blocks ``block_ids`` [nb] under `block_matvec`'s contract, as
    single-row ids for `gather_matvec`, which drops an id out of [0, rows): a counted block j's
    rows j·b … j·b + b − 1, and ids below 0 for a block the contract does not count (out of
    range, or a repeat of the previous id: `selection.counted_blocks`)."""
    check_block(block, rows)
    raw, counted = counted_blocks(block_ids, rows // block)
    first = jnp.where(counted, raw * block, -rows - block)  # a block not counted: ids below 0
    return (first[:, None] + jnp.arange(block, dtype=jnp.int32)).reshape(-1)


def run_tried(name: str, kernel: str, call, args: tuple, static=()) -> jax.Array:
    """``call(*args)`` on every device (`per_device`), first built alone at these shapes, as it
    runs (under ``shard_map`` on a mesh of several devices: `fallback.trial`, which raises
    `fallback.KernelUnavailable` when it does not build; ``static``: what else ``call`` closes
    over that changes the kernel)."""
    run_here = per_device(call)
    trial(name, kernel, run_here, args, static)
    return run_here(*args)


def per_device(call):
    """``call`` as is without a mesh (or on one device); on a mesh of several, run by every device
    on its replicated operands (``shard_map``, replicated in and out: the module docstring)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return call
    return jax.shard_map(call, in_specs=PartitionSpec(), out_specs=PartitionSpec(), check_vma=False)
