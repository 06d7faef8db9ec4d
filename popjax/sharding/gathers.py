"""Channel gathers that stay local to a mesh's channel shards: compact copies of FFN channels
that lie anywhere in f (static, global POP), split over ``model`` like the weight they come from
(local gathers and one reduce-scatter; never a gathered weight)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from ..kernels import target_backend
from ..kernels.int8 import Int8Weight
from .mesh import active_mesh_axes
from .rules import RULES

# An id no device owns: gathers of it give zero rows (padding of split compact copies).
UNOWNED = -(2**30)


def split_channels() -> int:
    """How many ways a compact copy is split along its channel axis: the active mesh's ``mlp``
    axis size (FFN channels over ``model``), 1 without a mesh."""
    return active_mesh_axes().get(RULES["mlp"], 1)


def take_split(w: jax.Array, ids: jax.Array, axis: int) -> jax.Array:
    """``jnp.take(w, ids, axis)`` whose result is split over the ``mlp`` mesh axis along ``axis``,
    as ``w`` is, without ever gathering ``w``: each device takes the ids that fall in its own
    block of ``w`` (zeros for the others), and one reduce-scatter sums those partial copies, so
    each device keeps 1/n of the result. What static and global-partition POP copy at prefill:
    their kept channels lie anywhere in f, and XLA cannot keep a gather with prompt-dependent
    ids local to the channel shards (it replicates ``w``; docs/scale_out.md).

    w [..., F, ...] split in contiguous blocks along ``axis``; ids [k] (k a multiple of n; ids
    ``UNOWNED`` give zero rows) -> [..., k, ...]. Without a mesh (or n = 1): ``jnp.take``."""
    n = split_channels()
    if isinstance(w, Int8Weight):  # the int8 rows and, where it varies along ``axis``, their scales
        return w.along(axis, lambda a, ax: take_split(a, ids, ax))
    if n == 1:  # UNOWNED ids (padding) take zero rows
        return jnp.take(w, ids, axis=axis, mode="fill", fill_value=0)
    if w.shape[axis] % n or ids.shape[-1] % n:
        raise ValueError(f"take_split: axis {axis} of shape {w.shape} and {ids.shape[-1]} ids must divide by {n}")
    spec = PartitionSpec(*[RULES["mlp"] if i == axis else None for i in range(w.ndim)])
    local = lambda w_block, ids: jax.lax.psum_scatter(_owned_rows(w_block, ids, axis), RULES["mlp"],  # noqa: E731
                                                      scatter_dimension=axis, tiled=True)
    return jax.shard_map(local, in_specs=(spec, PartitionSpec()), out_specs=spec)(w, ids)


def _owned_rows(w_block: jax.Array, ids: jax.Array, axis: int) -> jax.Array:
    """Inside a shard_map over ``mlp``: the rows ``ids`` (global positions along ``axis``) that
    fall in this device's block of the weight, zeros for the others."""
    block = w_block.shape[axis]
    position = ids - jax.lax.axis_index(RULES["mlp"]) * block
    mine = (position >= 0) & (position < block)
    rows = jnp.take(w_block, jnp.clip(position, 0, block - 1), axis=axis)
    return jnp.where(jnp.expand_dims(mine, tuple(i for i in range(w_block.ndim) if i != axis)), rows, 0)


def take_replicated(w: jax.Array, ids: jax.Array, axis: int) -> jax.Array:
    """``jnp.take(w, ids, axis)`` held whole by every device, with ``w`` split over the ``mlp``
    mesh axis along ``axis``: each device takes the ids in its own block (zeros for the others)
    and one all-reduce sums the partial copies. The candidate rows a POP step gathers from
    (replicated, [n_C, ...]): a batched (per-sequence) ``jnp.take`` of a split weight makes
    XLA all-gather the weight instead. Without a mesh: ``jnp.take``."""
    n = split_channels()
    if isinstance(w, Int8Weight):
        return w.along(axis, lambda a, ax: take_replicated(a, ids, ax))
    if n == 1 or w.shape[axis] % n:
        return jnp.take(w, ids, axis=axis, mode="clip")
    spec = PartitionSpec(*[RULES["mlp"] if i == axis else None for i in range(w.ndim)])
    local = lambda w_block, ids: jax.lax.psum(_owned_rows(w_block, ids, axis), RULES["mlp"])  # noqa: E731
    return jax.shard_map(local, in_specs=(spec, PartitionSpec()), out_specs=PartitionSpec())(w, ids)


def take_split_rows(w: jax.Array, ids: jax.Array) -> jax.Array:
    """Rows of ``w`` [P, F, ...] read as its [P·F, ...] matrix, ids ``p·F + c`` [k] (k a multiple
    of n; negative ids give zero rows) -> [k, ...] split over the ``mlp`` mesh axis along rows,
    with ``w`` split along F: `take_split` for a block mixing parts, e.g. the gate rows of one
    channel set with the up rows of another out of ``gate_up`` [2, f, d] (gate-scored POP).
    Without a mesh: a gather from the free [P·F, ...] reshape. On a mesh: `take_split` of every
    part of the ids' channels (P× the rows, at prefill), then each row's part, elementwise."""
    P, F = w.shape[:2]
    if isinstance(w, Int8Weight):  # a scale per row: gathered like its row
        # ``like`` keeps how the weight reads its activations (int8 or float) and its compute dtype
        return w.like(take_split_rows(w.values, ids), take_split_rows(w.scale, ids))
    if split_channels() == 1:  # negative ids (padding) take zero rows
        return jnp.take(w.reshape(P * F, *w.shape[2:]), ids, axis=0, mode="fill", fill_value=0)
    part = jnp.clip(ids // F, 0, P - 1)
    every_part = take_split(w, jnp.where(ids >= 0, ids - part * F, UNOWNED), axis=1)  # [P, k, ...]
    part = part.reshape(-1, *[1] * (w.ndim - 2))
    rows = every_part[0]
    for p in range(1, P):
        rows = jnp.where(part == p, every_part[p], rows)
    return rows


# On a TPU, compact copies hold a multiple of this many channels: a tile's sublanes (8 rows of
# 128 lanes). A stacked copy of another width (a scanned model's [L, ...] state) made XLA:TPU
# re-lay it out, a whole copy per step, for the layer loop (n_R = 6519 down columns: 3× the
# bytes; 6520: none). Elsewhere the padding would only add work.
TPU_CHANNEL_MULTIPLE = 8


def channel_multiple() -> int:
    """What compact copies' channel counts are rounded up to on the platform being traced for
    (`kernels.target_backend`): `TPU_CHANNEL_MULTIPLE` on a TPU, else 1."""
    return TPU_CHANNEL_MULTIPLE if target_backend() == "tpu" else 1


def pad_ids(ids: jax.Array) -> jax.Array:
    """ids [k] -> [k'] padded with ``UNOWNED`` (a zero channel) to a multiple of `channel_multiple`
    and of `split_channels` (k' = k on one CPU or GPU device)."""
    multiple = math.lcm(channel_multiple(), split_channels())
    pad = -ids.shape[-1] % multiple
    return jnp.pad(ids, (0, pad), constant_values=UNOWNED) if pad else ids
