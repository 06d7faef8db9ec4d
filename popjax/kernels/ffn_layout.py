"""What the decode-FFN kernels share: their weight layouts, the activations and the checks on
their inputs (how a selection becomes the ids a kernel reads: `selection`; the bytes each one
moves: `traffic`).

The FFN is y = down · (act(gate · x) ⊙ up · x) for x [B, d], gate/up [f, d] (popjax keeps them
stacked as ``gate_up [2, f, d]``) and down [d, f]. A kernel reads only the selected channels,
so a channel's three weight vectors must be cheap to fetch together:

* `block_slab.BlockSlab` (block-granular kernels): ``values [f/b, 3, b, d]``, block j = the gate
  rows, up rows and down columns (transposed to rows) of channels j·b .. j·b+b-1, one contiguous slab;
* `ChannelRows` (channel-granular kernels): ``values [3, f, L, 128]``, gate, up and down rows
  of each channel, a row of d cut into L = ceil(d / 1024) · 8 lines of 128 (zero-padded past d).
  That shape is what lets a TPU DMA fetch any one channel: XLA:TPU tiles HBM arrays in (8, 128)
  tiles over the last two dims, so with L a multiple of 8 a channel is whole tiles, and Mosaic
  refuses a DMA whose offset falls inside a tile (a row of a [f, d] array). With L not a
  multiple of 8, or a [f, 1, d] shape, XLA picks a layout with the dims reordered and copies the
  whole array before every call (measured: docs/kernels.md).

int8 weights (popjax/kernels/int8.py's format) are int8 values with fp32 per-output-channel scales:
``gate_up_scale [2, f, 1]`` (a channel's scale travels with its gate/up rows) and
``down_scale [d, 1]`` (one per output, applied to the kernel's accumulator).

A selection is ``ids [n]`` with ``count``: ids[:count] are selected, ids[count:] are padding
(ignored whatever their value); a selected id equal to its selected predecessor counts once (so
a sorted list with repeats is a set); an id outside the range contributes nothing
(`selection.Selection`: fetch ids and a keep flag per position).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # models.config.FFN_ACTIVATIONS' names
MAX_BATCH = 64
WEIGHT_DTYPES = ("float32", "bfloat16", "int8")
X_DTYPES = ("float32", "bfloat16")
_SQRT_2_OVER_PI = 0.7978845608028654


class ChannelRows(NamedTuple):
    """Channel-granular weights. values [3, f, L, 128] (L = `channel_lines(d)`): each channel's
    gate, up and down rows; for int8, gate_up_scale [2, f] fp32 and down_scale [1, L·128] fp32
    (1 past d), else None. A kernel given the gate values (``gather_ffn(gate=…)``: CATS) needs
    only up and down: values [2, f, L, 128], gate_up_scale [1, f] (up's). Either as a stack of S
    layers read at a layer index (`stacked_up_down_layout`): values [m, S, f, L, 128],
    gate_up_scale [m − 1, S, f], down_scale [S, 1, L·128]."""

    values: jax.Array
    gate_up_scale: jax.Array | None = None
    down_scale: jax.Array | None = None


class InputRows(NamedTuple):
    """Input-major weights, for methods that sparsify a matmul's *input* per token (TEAL, WINA,
    principal TEAL): values [k, L, 128], row i = the column of W [n, k] that input i multiplies
    (L = `channel_lines(n)`, zero past n); scale [1, L·128] fp32 (int8: W's per-output-channel
    scales, 1 past n) or None. With ``layer`` (an int32 scalar), one layer of a stack: values
    [S, k, L, 128], scale [S, 1, L·128], read at that layer by offset (a scanned model's
    method state: `held_rows`)."""

    values: jax.Array
    scale: jax.Array | None = None
    layer: jax.Array | None = None


class OutputRows(NamedTuple):
    """Output-major weights, for a step that needs single outputs of W [n, d] · x (shortlisted
    POP's up projection of its shortlist): values [n, L, 128], row j = W's row j (L =
    `channel_lines(d)`, zero past d); scale [n] fp32 (int8: row j's scale) or None. With
    ``layer``, one layer of a stack: values [S, n, L, 128], scale [S, n] (`held_rows`)."""

    values: jax.Array
    scale: jax.Array | None = None
    layer: jax.Array | None = None


def check_scales(gate_up, down, gate_up_scale, down_scale) -> None:
    """ValueError unless gate_up [2, f, d] and down [d, f] are one FFN's weights in a supported
    dtype, with int8's fp32 scales [2, f, 1] and [d, 1] (and only int8's)."""
    if gate_up.ndim != 3 or gate_up.shape[0] != 2 or down.ndim != 2 or down.shape != (gate_up.shape[2], gate_up.shape[1]):
        raise ValueError(
            f"gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} are not an FFN's weights; expected gate_up [2, f, d] and down [d, f]"
        )
    f, d = gate_up.shape[1], gate_up.shape[2]
    if jnp.dtype(gate_up.dtype) == jnp.int8:
        if gate_up_scale is None or down_scale is None:
            raise ValueError("int8 weights need gate_up_scale [2, f, 1] and down_scale [d, 1] (fp32 per-output-channel scales)")
        if tuple(gate_up_scale.shape) != (2, f, 1) or tuple(down_scale.shape) != (d, 1):
            raise ValueError(
                f"scales gate_up_scale {tuple(gate_up_scale.shape)}, down_scale {tuple(down_scale.shape)} do not fit "
                f"f={f}, d={d}; expected [2, {f}, 1] and [{d}, 1]"
            )
    elif gate_up_scale is not None or down_scale is not None:
        raise ValueError(f"scales were given for {jnp.dtype(gate_up.dtype).name} weights; scales are for int8 weights only")
    if jnp.dtype(gate_up.dtype).name not in WEIGHT_DTYPES or down.dtype != gate_up.dtype:
        raise ValueError(f"weights of dtype {gate_up.dtype}/{down.dtype} are not supported; use one of {list(WEIGHT_DTYPES)} for both")


def channel_lines(d: int) -> int:
    """L, the 128-wide lines a channel's row of d takes in `ChannelRows`: a multiple of 8."""
    return -(-d // 1024) * 8


def in_lines(rows: jax.Array) -> jax.Array:
    """Rows [..., n] -> [..., L, 128] (L = `channel_lines(n)`, zero past n): each row whole
    (8, 128) tiles, what a TPU DMA of one row needs."""
    n = rows.shape[-1]
    lines = channel_lines(n)
    pad = [(0, 0)] * (rows.ndim - 1) + [(0, lines * 128 - n)]
    return jnp.pad(rows, pad).reshape(*rows.shape[:-1], lines, 128)


def line_scale(scale: jax.Array) -> jax.Array:
    """Per-output-channel int8 scales [..., n, 1] -> [..., 1, L·128] fp32, 1 past n: the scale
    of the outputs of `in_lines` rows."""
    n = scale.shape[-2]
    pad = [(0, 0)] * (scale.ndim - 2) + [(0, channel_lines(n) * 128 - n)]
    return jnp.pad(scale[..., 0].astype(jnp.float32), pad, constant_values=1.0)[..., None, :]


def channel_layout(
    gate_up: jax.Array, down: jax.Array, gate_up_scale: jax.Array | None = None, down_scale: jax.Array | None = None
) -> ChannelRows:
    """gate_up [2, f, d], down [d, f] (+ int8 scales) -> `ChannelRows` with values
    [3, f, L, 128]. Run once per model (it copies the weights)."""
    check_scales(gate_up, down, gate_up_scale, down_scale)
    rows = in_lines(jnp.concatenate([gate_up, jnp.swapaxes(down, 0, 1)[None]], axis=0))
    if gate_up_scale is None:
        return ChannelRows(rows)
    return ChannelRows(rows, gate_up_scale[..., 0].astype(jnp.float32), line_scale(down_scale))


def stacked_up_down_layout(
    up: jax.Array, down: jax.Array, up_scale: jax.Array | None = None, down_scale: jax.Array | None = None
) -> ChannelRows:
    """S layers' up [S, f, d] and down [S, d, f] (+ int8 scales [S, f, 1], [S, d, 1]) ->
    `ChannelRows` values [2, S, f, L, 128] (up rows, then down columns as rows), for a kernel
    given the gate values and a layer index. Run once per model (it copies the weights)."""
    rows = in_lines(jnp.stack([up, jnp.swapaxes(down, 1, 2)]))
    if up_scale is None:
        return ChannelRows(rows)
    return ChannelRows(rows, up_scale[None, ..., 0].astype(jnp.float32), line_scale(down_scale))


def stack_view(rows: ChannelRows, layer, layers: int | None):
    """``rows`` as one matrix per kind (values [m, S·f, L, 128], a bitcast of a stack; int8
    scales [k, S·f] and the layer's down scale [1, L·128]) and the offset of ``layer``'s channels
    in it (0 for one matrix, not a stack): the kernels fetch a stacked layer's rows by offset
    ids, so no layer is copied out of the stack. ``layer`` is clamped into [0, S): Pallas checks
    no bounds, so an index past the stack would fetch another buffer's memory."""
    if layers is None:
        return rows.values, rows.gate_up_scale, rows.down_scale, 0
    m, _, f, lines, lanes = rows.values.shape
    layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, layers - 1)
    values = rows.values.reshape(m, layers * f, lines, lanes)
    if rows.gate_up_scale is None:
        return values, None, None, layer * f
    gus = rows.gate_up_scale.reshape(rows.gate_up_scale.shape[0], layers * f)
    return values, gus, jax.lax.dynamic_index_in_dim(rows.down_scale, layer, keepdims=False), layer * f


def input_layout(w: jax.Array, scale: jax.Array | None = None) -> InputRows:
    """W [n, k] (+ int8 scale [n, 1]) -> `InputRows` [k, L, 128]. TEAL's two matmuls are
    ``input_layout(gate_up.reshape(2f, d))`` (x's active inputs; outputs gate then up) and
    ``input_layout(down)`` (H's active channels)."""
    if w.ndim != 2:
        raise ValueError(f"W of shape {tuple(w.shape)} is not a matrix [n, k]")
    n, k = w.shape
    if (jnp.dtype(w.dtype) == jnp.int8) != (scale is not None) or (scale is not None and tuple(scale.shape) != (n, 1)):
        given = None if scale is None else tuple(scale.shape)
        raise ValueError(f"W of dtype {w.dtype} with scale {given}: int8 W needs scale [{n}, 1], float W none")
    values = in_lines(jnp.swapaxes(w, 0, 1))
    return InputRows(values) if scale is None else InputRows(values, line_scale(scale))


def stacked_input_layout(w: jax.Array, scale: jax.Array | None = None) -> InputRows:
    """S matrices W [S, n, k] (+ int8 scales [S, n, 1]) -> `InputRows` values [S, k, L, 128]
    (scale [S, 1, L·128]): per-layer input-major copies, read by `masked_selection` at a layer."""
    if w.ndim != 3:
        raise ValueError(f"W of shape {tuple(w.shape)} is not a stack of matrices [S, n, k]")
    return jax.vmap(input_layout)(w) if scale is None else jax.vmap(input_layout)(w, scale)


def output_layout(w, scale: jax.Array | None = None) -> OutputRows:
    """W [n, d] (+ int8 scale [n, 1]) -> `OutputRows` [n, L, 128]: W's rows in 128-lane lines."""
    if w.ndim != 2:
        raise ValueError(f"W of shape {tuple(w.shape)} is not a matrix [n, d]")
    if (jnp.dtype(w.dtype) == jnp.int8) != (scale is not None) or (scale is not None and tuple(scale.shape) != (w.shape[0], 1)):
        given = None if scale is None else tuple(scale.shape)
        raise ValueError(f"W of dtype {w.dtype} with scale {given}: int8 W needs scale [{w.shape[0]}, 1], float W none")
    return OutputRows(in_lines(w), None if scale is None else scale[:, 0].astype(jnp.float32))


def activation(name: str) -> Callable[[jax.Array], jax.Array]:
    """The gate activation by its config name, in the operations both Mosaic and Triton lower
    (tanh-GELU written out: ``jax.nn.gelu``'s power op is not one of them everywhere)."""
    check_activation(name)
    if name == "silu":
        return lambda g: g * jax.nn.sigmoid(g)
    return lambda g: 0.5 * g * (1.0 + jnp.tanh(_SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)))


