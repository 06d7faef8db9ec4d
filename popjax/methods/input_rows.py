"""The decode FFN of the methods that mask the MLP's inputs per token (TEAL, WINA, principal
TEAL's residual) through a Pallas kernel that reads only the kept inputs' weight rows
(docs/kernels.md, "TEAL's wiring").

A zero input skips a *column* of the weights, so the kernel reads them input-major (row i =
the column input i multiplies), as TEAL's own Triton kernel reads W's transpose. A step is two
calls of `popjax.kernels.decode_ffn.masked_matvec`:

    gu = masked_matvec(x, rows["gate_up"], keep_x, out_features=2f, layer=l)   # gate, then up
    H  = act(gu[:, :f]) ⊙ gu[:, f:]
    y  = masked_matvec(H, rows["down"], keep_h, out_features=d, layer=l)

``rows`` (`input_rows_data`) are every layer's FFN weights in that layout, a second copy of
them built once per model and passed into the compiled programs as the method's data: the
decode step reads the copies, prefill (dense) the model's own. A method with a ``kernel``
hyper-parameter resolves it with `resolve_kernel` and calls `kernel_activations` and
`kernel_down` where its XLA path multiplies masked inputs by the dense weights. Dynamic POP,
which masks only H, the down projection's input, asks for the down copy alone.

CATS keeps a channel by its gate value, so it computes the gate densely and then needs, for the
kept channels only, their *rows* of W_u (an output each) and of W_d: `kernel_gated_ffn` reads
them from `up_down_rows_data`, every layer's up and down rows as channel rows
(`ffn_layout.stacked_up_down_layout`), through `kernels.decode_ffn.gated_ffn`.

Block static keeps whole blocks of channels for a whole generation, so its step reads gate, up
and down of those blocks only: `kernel_block_ffn` from `block_slab_data`, every layer's FFN in
blocks (`kernels.block_slab.stacked_block_layout`), through `kernels.decode_ffn.block_ffn`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from .. import kernels
from ..kernels.block_slab import BlockSlab, stacked_block_layout
from ..kernels.decode_ffn import block_ffn, block_matvec, gated_ffn, masked_matvec
from ..kernels.ffn_layout import ChannelRows, InputRows, channel_lines, stacked_input_layout, stacked_up_down_layout
from ..loaded import uniform_ffn
from ..models.config import ModelConfig
from ..models.interface import FFNStack
from .base import MethodError, gate_activation
from .fitted import array_digest


def resolve_kernel(method: str, kernel: str, cfg: ModelConfig) -> str:
    """A method's ``kernel`` ("auto", "xla", "pallas") -> what its decode step runs
    (`popjax.kernels.RESOLVED`): "auto" is XLA on a CPU and on a model without one stack of equal
    dense FFNs (a mixture of experts, per-layer widths), where "pallas" is a MethodError."""
    uniform = uniform_ffn(cfg)
    if kernel == "pallas" and not uniform:
        raise MethodError(f"{method}: kernel='pallas' reads a stack of equal dense FFN weights, which this {cfg.model_type} "
                          "model (mixture-of-experts or per-layer widths) does not have; use kernel='xla' or 'auto'")
    return kernels.choose(kernel) if uniform else "xla"


ROW_PARTS = ("gate_up", "down")  # the copies `input_rows_data` builds, each on its own


def input_rows_data(model, parts: tuple[str, ...] = ROW_PARTS) -> dict[str, InputRows]:
    """The model's FFN weights in the kernel's layout (`input_major_rows`), the copies ``parts``
    of `ROW_PARTS` only, each built once per model (``model.derived``; shared by every method
    that reads it) and, on a mesh, replicated: every device runs the kernel on whole copies
    (`kernels.decode_ffn.per_device`), placed once here so that no step gathers them."""
    stacked = []  # the model's FFN stack, made at most once per call (a copy for an unrolled model)

    def build(part):
        def one(m):
            if not stacked:
                stacked.append(m.ffn_stack())
            return replicated(m, input_major_rows(stacked[0], (part,))[part])

        return model.derived(f"input_major_{part}", one)

    return model.derived("input_major_rows/" + "+".join(parts), lambda m: {part: build(part) for part in parts})


def in_order(stack: FFNStack, order) -> FFNStack:
    """Every layer's FFN with its channels in ``order`` [L, f] (channel j of layer l = the
    model's channel order[l, j]; None: the stack as it is): gate/up rows and down columns alike."""
    if order is None:
        return stack
    o = jnp.asarray(order)  # [L, f]
    gate_up = jnp.take_along_axis(stack.gate_up, o[:, None, :, None], axis=2)  # [L, 2, f, d]
    down = jnp.take_along_axis(stack.down, o[:, None, :], axis=2)  # [L, d, f]
    scale = None if stack.gate_up_scale is None else jnp.take_along_axis(stack.gate_up_scale, o[:, None, :, None], axis=2)
    return FFNStack(gate_up, down, scale, stack.down_scale)  # down's scales are per output: unchanged


