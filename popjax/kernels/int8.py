"""int8 weights: symmetric int8 values with one fp32 scale per output channel.

A quantized linear weight ``W ≈ q · s`` keeps popjax's ``[out, ..., in]`` layout: ``q`` int8 of
W's shape and ``s`` fp32 of the same rank with size 1 on the input (contracted) axis, so the
scale multiplies the *output* of a dot, ``x · Wᵀ = (x · qᵀ) · s``. That placement is what keeps
every method working on int8 weights unchanged: an FFN channel is an output row of gate/up (its
scale travels with it when a method copies or gathers channels) and an input column of down
(whose scales, one per output row d, do not depend on which channels are kept). How the dot
reads the other operand is the weight's ``activations`` (`dot`): weight-only, where XLA fuses the
int8→float convert into the matmul (GPU, TPU), or per-token int8 activations and an integer dot,
the fast form on XLA:CPU, whose fused weight-only dots run slower than fp32's at a decode step's
shapes (docs/performance.md, "int8 weights").

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
ACTIVATION_MODES = ("float", "int8")  # ModelConfig.activations: how an int8 weight's dot reads x
TWO_PASS = "int8x2"  # an Int8Weight's own mode for an "int8" model's LM head and q/k/v (`two_pass`)
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
    ``dtype`` the compute dtype the weight stands in for and ``activations`` how `dot` reads
    the other operand (both static): "float" (weight-only: the int8 values converted to x's
    dtype) or "int8" (x quantized per row to int8, an int8 × int8 → int32 dot; see `dot`)."""

    def __init__(self, values: Any, scale: Any, dtype: Any = jnp.float32, activations: str = "float"):
        self.values, self.scale, self.dtype, self.activations = values, scale, jnp.dtype(dtype), activations

    def tree_flatten(self):
        return (self.values, self.scale), (self.dtype, self.activations)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

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

    def like(self, values, scale) -> "Int8Weight":
        """The same weight format (compute dtype, how it reads activations) over other arrays."""
        return Int8Weight(values, scale, self.dtype, self.activations)

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
        return self.like(fn(self.values, axis), scale)

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
        return self.like(self.values[index], self.scale[scale_index])

    def transpose(self, *axes: int) -> "Int8Weight":
        axes = tuple(axes[0]) if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else axes
        return self.like(jnp.transpose(self.values, axes or None), jnp.transpose(self.scale, axes or None))

    @property
    def T(self) -> "Int8Weight":
        return self.transpose()

    def swapaxes(self, a: int, b: int) -> "Int8Weight":
        return self.like(jnp.swapaxes(self.values, a, b), jnp.swapaxes(self.scale, a, b))

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
        return self.like(values, jnp.reshape(self.scale, scale_shape))

    def __rmatmul__(self, x) -> jax.Array:
        """``x @ w`` for a [k, n] weight whose scale is per column n (rows of a down projection
        gathered as [k, d]): x [..., k] -> [..., n]."""
        if self.ndim != 2:
            raise ValueError(f"x @ w needs a 2-D int8 weight, got {self}")
        return dot("...k,kn->...n", x, self)

    def __mul__(self, mask) -> "Int8Weight":
        """Multiplication by a 0/1 mask broadcast over the weight (e.g. zeroing padded channels)."""
        return self.like(self.values * jnp.asarray(mask).astype(jnp.int8), self.scale)


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
    """``jnp.einsum(spec, x, w)`` for a float weight. For an `Int8Weight` the scale multiplies
    the dot's output (every axis along which it varies must be an output axis: true of every
    linear layer, the scale is per output channel), and the dot reads x as the weight's
    ``activations`` say:

    * "float" (weight-only): the int8 values converted to x's dtype. Exact up to rounding to the
      float model of the dequantized weights. XLA fuses the convert into the dot, so a step reads
      one byte per weight (on XLA:CPU only in `_converted_dot`'s form, and there slower than
      fp32 below the LM head's size: docs/performance.md, "int8 weights").
    * "int8" (dynamic activations, as PyTorch's dynamic quantization and llama.cpp's CPU kernels
      do): each row of x (one token: its contracted last axis) is quantized to int8 with its own
      scale, the dot runs int8 × int8 → int32 and both scales multiply its output. XLA:CPU runs
      that dot without any float copy of the weights. A single row is padded to two, which
      keeps XLA off its slow matrix-vector path for integer dots.
    * "int8x2" (`TWO_PASS`, what an "int8" model's LM head and q/k/v use): x in two int8 passes, its
      per-row quantization and then the quantization of what that left, both rows in one
      integer dot. The remainder is at most half a first-pass step, so x's rounding error is
      ≥ 254× smaller than one pass's, at the cost of one int8 dot at one row (the second pass
      fills the padding row); one pass loses 0.013 nats of held-out NLL at the default model's
      head (docs/performance.md, "int8 weights").
    """
    if not isinstance(w, Int8Weight):
        return jnp.einsum(spec, x, w, **kwargs)
    inputs, out = spec.replace(" ", "").split("->")
    x_axes, w_axes = inputs.split(",")
    if "." in w_axes:
        raise ValueError(f"dot spec {spec!r}: name every axis of an int8 weight")
    varying = [a for a, n in zip(w_axes, w.scale.shape) if n != 1]
    if any(a not in out for a in varying):
        raise ValueError(f"dot spec {spec!r} contracts an output axis of an int8 weight {w}")
    if w.activations in ("int8", TWO_PASS) and x.shape[-1] and x.size:  # (an empty contraction: the float path's zeros)
        y, x_scale = _int8_activation_dot(spec, x, w, passes=2 if w.activations == TWO_PASS else 1)
    else:
        y, x_scale = _converted_dot(spec, x, w.values, **kwargs), None
    scale = jnp.reshape(w.scale, [n for n in w.scale.shape if n != 1]) if varying else jnp.ones((), jnp.float32)
    factor = _out_layout(scale, "".join(varying), out, y.ndim)
    if x_scale is not None:
        factor = factor * _out_layout(x_scale, x_axes[:-1], out, y.ndim)
    dtype = kwargs.get("preferred_element_type") or x.dtype
    return (y * factor).astype(dtype)


