"""The block-granular weight layout (`BlockSlab`) that `ffn_tpu.block_ffn` and `ffn_gpu.block_ffn`
read: block j of b channels is one contiguous slab [3, b, d], its gate rows, up rows and down
columns (transposed to rows), so that a kernel fetches a chosen block in one copy.

A stack of layers (`stacked_block_layout`, values [S, nb, 3, b, d]) is what a method keeps as
model-level data: a kernel given ``layer`` reads that layer's blocks by offset ids
(`slab_view`), as the row kernels read a stack (`ffn_layout.stack_view`), so no layer is copied
out of the stack, also in a scanned model where ``layer`` is traced.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from .ffn_layout import check_activation, check_scales, check_x


class BlockSlab(NamedTuple):
    """Block-granular weights. values [nb, 3, b, d] (float or int8); for int8, gate_up_scale
    [nb, 2, b] fp32 and down_scale [1, d] fp32, else None. A stack of S layers has each with a
    leading [S] axis."""

    values: jax.Array
    gate_up_scale: jax.Array | None = None
    down_scale: jax.Array | None = None


def block_layout(
    gate_up: jax.Array, down: jax.Array, block_size: int, gate_up_scale: jax.Array | None = None, down_scale: jax.Array | None = None
) -> BlockSlab:
    """gate_up [2, f, d], down [d, f] (+ int8 scales [2, f, 1], [d, 1]) -> `BlockSlab` with
    values [f/b, 3, b, d]. Run once per model (it copies the weights)."""
    check_scales(gate_up, down, gate_up_scale, down_scale)
    f, d = gate_up.shape[1], gate_up.shape[2]
    if block_size < 1 or f % block_size:
        raise ValueError(f"block size {block_size} does not divide the {f} channels; use a divisor of {f}")
    nb = f // block_size
    rows = jnp.concatenate([gate_up, jnp.swapaxes(down, 0, 1)[None]], axis=0)  # [3, f, d]
    values = jnp.swapaxes(rows.reshape(3, nb, block_size, d), 0, 1)
    if gate_up_scale is None:
        return BlockSlab(values)
    gus = jnp.swapaxes(gate_up_scale[..., 0].reshape(2, nb, block_size), 0, 1).astype(jnp.float32)
    return BlockSlab(values, gus, down_scale[:, 0][None].astype(jnp.float32))


def stacked_block_layout(
    gate_up: jax.Array, down: jax.Array, block_size: int, gate_up_scale: jax.Array | None = None, down_scale: jax.Array | None = None
) -> BlockSlab:
    """Every layer's `block_layout`: gate_up [S, 2, f, d], down [S, d, f] (+ int8 scales
    [S, 2, f, 1], [S, d, 1]) -> a stacked `BlockSlab`, values [S, f/b, 3, b, d]."""
    if gate_up.ndim != 4:
        raise ValueError(f"gate_up of shape {tuple(gate_up.shape)} is not a stack of layers [S, 2, f, d]")
    if gate_up_scale is None:
        return jax.vmap(lambda g, w: block_layout(g, w, block_size))(gate_up, down)
    return jax.vmap(lambda g, w, gs, ws: block_layout(g, w, block_size, gs, ws))(gate_up, down, gate_up_scale, down_scale)


def check_slab(slab: BlockSlab, x: jax.Array, act: str, layer=None) -> tuple[int, int, int]:
    """A block kernel's inputs: ``act``, slab values [nb, 3, b, d] (or a stack [S, nb, 3, b, d]
    read at ``layer``, given exactly then) and x [B, d] -> (nb, b, d) of one layer."""
    check_activation(act)
    shape = tuple(slab.values.shape)
    if len(shape) not in (4, 5) or shape[-3] != 3:
        raise ValueError(f"slab values of shape {shape} are not [nb, 3, b, d] or a stack [S, nb, 3, b, d]")
    if (len(shape) == 5) != (layer is not None):
        raise ValueError(f"slab values of shape {shape} with layer={layer!r}: a stack [S, nb, 3, b, d] is read at a layer, "
                         "one slab [nb, 3, b, d] without one")
    nb, _, b, d = shape[-4:]
    check_x(x, d)
    return nb, b, d


def slab_view(slab: BlockSlab, layer) -> tuple[BlockSlab, jax.Array | int]:
    """``slab`` as one slab (a stack's values [S·nb, 3, b, d], a bitcast; int8: gate/up scales
    [S·nb, 2, b] and the layer's down scale [1, d]) and the offset of ``layer``'s blocks in it
    (0 for one slab, not a stack). ``layer`` is clamped into [0, S): Pallas checks no bounds, so
    an index past the stack would fetch another buffer's memory."""
    if layer is None:
        return slab, 0
    layers, nb = slab.values.shape[:2]
    layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, layers - 1)
    values = slab.values.reshape(layers * nb, *slab.values.shape[2:])
    if slab.gate_up_scale is None:
        return BlockSlab(values), layer * nb
    gus = slab.gate_up_scale.reshape(layers * nb, *slab.gate_up_scale.shape[2:])
    return BlockSlab(values, gus, jax.lax.dynamic_index_in_dim(slab.down_scale, layer, keepdims=False)), layer * nb
