"""Static ablation (POP paper Table 6, variant 1; ≈ GRIFFIN with POP's metric; SPEC §2).

The top n_keep channels by prefill importance are fixed for the whole generation; their
gate/up columns and down rows are gathered once at prefill.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar


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
    take_channels,
    take_gate_up,
)
from .dense import DensePlan


@dataclasses.dataclass(frozen=True)
class StaticPlan(Plan):
    name: ClassVar[str] = "static"
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
        y, order, importance = score_prompt(w, x, valid, self.n_keep)
        kept = order[: self.n_keep]
        state = {
            "kept_idx": kept,  # [n_keep]
            "gate_up": take_gate_up(w["gate_up"], kept),  # [2 n_keep, d]
            "down": take_channels(w["down"], kept, axis=1),  # [d, n_keep]
        }
        return y, state, {"importance": importance}

    def _decode(self, w, state, x, step):
        return down_proj(activations(state["gate_up"], x), state["down"]), state, {}

    def ffn_flops_per_token(self, d: int) -> int:
        return 6 * d * self.n_keep


@dataclasses.dataclass(frozen=True)
class Static(Method):
    """Prefill-fixed structured pruning: top n_keep channels by prompt importance, kept for good."""

    name: ClassVar[str] = "static"
    ratio: float = 0.2
    aggregate: str = "shared"

    def __post_init__(self):
        check_global_ratio(self.ratio)
        check_aggregate(self.aggregate)

    def bind(self, cfg: ModelConfig) -> Plan:
        f, n_keep = cfg.intermediate_size, kept_channels(cfg, self.ratio)
        if n_keep == f:
            return DensePlan(f=f, n_keep=f)
        return StaticPlan(f=f, n_keep=n_keep, aggregate=self.aggregate)
