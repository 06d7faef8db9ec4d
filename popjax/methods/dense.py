"""Dense: no pruning. Every method binds to this plan when its ratio keeps all channels."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from ..models.config import ModelConfig
from .base import Method, Plan, activations, down_proj


def dense_mlp(w, x):
    """The full MLP, plus the down bias of a FLAP-pruned checkpoint when it has one."""
    y = down_proj(activations(w["gate_up"], x), w["down"])
    return y if w.get("down_bias") is None else y + w["down_bias"]


@dataclasses.dataclass(frozen=True)
class DensePlan(Plan):
    name: ClassVar[str] = "dense"

    def prefill(self, w, x, valid):
        """x [B, T, d] -> (y [B, T, d], no state, no aux)."""
        return dense_mlp(w, x), None, {}

    def decode(self, w, state, x, step, valid):
        return dense_mlp(w, x), state, {}

    def ffn_flops_per_token(self, d: int) -> int:
        return 6 * d * self.f

    def ffn_weights_read(self, d: int) -> int:
        return 3 * d * self.f


@dataclasses.dataclass(frozen=True)
class Dense(Method):
    """The unpruned model."""

    name: ClassVar[str] = "dense"

    def bind(self, cfg: ModelConfig) -> Plan:
        return DensePlan(f=cfg.intermediate_size, n_keep=cfg.intermediate_size)