def _converted_dot(spec: str, x: jax.Array, values: jax.Array, **kwargs) -> jax.Array:
    """``einsum(spec, x, values → x's dtype)``. A linear layer (x's last axis contracted with the
    weight's last, every other weight axis an output) runs as ``x @ W.T`` on the weight viewed
    as [M, k]: XLA:CPU fuses that convert and transpose into a loop dot that reads one byte per
    weight, where a dot_general on the converted weight writes a float copy first
    (docs/performance.md, "int8 weights")."""
    inputs, out = spec.replace(" ", "").split("->")
    x_axes, w_axes = inputs.split(",")
    k = x_axes[-1]
    w_out = w_axes[:-1]
    linear = w_axes[-1] == k and k not in out and all(a in out for a in w_out) and not any(a in w_axes for a in x_axes[:-1])
    if not linear or values.size == 0:
        return jnp.einsum(spec, x, values.astype(x.dtype), **kwargs)
    if jax.default_backend() == "cpu":
        # tie the int8 values to x, so that inside a decode loop XLA cannot hoist the (loop-
        # invariant) convert out of it, which would write and then read a float copy of every weight
        values, x = jax.lax.optimization_barrier((values, x))
    matrix = values.reshape(-1, values.shape[-1]).astype(x.dtype)
    y = jnp.matmul(x, matrix.T, preferred_element_type=kwargs.get("preferred_element_type"))
    y = y.reshape(*x.shape[:-1], *values.shape[:-1])
    natural = x_axes[:-1] + w_out
    return y if natural == out else jnp.einsum(f"{natural}->{out}", y)