def check_activation(name: str) -> None:
    if name not in ACTIVATIONS:
        raise ValueError(f"act={name!r} is not a kernel activation; use one of {list(ACTIVATIONS)}")


def check_channel_rows(rows: "ChannelRows", x: jax.Array, act: str, gated: bool = False, layer=None) -> tuple[int, int, int | None]:
    """A channel-gather kernel's inputs: ``act``, rows values [m, f, L, 128] or a stack
    [m, S, f, L, 128] read at ``layer`` (L = `channel_lines` of x's d; m = 3, or 2 when the
    gate values are given: ``gated``) and x [B, d] -> (f, L, S or None)."""
    check_activation(act)
    shape, d = tuple(rows.values.shape), x.shape[-1]
    stacked = len(shape) == 5
    ok = len(shape) in (4, 5) and shape[0] in ((2, 3) if gated else (3,)) and shape[-2:] == (channel_lines(d), 128)
    if not ok:
        m = "2 or 3" if gated else "3"
        raise ValueError(f"rows values of shape {shape} do not fit x's d={d}; expected [{m}, (S,) f, {channel_lines(d)}, 128] "
                         "(ffn_layout.channel_layout, stacked_up_down_layout)")
    if stacked != (layer is not None):
        raise ValueError(f"rows of shape {shape} with layer={layer!r}: a stack [m, S, f, L, 128] needs a layer index, one matrix none")
    check_x(x, d)
    return shape[-3], shape[-2], shape[1] if stacked else None