def ordered_down_rows(model, order) -> InputRows:
    """W_d's input-major copy (`input_rows_data`'s "down") with each layer's rows in ``order``
    [L, f] (row j of layer l = channel order[l, j]): block dynamic's in a calibrated order."""
    def build(m):
        stack = in_order(m.ffn_stack(), order)
        return replicated(m, stacked_input_layout(stack.down, stack.down_scale))

    return model.derived(f"input_major_down/{array_digest(order)[:16]}", build)


def up_down_rows_data(model) -> ChannelRows:
    """Every layer's up and down rows as `ffn_layout.stacked_up_down_layout` [2, L, f, L_d, 128]
    (int8: up's and down's scales), built once per model and, on a mesh, replicated (as
    `input_rows_data`): 2/3 of the FFN weights again, which CATS's kernel steps read."""
    def build(m):
        stack = m.ffn_stack()
        scales = (None, None) if stack.gate_up_scale is None else (stack.gate_up_scale[:, 1], stack.down_scale)
        return replicated(m, stacked_up_down_layout(stack.gate_up[:, 1], stack.down, *scales))

    return model.derived("up_down_rows", build)


def block_slab_data(model, block: int, order=None) -> BlockSlab:
    """Every layer's FFN weights in blocks of ``block`` channels, values [L, f/b, 3, b, d] (int8:
    their scales), the channels of each layer in ``order`` [L, f] (None: the model's), built once
    per model, block size and order and, on a mesh, replicated (as `input_rows_data`): a second
    copy of the FFN weights, which block static's kernel steps read."""
    def build(m):
        stack = in_order(m.ffn_stack(), order)
        return replicated(m, stacked_block_layout(stack.gate_up, stack.down, block, stack.gate_up_scale, stack.down_scale))

    name = "model" if order is None else array_digest(order)[:16]
    return model.derived(f"block_slab/{block}/{name}", build)


def kernel_block_ffn(w, x: jax.Array, blocks: jax.Array, *, kernel: str) -> jax.Array:
    """The layer's FFN over whole blocks of channels: x [B, 1, d], blocks [k] (every row's) or
    [B, k] (each row its own) -> [B, 1, d], from those blocks of the layer's slab
    (``w.data["slab"]``, `block_slab_data`) only."""
    return block_ffn(x[:, 0], w.data["slab"], blocks, layer=w.layer, act=w.act, kernel=kernel)[:, None]


def replicated(model, rows):
    """A copy of weights in a kernel's layout as every device holds it: on ``model``'s mesh
    replicated (placed once, so that no step gathers it), else as it is."""
    return rows if model.mesh is None else jax.device_put(rows, NamedSharding(model.mesh, PartitionSpec()))


def float_gate_up(stack: FFNStack) -> jax.Array:
    """Every layer's gate/up as float32 [L, 2f, d] (gate rows, then up rows), int8 dequantized:
    what a copy that folds a rotation or a basis into the weights starts from."""
    L, _, f, d = stack.gate_up.shape
    w = stack.gate_up.astype(jnp.float32) * (1.0 if stack.gate_up_scale is None else stack.gate_up_scale)
    return w.reshape(L, 2 * f, d)


def kernel_gated_ffn(w, x: jax.Array, gate: jax.Array, keep: jax.Array, *, expected_active: int, kernel: str) -> jax.Array:
    """y = W_d · (gate ⊙ W_u x where keep): x [B, 1, d], the gate values gate [B, 1, f] and
    keep broadcastable to them -> [B, 1, d], from the kept channels' up and down rows of the
    layer's copy (``w.data["up_down"]``)."""
    return gated_ffn(x[:, 0], w.data["up_down"], _mask(keep, gate), gate[:, 0], layer=w.layer, act=w.act,
                     expected_active=expected_active, kernel=kernel)[:, None]


