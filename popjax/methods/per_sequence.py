"""Per-sequence statistics for a plan written for the shared (whole-batch) mode: its prefill and
decode run once per sequence through ``jax.vmap`` (a batch of one each), so each sequence gets
its own partition; state and aux gain a leading batch axis [B, ...]."""

from __future__ import annotations

import jax

from ..kernels import held_rows


def prefill_per_sequence(prefill_shared, w, x, valid):
    """Runs a batch-aggregating prefill once per sequence (a batch of one each, via vmap), so
    each sequence gets its own statistics; state and aux gain a leading batch axis. A batch of
    one row runs the shared code as it is (the same statistics) with the axis added: the vmap of a
    single row made XLA read more bytes per step than the shared plan (compact copies moved
    through a batch axis)."""
    if x.shape[0] == 1:
        y, state, aux = prefill_shared(w, x, valid)
        return y, _with_row_axis(state), _with_row_axis(aux)

    def one(xb, vb):
        y, state, aux = prefill_shared(w, xb[None], vb[None])
        return y[0], state, aux

    return jax.vmap(one)(x, valid)


def decode_per_sequence(decode_shared, w, state, x, step, valid):
    """The decode counterpart of `prefill_per_sequence`: state carries a leading batch axis
    (held kernel rows, `kernels.held_rows`, carry it after their layer axis)."""
    if x.shape[0] == 1:
        row = jax.tree_util.tree_map(lambda n: held_rows.row_of(n) if held_rows.held_rows(n) else n[0], state,
                                     is_leaf=held_rows.held_rows)
        y, new_row, aux = decode_shared(w, row, x, step, valid)
        return y, _rows_restored(state, row, new_row), _with_row_axis(aux)

    def one(sb, xb, vb):  # held rows the step passed through do not leave the map (no copy of their stack)
        y, new_state, aux = decode_shared(w, sb, xb[None], step, vb[None])
        return y[0], held_rows.without_passed_rows(new_state, sb), aux

    # the map takes each row's held rows at its own offset of the flattened stack, unmapped (held_rows.per_row)
    batch = x.shape[0]
    rows = jax.tree_util.tree_map(lambda n: held_rows.per_row(n, batch) if held_rows.held_rows(n) else n, state,
                                  is_leaf=held_rows.held_rows)
    axes = jax.tree_util.tree_map(lambda n: held_rows.row_axes(n) if held_rows.held_rows(n) else 0, state,
                                  is_leaf=held_rows.held_rows)
    y, new_state, aux = jax.vmap(one, in_axes=(axes, 0, 0))(rows, x, valid)
    return y, held_rows.with_held_rows(state, new_state), aux


def _rows_restored(state, row, new_row):
    """A batch-of-one step's new state with its row axis back; a leaf the step passed through
    (``row``'s own: compact copies) is ``state``'s array itself. A new ``a[0][None]`` becomes a new
    [L, ...] stack per step in a scanned model, and XLA:TPU then copied POP's whole stacked state
    in every layer trip (406 GiB per 8B step against 9.3 unrolled, in the compiled HLO)."""
    leaves, treedef = jax.tree_util.tree_flatten(new_row)
    if jax.tree_util.tree_structure(row) != treedef:
        return _with_row_axis(new_row)
    pairs = zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(row), leaves)
    return jax.tree_util.tree_unflatten(treedef, [a if n is r else n[None] for a, r, n in pairs])


def _with_row_axis(tree):
    """A batch-of-one tree (state or aux) with the leading [1] row axis per-sequence trees carry."""
    return jax.tree_util.tree_map(lambda a: a[None], tree)
