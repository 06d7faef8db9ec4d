"""Fully dynamic ablation (POP paper Table 6, variant 2; docs/methods.md §2).

Every decode step computes H_t on all f channels and keeps the top n_keep by
``‖H_t[:, j]‖₂ · ‖W_d[:, j]‖₂``. The prompt is processed like POP's prefill (top n_keep by
prompt importance), so the three variants differ only in decoding.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from .base import gate_activation, AggregatedPlan, RatioMethod, activations, down_proj, score_prompt, step_importance, take_channels


@dataclasses.dataclass(frozen=True)
class DynamicPlan(AggregatedPlan):
    name: ClassVar[str] = "dynamic"
    compact_weights: ClassVar[bool] = False  # reads the model's own weights every step

    def _prefill(self, w, x, valid):
        y, _, importance = score_prompt(w, x, valid, self.n_keep)
        # A zero-size placeholder keeps the state a (vmappable) array pytree.
        return y, jnp.zeros((0,), jnp.int32), {"importance": importance}

    def _decode(self, w, state, x, step, valid):
        h = activations(w.gate_up, x, gate_activation(w))  # [B, 1, f]
        scores = step_importance(h, valid, w.down_norm)  # [f]
        _, selected = jax.lax.top_k(scores, self.n_keep)
        y = down_proj(take_channels(h, selected, axis=-1), take_channels(w.down, selected, axis=1))
        return y, state, {"scores": scores}

    def ffn_flops_per_token(self, d: int) -> int:
        return 4 * d * self.f + 2 * d * self.n_keep

    def ffn_weights_read(self, d: int) -> int:
        return 2 * d * self.f + d * self.n_keep


@dataclasses.dataclass(frozen=True)
class Dynamic(RatioMethod):
    """Re-selects the top n_keep of all channels at every decode step (the accuracy ceiling of
    POP at a much higher cost). ``Dynamic(ratio, aggregate="per_sequence" | "shared")``."""

    name: ClassVar[str] = "dynamic"
    plan_class: ClassVar[type] = DynamicPlan
