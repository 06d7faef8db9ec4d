"""Kernel rows held in their stack: how a scanned model hands a method's state rows to a kernel
without cutting its layer out first.

A method whose decode step reads rows through a kernel keeps them in its state (POP's compact
candidate copy, `ffn_layout.InputRows` [n_C, L, 128] per sequence). A scanned model stacks every
layer's state [L, ...] and its ``lax.scan`` slices layer l's entry out per step; XLA fuses such
a slice into the dots that read it, but a Pallas call takes whole operands, so XLA:TPU copied
the layer's rows into a new buffer in every layer of every step (0.75 GiB per 8B decode step at
POP 40%, in the compiled HLO: docs/tpu.md). So a scanned decode step holds the rows instead:

* `hold` splits the stacked states into the part the scan slices and the rows, which it keeps
  whole; each layer gets its rows back as *held rows* (the stack with ``layer`` set), which the
  kernels read by offset ids (`ffn_layout.input_stack`, `ffn_layout.output_stack`): no copy;
* `release` takes the rows back out of a layer's new state, and refuses a step that changed them
  (a decode step reads its state's rows, it does not rewrite them);
* `restore` puts the stacks back into the scanned states.

A per-sequence plan sees the rows with their row axis inside the stack ([L, B, ...]): its batch
of one takes the row as `row_of` (a bitcast); a wider batch maps its step over the rows with the
stack flattened to [L·B, ...] (a bitcast) and left unmapped, each row's rows held at their own
offset (`per_row`, `row_axes`; popjax.methods.per_sequence), so no row's rows are copied out.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .ffn_layout import InputRows, OutputRows


def is_rows(node) -> bool:
    """Whether ``node`` is kernel rows (`InputRows`, `OutputRows`): a node of a state tree."""
    return isinstance(node, (InputRows, OutputRows))


def held_rows(node) -> bool:
    """Whether ``node`` is kernel rows of one layer held in their stack (``layer`` set)."""
    return is_rows(node) and node.layer is not None


def row_of(rows, row: int = 0):
    """Held rows whose stack carries a row axis after the layer's ([S, B, ...]) -> the held rows
    of one row (``[:, row]``: for a batch of one, a bitcast)."""
    at = lambda a: None if a is None else a[:, row]  # noqa: E731
    return rows._replace(values=at(rows.values), scale=at(rows.scale))


def per_row(rows, batch: int):
    """Held rows whose stack carries a row axis after the layer's ([S, B, ...]) -> held rows of a
    flat stack [S·B, ...] (a bitcast) with ``layer`` [B], each row's offset (layer·B + row): what
    a vmap over the rows maps with `row_axes` (the stack unmapped, the offsets mapped). The layer
    is clamped into [0, S) first: past the stack, its offsets would name another layer's rows."""
    flat = lambda a: None if a is None else a.reshape(-1, *a.shape[2:])  # noqa: E731
    layer = jnp.clip(jnp.asarray(rows.layer, jnp.int32), 0, rows.values.shape[0] - 1)
    layer = layer * batch + jnp.arange(batch, dtype=jnp.int32)
    return type(rows)(flat(rows.values), flat(rows.scale), layer)


def row_axes(rows):
    """The vmap axes of `per_row`'s rows: the stack unmapped, the row's offset mapped."""
    return type(rows)(None, None, 0)


def without_passed_rows(new, given):
    """A mapped step's new state with each held rows node it passed through (``given``'s own)
    replaced by None, so that the map returns no copy of the stack; see `with_held_rows`."""
    nodes, treedef = jax.tree_util.tree_flatten(new, is_leaf=is_rows)
    before, given_def = jax.tree_util.tree_flatten(given, is_leaf=is_rows)
    if treedef != given_def:
        return new
    kept = [None if held_rows(b) and passed_through(n, b) else n for n, b in zip(nodes, before)]
    return jax.tree_util.tree_unflatten(treedef, kept)


def with_held_rows(state, new):
    """`without_passed_rows`'s result after the map, with ``state``'s held rows back where it put None."""
    rows_or_none = lambda n: n is None or is_rows(n)  # noqa: E731
    nodes, treedef = jax.tree_util.tree_flatten(state, is_leaf=rows_or_none)
    returned, new_def = jax.tree_util.tree_flatten(new, is_leaf=rows_or_none)
    if new_def != treedef:
        return new
    return jax.tree_util.tree_unflatten(treedef, [s if r is None and held_rows(s) else r for s, r in zip(nodes, returned)])


def passed_through(new, given) -> bool:
    """Whether the tree ``new`` a step returned is ``given`` itself, leaf for leaf (the same
    arrays, not equal ones: a step that passes its rows through returns its input tracers)."""
    after, before = jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(given)
    return len(after) == len(before) and all(a is b for a, b in zip(after, before))


class Held(NamedTuple):
    """Stacked states split by `hold`: ``sliced`` (the tree's nodes, rows replaced by None: the
    scan's per-layer input) and ``rows`` (the rows stacked [L, ...], else None), with ``treedef``."""

    treedef: Any
    sliced: list
    rows: list


def hold(states) -> Held | None:
    """Stacked method states [L, ...] -> `Held`, or None when they hold no kernel rows (the scan
    then slices the states as they are)."""
    nodes, treedef = jax.tree_util.tree_flatten(states, is_leaf=is_rows)
    if not any(is_rows(n) for n in nodes):
        return None
    return Held(treedef, [None if is_rows(n) else n for n in nodes], [n if is_rows(n) else None for n in nodes])


def layer_state(held: Held, sliced: list, layer):
    """Layer ``layer``'s state: its sliced nodes with every row node held at ``layer``."""
    nodes = [s if r is None else r._replace(layer=layer) for s, r in zip(sliced, held.rows)]
    return jax.tree_util.tree_unflatten(held.treedef, nodes)


def release(held: Held, state, layer_state_in) -> list:
    """A layer's new state -> its nodes with the rows replaced by None (the scan's per-layer
    output). ValueError if the step changed the tree's structure or any held rows."""
    nodes, treedef = jax.tree_util.tree_flatten(state, is_leaf=is_rows)
    given = jax.tree_util.tree_flatten(layer_state_in, is_leaf=is_rows)[0]
    if treedef != held.treedef:
        raise ValueError("a decode step of a scanned model changed the structure of its method state: held kernel rows "
                         "(popjax.kernels.held_rows) need the state a step returns shaped like the one it got")
    out = []
    for node, before, rows in zip(nodes, given, held.rows):
        if rows is None:
            out.append(node)
            continue
        if not passed_through(node, before):
            raise ValueError("a decode step of a scanned model rewrote kernel rows of its method state: a scanned model "
                             "holds them read-only in their stack (popjax.kernels.held_rows); use the unrolled model")
        out.append(None)
    return out


def restore(held: Held, sliced: list):
    """The scan's stacked per-layer outputs (``sliced``: rows None) with the held stacks put back."""
    nodes = [s if r is None else r for s, r in zip(sliced, held.rows)]
    return jax.tree_util.tree_unflatten(held.treedef, nodes)
