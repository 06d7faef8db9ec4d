"""Weight-only int8: symmetric int8 values with one fp32 scale per output channel.

A quantized linear weight ``W ≈ q · s`` keeps popjax's ``[out, ..., in]`` layout: ``q`` int8 of
W's shape and ``s`` fp32 of the same rank with size 1 on the input (contracted) axis, so the
scale multiplies the *output* of a dot, ``x · Wᵀ = (x · qᵀ) · s``. That placement is what keeps
every method working on int8 weights unchanged: an FFN channel is an output row of gate/up (its
scale travels with it when a method copies or gathers channels) and an input column of down
(whose scales, one per output row d, do not depend on which channels are kept). The int8→float
convert sits right before the dot, where XLA fuses it into the dot's loop (docs/performance.md,
"int8 weights"): a decode step reads one byte per weight and never writes a float copy.

`Int8Weight` is a pytree (it traces, vmaps, scans and shards as its two arrays) with the few
array operations the methods apply to weights (indexing, take, transpose, reshape); `dot` is the
einsum every weight multiplication goes through, for float and int8 weights alike.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

WEIGHT_FORMATS = ("float", "int8")  # ModelConfig.weights
INT8_MAX = 127  # symmetric range [-127, 127]: -128 is never used, so negation is exact


def check_weights(weights: str) -> None:
    """One clear line for an unknown weight format."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights={weights!r} is not a supported weight format; use one of {list(WEIGHT_FORMATS)}")


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-output-channel symmetric int8 of a host array whose last axis is the input axis:
    w [..., in] -> (q int8 [..., in], scale fp32 [..., 1]) with w ≈ q · scale (round to
    nearest; an all-zero row gets scale 1, so padding rows stay exact zeros)."""
    w32 = np.asarray(w, dtype=np.float32)
    amax = np.max(np.abs(w32), axis=-1, keepdims=True)
    scale = np.where(amax > 0, amax / INT8_MAX, 1.0).astype(np.float32)
    q = np.clip(np.rint(w32 / scale), -INT8_MAX, INT8_MAX).astype(np.int8)
    return q, scale


@jax.tree_util.register_pytree_node_class
class Int8Weight:
    """values int8 [...]; scale fp32 of values' rank, size 1 on broadcast (input) axes;
    ``dtype`` the compute dtype the weight stands in for (static)."""

    def __init__(self, values: Any, scale: Any, dtype: Any = jnp.float32):
        self.values, self.scale, self.dtype = values, scale, jnp.dtype(dtype)

    def tree_flatten(self):
        return (self.values, self.scale), self.dtype

    @classmethod
    def tree_unflatten(cls, dtype, children):
        return cls(*children, dtype)

    def __repr__(self) -> str:
        return f"Int8Weight(shape={self.shape}, scale={tuple(self.scale.shape)}, dtype={self.dtype.name})"

    # -------------------------------------------------------------- array protocol used by methods
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def _like(self, values, scale) -> "Int8Weight":
        return Int8Weight(values, scale, self.dtype)

    def dequantize(self, dtype: Any = None) -> jax.Array:
        """q · s as a float array (a full copy: for importance norms and calibration, not steps)."""
        out = jnp.asarray(self.values, jnp.float32) * self.scale
        return out.astype(self.dtype if dtype is None else dtype)

    def astype(self, dtype: Any) -> jax.Array:
        return self.dequantize(dtype)

    def _broadcast(self, axis: int) -> bool:
        """Whether ``scale`` is broadcast (size 1) along ``axis`` of a values axis longer than 1."""
        return self.scale.shape[axis] == 1 and self.values.shape[axis] != 1

    def along(self, axis: int, fn: Callable[[Any, int], Any]) -> "Int8Weight":
        """``fn(array, axis)`` (a gather/copy of entries along ``axis``) on the values, and on the
        scale where it varies along ``axis`` (an output axis)."""
        axis = axis % self.ndim
        scale = self.scale if self.scale.shape[axis] == 1 else fn(self.scale, axis)
        return self._like(fn(self.values, axis), scale)

    def take(self, ids, axis: int, mode: str | None = None) -> "Int8Weight":
        return self.along(axis, lambda a, ax: jnp.take(a, ids, axis=ax, mode=mode))

    def __getitem__(self, index) -> "Int8Weight":
        index = index if isinstance(index, tuple) else (index,)
        if any(i is Ellipsis or i is None for i in index):
            raise TypeError(f"Int8Weight indexing takes ints, slices and arrays per axis, not {index!r}")
        scale_index = tuple(
            (0 if isinstance(i, (int, np.integer)) else slice(None)) if self.scale.shape[a] == 1 else i
            for a, i in enumerate(index)
        )
        return self._like(self.values[index], self.scale[scale_index])

    def transpose(self, *axes: int) -> "Int8Weight":
        axes = tuple(axes[0]) if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else axes
        return self._like(jnp.transpose(self.values, axes or None), jnp.transpose(self.scale, axes or None))

    @property
    def T(self) -> "Int8Weight":
        return self.transpose()

    def swapaxes(self, a: int, b: int) -> "Int8Weight":
        return self._like(jnp.swapaxes(self.values, a, b), jnp.swapaxes(self.scale, a, b))

    def reshape(self, *shape: int) -> "Int8Weight":
        """A reshape that merges or splits axes: each group of old axes that becomes a group of
        new axes must be all output axes (the scale is reshaped alike) or all broadcast axes (the
        scale keeps size 1 there)."""
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        values = jnp.reshape(self.values, shape)
        scale_shape = []
        for old, new in _reshape_groups(self.shape, values.shape):
            broadcast = [self._broadcast(a) for a in old]
            if any(broadcast) and not all(broadcast):
                raise ValueError(f"reshape {self.shape} -> {values.shape} mixes output and input axes of an int8 weight")
            scale_shape += [1 if any(broadcast) else values.shape[a] for a in new]
        return self._like(values, jnp.reshape(self.scale, scale_shape))

    def __rmatmul__(self, x) -> jax.Array:
        """``x @ w`` for a [k, n] weight whose scale is per column n (rows of a down projection
        gathered as [k, d]): x [..., k] -> [..., n]."""
        if self.ndim != 2:
            raise ValueError(f"x @ w needs a 2-D int8 weight, got {self}")
        return dot("...k,kn->...n", x, self)

    def __mul__(self, mask) -> "Int8Weight":
        """Multiplication by a 0/1 mask broadcast over the weight (e.g. zeroing padded channels)."""
        return self._like(self.values * jnp.asarray(mask).astype(jnp.int8), self.scale)


def _reshape_groups(old: Sequence[int], new: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pairs (old axes, new axes) of contiguous groups whose sizes multiply to the same number
    (old and new hold the same number of elements)."""
    groups, i, j = [], 0, 0
    while i < len(old) or j < len(new):
        gi, gj, pi, pj = [], [], 1, 1
        if i < len(old):
            gi, pi, i = [i], old[i], i + 1
        if j < len(new):
            gj, pj, j = [j], new[j], j + 1
        while pi != pj:
            if pi < pj:
                gi, pi, i = gi + [i], pi * old[i], i + 1
            else:
                gj, pj, j = gj + [j], pj * new[j], j + 1
        groups.append((gi, gj))
    return groups


