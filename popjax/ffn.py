"""The contract between the engine and the pruning methods: the plan protocol and the FFN math
every plan shares.

A method (popjax.methods) resolves for one model into a *plan*: a frozen, hashable dataclass of
static sizes (a jit static argument) with two pure functions the engine calls at every layer's
FFN:

    plan.prefill(w, x [B, T, d], valid [B, T]) -> (y [B, T, d], state, aux)
    plan.decode(w, state, x_t [B, 1, d], step, valid [B, 1]) -> (y_t [B, 1, d], state, aux)

and, for methods that act on whole layers, a `LayerControl` (``plan.layer_control(L, data)``:
what each layer does in prefill — "full", "kv" (only project keys/values) or "none" — and the
projections it uses; models.interface). The engine imports this module and never a method; the
methods implement it (docs/architecture.md).

``valid`` marks real tokens: padding in prefill, and in decode the rows of a padded batch
bucket or of sequences that have already stopped (a MoE expert: the tokens routed to it); no
statistic may include an invalid entry. ``step`` is the int32 index of the decode-path call (0
for the first token fed after prefill). ``w`` is a `models.interface.FFNWeights`: ``gate_up
[2, f, d]`` (gate and up stacked), ``down [d, f]`` (HF layout), ``down_norm [f]`` (‖W_d[:, j]‖₂,
computed once per model), ``layer`` (the layer index, an int32 scalar, for per-layer calibrated
constants), ``block`` (a MoE block's slot), ``data`` (the method's calibrated data) and ``act``
(the model's gate activation, a name in ``models.config.FFN_ACTIVATIONS``, static: read through
`gate_activation`). Every method computes H = act(x W_gᵀ) ⊙ x W_uᵀ with it (SwiGLU for
LLaMA/Qwen, GeGLU for Gemma); none branches on the architecture. A structurally pruned
checkpoint's down bias is added by the layer, never by a method. ``aux`` is introspection data;
the engine drops it unless asked, and XLA then removes its computation.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, ClassVar

import jax

from .models.interface import FFNWeights, LayerControl
from .kernels.int8 import dot
from .sharding import split_channels


@dataclasses.dataclass(frozen=True)
class Plan:
    """A method resolved for one model: static sizes plus the prefill/decode functions."""

    name: ClassVar[str] = "plan"
    f: int  # intermediate size
    n_keep: int  # channels used per token

    def prefill(self, w, x, valid):  # pragma: no cover - interface
        raise NotImplementedError

    def decode(self, w, state, x, step, valid):  # pragma: no cover - interface
        raise NotImplementedError

    def ffn_flops_per_token(self, d: int) -> int:
        """Analytic FFN FLOPs per decode token per layer (2 per multiply-add), docs/methods.md §2."""
        raise NotImplementedError  # pragma: no cover - interface

    def ffn_weights_read(self, d: int) -> int:
        """FFN weight elements one decode step reads per layer (for the memory roofline)."""
        raise NotImplementedError  # pragma: no cover - interface

    def ffn_weights_read_per_step(self, d: int, batch: int) -> int:
        """FFN weight elements a decode step of ``batch`` rows reads per layer: the shared
        weights once, unless the plan keeps a compact copy per sequence (see AggregatedPlan)."""
        return self.ffn_weights_read(d)

    # Layer-level hooks, consulted by the engine; the defaults describe a method that acts only
    # inside each layer's FFN (docs/methods.md §6).
    def layer_control(self, n_layers: int, data=None) -> LayerControl | None:
        """What the method does to whole layers in prefill (`models.interface.LayerControl`, built
        from the plan and the method's calibrated ``data``); None = every layer runs. Decode runs
        every layer and keeps only the control's prefix masks (`LayerControl.decode_view`)."""
        return None

    @property
    def state_per_sequence(self) -> bool:
        """Whether the method state holds one entry per sequence (a leading batch axis on every
        leaf): the plan declares an ``aggregate`` of "per_sequence"."""
        return any(f.name == "aggregate" for f in dataclasses.fields(self)) and self.aggregate == "per_sequence"

    @property
    def requires_data(self) -> bool:
        """Whether the plan reads the prepared method's calibrated data (`Method.data`), which
        the engine then must receive."""
        return False

    # Whether the last prompt token skips prefill and runs the full model as the first
    # decode-path step (Prefill-Only Pruning's boundary token); a plan may make it a field.
    boundary: ClassVar[bool] = False


# ---------------------------------------------------------------- FFN math shared by every plan


def gate_and_up(gate_up: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(x W_gᵀ, x W_uᵀ) in one dot: x [..., d], gate_up [2, n, d] -> ([..., n], [..., n]).

    Without a mesh the dot reads gate_up as the [2n, d] matrix it is in memory (a free
    reshape): XLA:CPU compiles dots over the [2, n, d] operand with transposes, of the weights
    (output [..., 2, n]: 3x the bytes) or of the output (output [2, ..., n]: +34% time at
    prefill); benchmarks/gate_up_layout_bench.py. On a mesh it contracts [2, n, d] directly: the
    reshape would merge the split f axis with the (gate, up) axis, a layout XLA can only reach
    by re-sharding the weights."""
    if split_channels() > 1:
        gu = dot("...d,gnd->g...n", x, gate_up)
        return gu[0], gu[1]
    n = gate_up.shape[1]
    gu = dot("...d,nd->...n", x, gate_up.reshape(2 * n, gate_up.shape[2]))
    return gu[..., :n], gu[..., n:]


# models.config.FFN_ACTIVATIONS -> the function. Both map 0 to 0, so a zero-padded channel
# contributes exactly 0 (act(0)·0 = 0) under either.
_GATE_ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": lambda g: jax.nn.gelu(g, approximate=True),
}


def gate_activation(w: FFNWeights) -> Callable[[jax.Array], jax.Array]:
    """The gate activation of the layer whose FFN weights are ``w`` (``w.act``)."""
    return _GATE_ACTIVATIONS[w.act]


def activations(gate_up: jax.Array, x: jax.Array, act: Callable[[jax.Array], jax.Array] = jax.nn.silu) -> jax.Array:
    """H = act(x W_gᵀ) ⊙ (x W_uᵀ): x [..., d], gate_up [2, n, d] -> [..., n]; ``act`` is
    `gate_activation(w)` of the layer (SiLU by default)."""
    gate, up = gate_and_up(gate_up, x)
    return act(gate) * up


def down_proj(h: jax.Array, down: jax.Array) -> jax.Array:
    """h [..., n] with down [d, n] -> [..., d]."""
    return dot("...n,dn->...d", h, down)