def check_gate(gate: jax.Array | None, ids: jax.Array, batch: int) -> None:
    """Given gate values must be [B, m] beside shared ids [m] (a row's own channels: its zeros)."""
    if gate is not None and (ids.ndim != 1 or tuple(gate.shape) != (batch, ids.shape[0])):
        raise ValueError(f"gate of shape {tuple(gate.shape)} with ids of shape {tuple(ids.shape)}: given gate values are "
                         f"[B, m] = [{batch}, m] beside ids [m], one per row and position (0: the row does not add it)")


def check_input_rows(rows: "InputRows", x: jax.Array, out_features: int) -> tuple[int, int]:
    """A gathered matvec's inputs: rows values [k, L, 128] holding ``out_features`` outputs and
    x [B, k] -> (k, L)."""
    k, lines, lanes = rows.values.shape
    if lanes != 128 or lines != channel_lines(out_features):
        raise ValueError(
            f"rows of shape {tuple(rows.values.shape)} do not hold {out_features} outputs; "
            f"expected [k, {channel_lines(out_features)}, 128] (ffn_layout.input_layout)"
        )
    check_x(x, k)
    return k, lines


def input_stack(rows: "InputRows", x, out_features: int, layer=None) -> tuple[int, int, jax.Array, jax.Array | None, jax.Array | int]:
    """An input-row matvec's rows as one matrix: rows [k, L, 128] (``layer`` None) or a stack of
    layers [S, k, L, 128] read at ``layer`` (clamped into [0, S)), checked against x [B, k] ->
    (k, L, values [S·k, L, 128] (a bitcast: no layer copied out), the layer's scale [1, L·128]
    or None, the layer's first row in values: layer·k). ``layer`` None reads ``rows.layer``."""
    layer = rows.layer if layer is None else layer
    stacked = rows.values.ndim == 4
    if stacked != (layer is not None):
        raise ValueError(f"rows of shape {tuple(rows.values.shape)} with layer={layer!r}: a stack [S, k, L, 128] needs a layer index, one matrix none")
    k, lines = check_input_rows(InputRows(jax.ShapeDtypeStruct(rows.values.shape[-3:], rows.values.dtype)), x, out_features)
    if not stacked:
        return k, lines, rows.values, rows.scale, 0
    layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, rows.values.shape[0] - 1)
    scale = None if rows.scale is None else jax.lax.dynamic_index_in_dim(rows.scale, layer, keepdims=False)
    return k, lines, rows.values.reshape(-1, lines, 128), scale, layer * k


