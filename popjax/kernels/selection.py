"""Selections: how a method's choice of channels, blocks or input rows becomes what a decode-FFN
kernel reads.

A selection is ``ids [n]`` with ``count``: ids[:count] are selected, ids[count:] are padding
(ignored whatever their value); a selected id equal to its selected predecessor counts once (so
a sorted list with repeats is a set); an id outside the range contributes nothing. `Selection`
is what a kernel reads: fetch ids (clamped into range, padding repeating the last selected id
so a pipeline does not fetch again) and a keep flag per position. A batch whose rows chose
differently is served as the union of their choices with a per-row mask.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Selection(NamedTuple):
    """What a kernel reads: fetch ids [n] int32 (in range), keep [n] int32 (1 = add this
    position), and mask [n, B] fp32 (keep × the row's own choice) or None (every row)."""

    ids: jax.Array
    keep: jax.Array
    mask: jax.Array | None


def counted_blocks(block_ids: jax.Array, n_blocks: int) -> tuple[jax.Array, jax.Array]:
    """The block contract's selection: block_ids [nb] -> (ids as int32, counted [nb] bool): an id
    in [0, n_blocks) counts unless it repeats the previous id (a repeat counts once)."""
    raw = block_ids.astype(jnp.int32)
    repeat = jnp.concatenate([jnp.zeros((1,), bool), raw[1:] == raw[:-1]])
    return raw, (raw >= 0) & (raw < n_blocks) & ~repeat


def _selected(ids: jax.Array, count, size: int) -> tuple[jax.Array, jax.Array]:
    """ids [n] -> (fetch ids [n], keep [n] int32) under the contract in the module docstring."""
    n = ids.shape[0]
    ids = ids.astype(jnp.int32)
    count = jnp.asarray(n if count is None else count, jnp.int32)
    valid = jnp.arange(n) < count
    ok = valid & (ids >= 0) & (ids < size)
    repeat = jnp.concatenate([jnp.zeros(1, bool), ok[1:] & ok[:-1] & (ids[1:] == ids[:-1])])
    keep = ok & ~repeat
    clamped = jnp.clip(ids, 0, size - 1)
    last = clamped[jnp.clip(count - 1, 0, n - 1)]
    return jnp.where(valid, clamped, last), keep.astype(jnp.int32)


def select_blocks(
    block_ids: jax.Array, n_blocks: int, batch: int, count: int | jax.Array | None = None, row_mask: jax.Array | None = None
) -> Selection:
    """block_ids [n] (+ count, + row_mask [B, n_blocks] bool: the blocks each row chose) ->
    `Selection`. With a row mask, a row adds only its own blocks of the union ``block_ids``."""
    if block_ids.ndim != 1 or block_ids.shape[0] < 1:
        raise ValueError(f"block_ids of shape {tuple(block_ids.shape)} must be a non-empty vector [n]")
    ids, keep = _selected(block_ids, count, n_blocks)
    if row_mask is None:
        return Selection(ids, keep, None)
    if tuple(row_mask.shape) != (batch, n_blocks):
        raise ValueError(f"row_mask of shape {tuple(row_mask.shape)} does not fit; expected [B, n_blocks] = [{batch}, {n_blocks}]")
    mask = row_mask.astype(jnp.float32)[:, ids].T * keep[:, None]
    return Selection(ids, keep, mask)


def union_of_rows(row_mask: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    """row_mask [B, n] bool -> (ids [size] int32 sorted, count): the ids any row chose. ``size``
    must be at least the union's size (min(n, B · per-row count) always is)."""
    chosen = jnp.any(row_mask, axis=0)
    (ids,) = jnp.nonzero(chosen, size=size, fill_value=0)
    return ids.astype(jnp.int32), jnp.sum(chosen).astype(jnp.int32)


def select_channels(ids: jax.Array, f: int, batch: int, count: int | jax.Array | None = None) -> Selection:
    """Channel ids [m] (every row) or [B, m] (row r's own, counted by count [B] or a scalar) ->
    `Selection`. Per-row ids are served as their union with a per-row mask, so a channel two
    rows chose is read once."""
    if ids.ndim == 1:
        if ids.shape[0] < 1:
            raise ValueError("ids must hold at least one position")
        fetch, keep = _selected(ids, count, f)
        return Selection(fetch, keep, None)
    if ids.ndim != 2 or ids.shape[0] != batch:
        raise ValueError(f"ids of shape {tuple(ids.shape)} do not fit; expected [m] or [B, m] with B = {batch}")
    m = ids.shape[1]
    counts = jnp.broadcast_to(jnp.asarray(m if count is None else count, jnp.int32), (batch,))
    ok = (jnp.arange(m)[None] < counts[:, None]) & (ids >= 0) & (ids < f)
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], ids.shape)
    chose = jnp.zeros((batch, f), bool).at[rows, jnp.clip(ids, 0, f - 1)].max(ok)
    union, n_union = union_of_rows(chose, min(f, batch * m))
    fetch, keep = _selected(union, n_union, f)
    return Selection(fetch, keep, chose.astype(jnp.float32)[:, fetch].T * keep[:, None])