def input_major_rows(stack: FFNStack, parts: tuple[str, ...] = ROW_PARTS) -> dict[str, InputRows]:
    """Every layer's FFN in `ffn_layout.stacked_input_layout`: "gate_up" as one matrix [2f, d]
    (outputs gate then up), values [L, d, L_gu, 128], and "down", values [L, f, L_d, 128]; int8
    keeps the per-output-channel scales ([L, 1, L·128]). ``parts``: which of the two."""
    L, _, f, d = stack.gate_up.shape
    out = {}
    if "gate_up" in parts:
        gate_up_scale = None if stack.gate_up_scale is None else stack.gate_up_scale.reshape(L, 2 * f, 1)
        out["gate_up"] = stacked_input_layout(stack.gate_up.reshape(L, 2 * f, d), gate_up_scale)
    if "down" in parts:
        out["down"] = stacked_input_layout(stack.down, stack.down_scale)
    return out


def kernel_gate_up(w, x: jax.Array, keep_x: jax.Array, *, f: int, expected_active: int, kernel: str) -> jax.Array:
    """x W_guᵀ over x's kept inputs only: x [B, 1, d], keep_x broadcastable to it -> [B, 1, 2f]
    (gate, then up), from the kept rows of the layer's input-major gate/up copy
    (``w.data["rows"]``). ``expected_active``: the inputs kept at the method's target, for the
    TPU compiler's cost estimate."""
    return masked_matvec(x[:, 0], w.data["rows"]["gate_up"], _mask(keep_x, x), out_features=2 * f, layer=w.layer,
                         expected_active=expected_active, kernel=kernel)[:, None]


def kernel_activations(w, x: jax.Array, keep_x: jax.Array, *, f: int, expected_active: int, kernel: str) -> jax.Array:
    """H = act(x W_gᵀ) ⊙ x W_uᵀ over x's kept inputs only (`kernel_gate_up`) -> [B, 1, f]."""
    return gated(w, kernel_gate_up(w, x, keep_x, f=f, expected_active=expected_active, kernel=kernel), f)


def gated(w, gu: jax.Array, f: int) -> jax.Array:
    """[..., 2f] gate then up -> H = act(gate) ⊙ up [..., f] (the layer's activation)."""
    return gate_activation(w)(gu[..., :f]) * gu[..., f:]


def kernel_down(w, h: jax.Array, keep_h: jax.Array, *, d: int, expected_active: int, kernel: str) -> jax.Array:
    """y = W_d · (H where keep_h): h [B, 1, f] -> [B, 1, d], from the kept channels' rows of the
    layer's input-major down copy."""
    return masked_matvec(h[:, 0], w.data["rows"]["down"], _mask(keep_h, h), out_features=d, layer=w.layer,
                         expected_active=expected_active, kernel=kernel)[:, None]


def kernel_down_blocks(w, h: jax.Array, blocks: jax.Array, *, block: int, d: int, kernel: str) -> jax.Array:
    """y = W_d · H over the channels of whole ``blocks`` [nb] of ``block`` consecutive channels:
    h [B, 1, f] -> [B, 1, d], each block's rows of the layer's input-major down copy fetched as
    one contiguous piece (`kernels.decode_ffn.block_matvec`)."""
    return block_matvec(h[:, 0], w.data["rows"]["down"], blocks, block=block, out_features=d, layer=w.layer, kernel=kernel)[:, None]


def kernel_weights_read(kernel: str, d: int, f: int, inputs: float, channels: float) -> int:
    """Weight elements a step reads with ``inputs`` of x's d entries and ``channels`` of H's f
    kept: 2f·inputs + d·channels; the TPU kernel (and interpret mode) reads each row whole, its
    L·128 lanes (`ffn_layout.channel_lines`: 2f and d exactly on the 8B)."""
    if kernel in kernels.TPU_KERNELS:
        return round((inputs * channel_lines(2 * f) + channels * channel_lines(d)) * 128)
    return round(2 * f * inputs + d * channels)


def _mask(keep: jax.Array, v: jax.Array) -> jax.Array:
    """A keep mask broadcastable to v [B, 1, n] -> the kernel's [B, n]."""
    return jnp.broadcast_to(keep, v.shape)[:, 0]