def values_stack(values: jax.Array, rows: "InputRows", ids: jax.Array, out_features: int):
    """A matvec given its inputs' values per position: values [B, m] beside ids [m], rows
    [k, L, 128] holding ``out_features`` outputs (or held rows: `input_stack`) -> input_stack's
    (k, L, weights, scale, first)."""
    if ids.ndim != 1 or values.ndim != 2 or values.shape[1] != ids.shape[0]:
        raise ValueError(f"values of shape {tuple(values.shape)} with ids of shape {tuple(ids.shape)}: expected values [B, m] beside ids [m]")
    check_x(values, ids.shape[0])
    return input_stack(rows, jax.ShapeDtypeStruct((values.shape[0], rows.values.shape[-3]), values.dtype), out_features)


def check_output_rows(rows: "OutputRows", x: jax.Array) -> int:
    """A row-dot's inputs: rows values [n, L, 128] (L = `channel_lines` of x's d) and x [B, d] -> n."""
    shape, d = tuple(rows.values.shape), x.shape[-1]
    if len(shape) != 3 or shape[1:] != (channel_lines(d), 128):
        raise ValueError(f"rows of shape {shape} do not fit x's d={d}; expected [n, {channel_lines(d)}, 128] (ffn_layout.output_layout)")
    if rows.scale is not None and tuple(rows.scale.shape) != shape[:1]:
        raise ValueError(f"scale of shape {tuple(rows.scale.shape)} does not fit rows {shape}; expected [{shape[0]}]")
    check_x(x, d)
    return shape[0]


