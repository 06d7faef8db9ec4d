"""The model's call, typed: what goes in, what the caller's FFN function sees, what comes out.

    model(inputs, *, cache, ffn, layers=None, last_only=False) -> ModelOutput

* ``inputs`` (`ModelInputs`): tokens [B, T], their rotary positions ([B, T], or M-RoPE's
  [3, B, T]) and optionally embeddings placed at some slots (a VLM's image features).
* ``cache`` (`CacheView`): the KV caches of the call (None in prefill: each layer returns its
  fresh keys/values), the key validity [B, S] and the slot the T tokens are written at.
* ``ffn`` (`FFNHook`): one function run at every layer's FFN, ``fn(w, state, x, valid)``, with
  the per-layer states it advances and the token validity its statistics may use. ``w`` is an
  `FFNWeights`: the layer's arrays, its index and (from the caller) the method's data.
* ``layers`` (`LayerControl`, optional): what the caller does to whole layers — layers that
  skip their computation and only project keys/values, virtual layer gates. The caller builds it
  from its own data; the model runs it without knowing who asked.

The model knows no caller, and a caller's FFN function sees no more of the model than `FFNWeights`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Sequence

import jax

LAYER_MODES = ("full", "kv", "none")


class ModelInputs(NamedTuple):
    """tokens [B, T] int32; positions [B, T] (or M-RoPE's [3, B, T]); ``placed`` (optional,
    `models.layers.PlacedEmbeddings`) embeddings that replace some tokens' own."""

    tokens: jax.Array
    positions: jax.Array
    placed: Any = None


class CacheView(NamedTuple):
    """The KV cache one call reads and writes. ``caches``: None (prefill: the call returns each
    layer's fresh keys/values [B, T, n_kv, h]), L × KVCache (unrolled) or the scanned model's
    stacked caches; ``key_valid`` [B, S] (prefill: [B, T]); ``write_index`` the slot of the
    first of the T tokens (shared by every row: batches are left-padded)."""

    caches: Any
    key_valid: jax.Array
    write_index: jax.Array | int = 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FFNWeights:
    """One FFN (or one MoE block) as a method's function receives it.

    gate_up [2, f, d] (gate and up stacked), down [d, f] (HF layout; arrays or `Int8Weight`s),
    down_norm [f] fp32 (‖W_d[:, j]‖₂), layer (the layer index, an int32 scalar: traced in a
    scanned model), block (a MoE block's slot, `MoEConfig.slots`; None in a dense FFN), data (the
    method's calibrated data, [L, ...] leaves, set by the engine for a plan that reads it),
    image_tokens [B, T] (a prefill with images: which tokens are image placeholders).
    ``act`` (static, not a leaf): the gate activation's name (`popjax.ffn.gate_activation`)."""

    gate_up: Any
    down: Any
    down_norm: jax.Array
    layer: jax.Array | int = 0
    block: jax.Array | None = None
    data: Any = None
    image_tokens: jax.Array | None = None
    act: str = dataclasses.field(default="silu", metadata=dict(static=True))

    def replace(self, **changes) -> "FFNWeights":
        return dataclasses.replace(self, **changes)


class FFNStack(NamedTuple):
    """Every layer's FFN weights on a leading layer axis (a dense model of uniform width):
    gate_up [L, 2, f, d] and down [L, d, f] in the compute dtype, or int8 with fp32
    per-output-channel scales gate_up_scale [L, 2, f, 1] and down_scale [L, d, 1] (else None).
    What a method builds a kernel's weight layout from (e.g. input-major rows)."""

    gate_up: jax.Array
    down: jax.Array
    gate_up_scale: jax.Array | None = None
    down_scale: jax.Array | None = None


# fn(w, state, x [B, T, d], valid [B, T] bool) -> (y [B, T, d], state, aux)
FFNFn = Callable[[FFNWeights, Any, jax.Array, jax.Array], tuple[jax.Array, Any, Any]]


class FFNHook(NamedTuple):
    """What runs at every layer's FFN: ``fn`` (one function, or one per layer: e.g. a boundary
    step that prefills the layers that skipped prefill), ``states`` (None before the first call,
    else L states or one stacked state) and ``valid`` [B, T] (real tokens of live rows: no
    statistic may include another; a MoE expert narrows it to its routed tokens)."""

    fn: FFNFn | Sequence[FFNFn]
    states: Any
    valid: jax.Array

    def at(self, i: int) -> FFNFn:
        """Layer i's function."""
        return self.fn[i] if isinstance(self.fn, (list, tuple)) else self.fn


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerControl:
    """What a method does to whole layers in one call (built by the method's plan).

    ``modes[i]`` (static): "full" (the layer runs), "kv" (it only writes keys/values projected
    from its input; the residual stream passes through) or "none" (it passes the stream through
    and writes zero keys/values). ``prefix_masked`` (static): layers whose attention ignores the
    cache slots before ``prefix_end`` (the slots a "none" layer never wrote). ``kv_weights``
    maps a "kv" layer to the projection it uses instead of its own k/v rows: (w [n_kv, 2, h, d],
    bias [n_kv, 2, h] or None), in qkv's grouped layout. ``gates`` [L, B, T] scale both residual
    branches of each layer (a virtual layer gate whose gradient is the layer's importance)."""

    modes: tuple[str, ...] | None = dataclasses.field(default=None, metadata=dict(static=True))
    prefix_masked: frozenset[int] = dataclasses.field(default=frozenset(), metadata=dict(static=True))
    prefix_end: jax.Array | int = 0
    kv_weights: dict[int, tuple[jax.Array, jax.Array | None]] | None = None
    gates: jax.Array | None = None

    def __post_init__(self):
        bad = sorted({m for m in self.modes or () if m not in LAYER_MODES})
        if bad:
            raise ValueError(f"layer modes {bad} are not among {LAYER_MODES}")

    def mode(self, i: int) -> str:
        return "full" if self.modes is None else self.modes[i]

    def replace(self, **changes) -> "LayerControl":
        return dataclasses.replace(self, **changes)

    def decode_view(self, prefix_end) -> "LayerControl | None":
        """This (prefill) control as a decode step runs it: every layer runs; the layers that
        wrote nothing in prefill keep ignoring the slots before ``prefix_end`` (None if none)."""
        return LayerControl(prefix_masked=self.prefix_masked, prefix_end=prefix_end) if self.prefix_masked else None

    def describe(self) -> str:
        """What in this control treats layers differently, in words (for errors)."""
        parts = []
        if self.modes is not None and set(self.modes) != {"full"}:
            parts.append(f"layer modes {self.modes}")
        if self.prefix_masked:
            parts.append(f"prefix-masked layers {sorted(self.prefix_masked)}")
        if self.kv_weights:
            parts.append(f"kv_weights for layers {sorted(self.kv_weights)}")
        if self.gates is not None:
            parts.append(f"gates of shape {tuple(self.gates.shape)}")
        return ", ".join(parts) or "a uniform control"

    @property
    def uniform(self) -> bool:
        """Whether every layer runs alike (a scanned model can run only such a control)."""
        return (self.modes is None or set(self.modes) == {"full"}) and not self.prefix_masked and not self.kv_weights \
            and self.gates is None


class ModelOutput(NamedTuple):
    """logits [B, T or 1, V] fp32; caches (as ``CacheView.caches``, or prefill's fresh keys/values);
    ffn_states (L states, or one stacked); aux (a list over layers, or stacked by a scan)."""

    logits: jax.Array
    caches: Any
    ffn_states: Any
    aux: Any
