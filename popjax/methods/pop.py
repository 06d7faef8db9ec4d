"""POP — Partition-guided Online Pruning (arXiv 2602.06822; SPEC §2).

Prefill ranks every FFN channel by ``I_j = ‖H[S, j]‖₂ · ‖W_d[:, j]‖₂`` over the prompt and splits
the channels into

    R  retained   the top n_R = n_keep − m           always used
    C  candidate  the next n_C = 2m (straddling the cut)  m of them chosen per decode step
    P  pruned     the rest                          never used again

with ``m = min(round(γ·f/2), f − n_keep, n_keep)``. The prompt's own output uses the top
``n_keep`` channels. At decode step t only R ∪ C enter gate/up; the step scores the candidates
by ``|H_t[c]| · ‖W_d[:, c]‖₂``, takes ``S_t = top_m`` with ``lax.top_k`` and computes
``y_t = H_t[R] W_d[R] + H_t[S_t] W_d[S_t]`` — exactly n_keep channels.

Speed: the gate/up columns of R ∪ C and the down rows of R and of C are gathered once at
prefill into the partition state; a decode step runs dense matmuls on those compact blocks and
gathers only the m selected down rows.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax

from .base import (
    AggregatedPlan,
    RatioMethod,
    activations,
    check_gamma,
    down_proj,
    round_half_up,
    score_prompt,
    step_importance,
    take_channels,
    take_gate_up,
)


@dataclasses.dataclass(frozen=True)
class POPPlan(AggregatedPlan):
    name: ClassVar[str] = "pop"
    m: int = 0  # candidates selected per step

    @property
    def n_retained(self) -> int:
        return self.n_keep - self.m

    @property
    def n_candidates(self) -> int:
        return 2 * self.m

    def _prefill(self, w, x, valid):
        """x [B, T, d], valid [B, T] -> (y [B, T, d], partition state, {"importance": [f]})."""
        y, order, importance = score_prompt(w, x, valid, self.n_keep)
        n_r, n_c = self.n_retained, self.n_candidates
        retained, candidates = order[:n_r], order[n_r : n_r + n_c]
        kept = order[: n_r + n_c]
        state = {
            "retained_idx": retained,  # [n_R]
            "candidate_idx": candidates,  # [n_C]
            "gate_up": take_gate_up(w["gate_up"], kept),  # [2(n_R + n_C), d]
            "down_retained": take_channels(w["down"], retained, axis=1),  # [d, n_R]
            # rows, so that a step gathers its m selected channels contiguously
            "down_candidates": take_channels(w["down"], candidates, axis=1).T,  # [n_C, d]
            "down_norm_candidates": take_channels(w["down_norm"], candidates, axis=0),  # [n_C]
        }
        return y, state, {"importance": importance}

    def _decode(self, w, state, x, step, valid):
        """x [B, 1, d] -> (y [B, 1, d], state (unchanged), {"selected", "scores": [m]})."""
        h = activations(state["gate_up"], x)  # [B, 1, n_R + n_C]
        h_retained, h_candidates = h[..., : self.n_retained], h[..., self.n_retained :]
        y = down_proj(h_retained, state["down_retained"])
        if self.m == 0:
            return y, state, {}
        scores = step_importance(h_candidates, valid, state["down_norm_candidates"])  # [n_C]
        top_scores, selected = jax.lax.top_k(scores, self.m)  # S_t, positions within C
        y = y + take_channels(h_candidates, selected, axis=-1) @ take_channels(
            state["down_candidates"], selected, axis=0
        )
        aux = {"selected": take_channels(state["candidate_idx"], selected, axis=0), "scores": top_scores}
        return y, state, aux

    def ffn_flops_per_token(self, d: int) -> int:
        return 4 * d * (self.n_retained + self.n_candidates) + 2 * d * self.n_keep

    def ffn_weights_read(self, d: int) -> int:
        return 2 * d * (self.n_retained + self.n_candidates) + d * self.n_keep


@dataclasses.dataclass(frozen=True)
class POP(RatioMethod):
    """Partition-guided Online Pruning: ``POP(ratio=0.2, gamma=0.1, aggregate="shared")``.

    Args:
      ratio: global fraction of decoder parameters removed, in [0, 1); all of it comes from the
        FFN (SPEC §1), attention is never pruned.
      gamma: width of the candidate band as a fraction of f, in [0, 1] (paper default 0.1).
      aggregate: "shared" (the paper: one partition and one selection per batch) or
        "per_sequence" (each sequence its own; results independent of batch composition).
    """

    name: ClassVar[str] = "pop"
    plan_class: ClassVar[type] = POPPlan
    gamma: float = dataclasses.field(default=0.1, kw_only=True)

    def __post_init__(self):
        super().__post_init__()
        check_gamma(self.gamma)

    def plan_sizes(self, f: int, n_keep: int) -> dict[str, int]:
        return {"m": min(round_half_up(self.gamma * f / 2), f - n_keep, n_keep)}
