"""Fully dynamic ablation (POP paper Table 6, variant 2; SPEC §2).

Every decode step computes H_t on all f channels and keeps the top n_keep by
``‖H_t[:, j]‖₂ · ‖W_d[:, j]‖₂``. The prompt is processed like POP's prefill (top n_keep by
prompt importance), so the three variants differ only in decoding.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from ..models.config import ModelConfig
from .base import (
    Method,
    Plan,
    activations,
    down_proj,
    check_aggregate,
    check_global_ratio,
    decode_per_sequence,
    kept_channels,
    prefill_per_sequence,
    score_prompt,
    step_importance,
    take_channels,
)
from .dense import DensePlan


@dataclasses.dataclass(frozen=True)
class DynamicPlan(Plan):
    name: ClassVar[str] = "dynamic"
    aggregate: str = "shared"

    def prefill(self, w, x, valid):
        if self.aggregate == "per_sequence":
            return prefill_per_sequence(self._prefill, w, x, valid)
        return self._prefill(w, x, valid)

    def decode(self, w, state, x, step):
        if self.aggregate == "per_sequence":
            return decode_per_sequence(self._decode, w, state, x, step)
        return self._decode(w, state, x, step)

    def _prefill(self, w, x, valid):
        y, _, importance = score_prompt(w, x, valid, self.n_keep)
        # A zero-size placeholder keeps the state a (vmappable) array pytree.
        return y, jnp.zeros((0,), jnp.int32), {"importance": importance}

    def _decode(self, w, state, x, step):
        h = activations(w["gate_up"], x)  # [B, 1, f]
        scores = step_importance(h, w["down_norm"])  # [f]
        _, selected = jax.lax.top_k(scores, self.n_keep)
        y = down_proj(take_channels(h, selected, axis=-1), take_channels(w["down"], selected, axis=1))
        return y, state, {"scores": scores}

    def ffn_flops_per_token(self, d: int) -> int:
        return 4 * d * self.f + 2 * d * self.n_keep


@dataclasses.dataclass(frozen=True)
class Dynamic(Method):
    """Re-selects the top n_keep of all channels at every decode step (the accuracy ceiling)."""

    name: ClassVar[str] = "dynamic"
    ratio: float = 0.2
    aggregate: str = "shared"

    def __post_init__(self):
        check_global_ratio(self.ratio)
        check_aggregate(self.aggregate)

    def bind(self, cfg: ModelConfig) -> Plan:
        f, n_keep = cfg.intermediate_size, kept_channels(cfg, self.ratio)
        if n_keep == f:
            return DensePlan(f=f, n_keep=f)
        return DynamicPlan(f=f, n_keep=n_keep, aggregate=self.aggregate)