def _out_layout(a: jax.Array, axes: str, out: str, ndim: int) -> jax.Array:
    """``a`` (axes named by ``axes``, "..." allowed once) laid out to broadcast against the
    einsum output ``out`` of rank ``ndim``: its axes where they are in ``out``, 1 elsewhere."""
    ell_out = ndim - len(out.replace("...", ""))
    named = lambda s: s.replace("...", "@")
    a_axes = named(axes)
    if "@" in a_axes:  # expand the ellipsis into digits, one per dimension it stands for
        n = a.ndim - (len(a_axes) - 1)
        a_axes = a_axes.replace("@", "".join(str(i) for i in range(n)))
    out_axes = named(out).replace("@", "".join(str(i) for i in range(ell_out)))
    kept = "".join(c for c in out_axes if c in a_axes)
    a = jnp.einsum(f"{a_axes}->{kept}", a) if a_axes != kept else a
    sizes = dict(zip(kept, a.shape))
    return jnp.reshape(a, [sizes.get(c, 1) for c in out_axes])


def row_quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x fp32 [..., k] -> (int8 [..., k], per-row scale [...]) with x ≈ q · scale."""
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
    return jnp.clip(jnp.round(x / scale[..., None]), -INT8_MAX, INT8_MAX).astype(jnp.int8), scale


def _int8_activation_dot(spec: str, x: jax.Array, w: Int8Weight, passes: int = 1) -> tuple[jax.Array, jax.Array | None]:
    """The int32 → fp32 dot of x quantized per row (its last axis, the contracted one) with the
    int8 values -> (y without the weight's scale, x's per-row scale [x.shape[:-1]]). Two passes
    also quantize the remainder x − q·scale and return both passes' rows already scaled and
    summed (scale None)."""
    inputs, out = spec.replace(" ", "").split("->")
    x_axes, w_axes = inputs.split(",")
    if x_axes[-1] in out or x_axes[-1] not in w_axes or sum(a in w_axes and a not in out for a in x_axes) != 1:
        raise ValueError(f"dot spec {spec!r}: int8 activations need x's last axis to be the one contracted axis")
    passes = passes if x.ndim >= 2 else 1  # (the passes stack along x's first axis)
    xf = x.astype(jnp.float32)
    xq, x_scale = row_quantize(xf)
    scales = [x_scale]
    if passes == 2:  # the second pass's rows follow the first's along x's first axis
        rest, rest_scale = row_quantize(xf - xq.astype(jnp.float32) * x_scale[..., None])
        xq, scales = jnp.concatenate([xq, rest], axis=0), [x_scale, rest_scale]
    elif x.ndim >= 2 and math.prod(x.shape[:-1]) == 1:  # one row: two, so XLA:CPU runs its integer GEMM, not a slow matrix-vector loop
        xq = jnp.concatenate([xq, jnp.zeros_like(xq)], axis=0)
    y = jnp.einsum(spec, xq, w.values, preferred_element_type=jnp.int32).astype(jnp.float32)
    if xq.shape[0] == x.shape[0]:
        return y, x_scale
    first = x_axes[0]
    out_axes = out.replace("...", "@" * (y.ndim - len(out.replace("...", ""))))
    position = out_axes.index("@" if first == "." else first)
    rows = [jax.lax.slice_in_dim(y, i * x.shape[0], (i + 1) * x.shape[0], axis=position) for i in range(len(scales))]
    if passes == 1:
        return rows[0], x_scale
    return sum(r * _out_layout(s, x_axes[:-1], out, y.ndim) for r, s in zip(rows, scales)), None


def two_pass(w: Any) -> Any:
    """``w`` read in two int8 passes (`TWO_PASS`) if it is an int8-activation weight, else as is:
    for the dots whose one-pass activation error costs most (the LM head, q/k/v)."""
    return Int8Weight(w.values, w.scale, w.dtype, TWO_PASS) if isinstance(w, Int8Weight) and w.activations == "int8" else w


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