def dot(spec: str, x: jax.Array, w: Any, **kwargs) -> jax.Array:
    """``jnp.einsum(spec, x, w)`` for a float weight; for an `Int8Weight` the dot runs on the
    int8 values converted to x's dtype (the convert fuses into the dot) and the scale multiplies
    its output. ``spec`` names x's axes first, then w's; every axis along which the scale varies
    must be an output axis (true of every linear layer: the scale is per output channel)."""
    if not isinstance(w, Int8Weight):
        return jnp.einsum(spec, x, w, **kwargs)
    inputs, out = spec.replace(" ", "").split("->")
    w_axes = inputs.split(",")[1]
    if "." in w_axes:
        raise ValueError(f"dot spec {spec!r}: name every axis of an int8 weight")
    varying = [a for a, n in zip(w_axes, w.scale.shape) if n != 1]
    if any(a not in out for a in varying):
        raise ValueError(f"dot spec {spec!r} contracts an output axis of an int8 weight {w}")
    y = jnp.einsum(spec, x, w.values.astype(x.dtype), **kwargs)
    scale = jnp.reshape(w.scale, [n for n in w.scale.shape if n != 1]) if varying else jnp.ones((), jnp.float32)
    out_named = [a for a in out.replace("...", "") if a in varying]
    scale = jnp.einsum(f"{''.join(varying)}->{''.join(out_named)}", scale) if varying else scale
    # lay the scale out along y's axes: its axes where they are in ``out``, 1 elsewhere (ellipsis included)
    ell = y.ndim - len(out.replace("...", ""))
    sizes = {a: n for a, n in zip(out_named, scale.shape)}
    layout = []
    for a in out.replace("...", "@"):
        layout += [1] * ell if a == "@" else [sizes.get(a, 1)]
    return y * jnp.reshape(scale, layout).astype(y.dtype)


def dequantized(w: Any) -> Any:
    """A float array for a float or int8 weight (for norms, calibration and references)."""
    return w.dequantize() if isinstance(w, Int8Weight) else w



def take_along_axis(w: Any, ids: jax.Array, axis: int, mode: str | None = None) -> Any:
    """``jnp.take_along_axis`` for a float or int8 weight (the scale is taken where it varies)."""
    if not isinstance(w, Int8Weight):
        return jnp.take_along_axis(w, ids, axis=axis, mode=mode)
    return w.along(axis, lambda a, ax: jnp.take_along_axis(a, ids, axis=ax, mode=mode))


def take(w: Any, ids: jax.Array, axis: int, mode: str | None = None) -> Any:
    """``jnp.take`` for a float or int8 weight."""
    return w.take(ids, axis, mode) if isinstance(w, Int8Weight) else jnp.take(w, ids, axis=axis, mode=mode)


def empty_along(w: Any, axis: int) -> Any:
    """A copy of ``w`` with no entry along ``axis`` (shape [..., 0, ...], w's kind)."""
    zeros = lambda a, ax: jnp.zeros(a.shape[:ax] + (0,) + a.shape[ax + 1 :], a.dtype)
    return w.along(axis, zeros) if isinstance(w, Int8Weight) else zeros(w, axis % w.ndim)