def output_stack(rows: "OutputRows", x: jax.Array) -> tuple[int, jax.Array, jax.Array | None, jax.Array | int]:
    """A row-dot's rows as one matrix, checked against x [B, d]: values [n, L, 128], or with
    ``rows.layer`` a stack [S, n, L, 128] read at that layer -> (n, values [S·n, L, 128] (a
    bitcast: no layer copied out), the layer's scale [n] or None, its first row: layer·n)."""
    if rows.layer is None:
        return check_output_rows(rows, x), rows.values, rows.scale, 0
    if rows.values.ndim != 4:
        raise ValueError(f"rows of shape {tuple(rows.values.shape)} with a layer index: a stack is [S, n, L, 128]")
    layer = jnp.clip(jnp.asarray(rows.layer, jnp.int32), 0, rows.values.shape[0] - 1)
    scale = None if rows.scale is None else jax.lax.dynamic_index_in_dim(rows.scale, layer, keepdims=False)
    n = check_output_rows(OutputRows(jax.ShapeDtypeStruct(rows.values.shape[1:], rows.values.dtype), scale), x)
    return n, rows.values.reshape(-1, *rows.values.shape[2:]), scale, layer * n


class MaskedInputs(NamedTuple):
    """What an input-masked matvec reads: values [S·k, L, 128] (every layer's rows: a reshape),
    this layer's scale [1, L·128] or None, ids [k] (this layer's rows, in input order), keep [k]
    int32 (an input active in any row), xs [k, B] (each row's x where active, else 0)."""

    values: jax.Array
    scale: jax.Array | None
    ids: jax.Array
    keep: jax.Array
    xs: jax.Array


def masked_selection(rows: "InputRows", x: jax.Array, active: jax.Array, out_features: int, layer=None) -> MaskedInputs:
    """An input mask -> `MaskedInputs` (TEAL's sparsity: the positions are the inputs in order, so
    x is neither sorted nor gathered). rows: [k, L, 128], or a stack [S, k, L, 128] read at
    ``layer`` (int32, traced or not, clamped into [0, S)); x [B, k]; active [k] or [B, k] bool."""
    stacked = rows.values.ndim == 4
    values = rows.values if stacked else rows.values[None]
    if values.ndim != 4 or values.shape[-1] != 128 or values.shape[-2] != channel_lines(out_features):
        raise ValueError(
            f"rows of shape {tuple(rows.values.shape)} do not hold {out_features} outputs; expected [k, "
            f"{channel_lines(out_features)}, 128] or a stack [S, k, {channel_lines(out_features)}, 128] (ffn_layout.stacked_input_layout)"
        )
    if stacked and layer is None:
        raise ValueError(f"rows of shape {tuple(rows.values.shape)} are a stack of layers: pass layer=")
    n_layers, k = values.shape[0], values.shape[1]
    check_x(x, k)
    if tuple(active.shape) not in ((k,), tuple(x.shape)):
        raise ValueError(f"active of shape {tuple(active.shape)} does not fit x {tuple(x.shape)}; expected [{k}] or [B, {k}]")
    active = jnp.broadcast_to(active.astype(bool), x.shape)
    layer = jnp.clip(jnp.asarray(0 if layer is None else layer, jnp.int32), 0, n_layers - 1)
    scale = None if rows.scale is None else (rows.scale[layer] if stacked else rows.scale)
    ids = jnp.arange(k, dtype=jnp.int32) + layer * k
    keep = jnp.any(active, axis=0).astype(jnp.int32)
    xs = jnp.where(active, x, jnp.zeros((), x.dtype)).T
    return MaskedInputs(values.reshape(n_layers * k, *values.shape[2:]), scale, ids, keep, xs)


def check_block(block: int, rows: int) -> None:
    """A block-granular read's block size must be a positive divisor of its ``rows`` input rows."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 1 or rows % block:
        raise ValueError(f"block={block!r} does not divide the {rows} input rows; use a positive divisor of {rows}")


def check_x(x: jax.Array, d: int) -> None:
    """x must be [B, d] with 1 <= B <= MAX_BATCH, float32 or bfloat16."""
    if x.ndim != 2 or x.shape[1] != d:
        raise ValueError(f"x of shape {tuple(x.shape)} does not fit the weights; expected [B, {d}]")
    if not 1 <= x.shape[0] <= MAX_BATCH:
        raise ValueError(f"batch {x.shape[0]} is outside the kernels' range; use 1 to {MAX_BATCH} rows")
    if jnp.dtype(x.dtype).name not in X_DTYPES:
        raise ValueError(f"x of dtype {x.dtype} is not supported; use one of {list(X_DTYPES)}")
