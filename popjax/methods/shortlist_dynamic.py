"""Shortlisted dynamic selection: every channel is a candidate, a cheap estimate shortlists them,
exact scores choose (issue 15; docs/frontier_methods.md §5).

Shortlisted POP (shortlist.py) can only choose inside POP's band, and at its widest band POP
already scores almost every channel exactly, so there it can at best tie POP; dynamic selection,
which also reaches the prompt's bottom channels, is 0.06 nats better on held-out text at 40%.
This method keeps no prefill partition. At decode step t, over all f channels:

    g       = x_t W_gᵀ                                        every gate row (d·f bytes)
    a_t[j]  = ‖silu(g_j)‖₂ · û_j · ‖W_d[:, j]‖₂                 the estimate of dynamic's score
    L_t     = top_s of a_t                                    the shortlist (``lax.top_k``)
    H_t[L]  = silu(g_L) ⊙ x_t W_u[L]ᵀ                         up rows of the shortlist (d·s)
    S_t     = top_{n_keep} over L of ‖H_t[c]‖₂ · ‖W_d[:, c]‖₂  dynamic's exact score
    y_t     = H_t[S_t] W_d[:, S_t]ᵀ                           down columns of the selection

(‖·‖₂ over the batch's valid rows, as in POP.) The **up prior** û is computed once at prefill
from the prompt's valid tokens: the gate alone says whether a channel opens, the prior says how
large its up projection tends to be in this prompt, so a_t estimates ‖H_t[j]‖₂·‖W_d[:, j]‖₂ for
no extra bytes per step. ``prior="up"`` (default): û_j = ‖U[:, j]‖₂, the norm of the channel's up
projection over the prompt; ``"gated_up"``: û_j = ‖H[:, j]‖₂ / ‖silu(G[:, j])‖₂, the up magnitude
weighted by how far the gate opens (measured worse, docs/frontier.md); ``"none"``: û = 1
(shortlist by gate-scored POP's score). The last two are ablations.

Sizes: ``s = round(σ·f)`` clipped to ``[n_keep, f]`` for ``shortlist=σ``. Weights read per decode
token and layer: ``d·f + d·s + d·n_keep``. σ = 1 is dynamic (exact scores on every channel, at
dynamic's ``2d·f + d·n_keep``); s = n_keep is selection by the estimate alone. The prompt's own output is dynamic's
(top n_keep channels by prompt importance). No weights are copied at prefill: a step reads the
model's own matrices, so the state is only ``prior [f]`` = û ⊙ ‖W_d‖ (per sequence: ``[B, f]``).

Ties: ``lax.top_k`` keeps the lower channel id for the shortlist and the earlier shortlist
position for the selection.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from .base import (
    AggregatedPlan, MethodError, RatioMethod, masked_down, prefill_importance, rank_channels, round_half_up, step_importance,
    gate_and_up, take_channels,
)
from .gate_scored import gate_scores

PRIORS = ("up", "gated_up", "none")


@dataclasses.dataclass(frozen=True)
class ShortlistDynamicPlan(AggregatedPlan):
    name: ClassVar[str] = "dynamic-shortlist"
    compact_weights: ClassVar[bool] = False  # reads the model's own weights every step
    s: int = 0  # channels shortlisted per step, n_keep ≤ s ≤ f
    prior: str = "up"

    def _prefill(self, w, x, valid):
        """x [B, T, d], valid [B, T] -> (y [B, T, d], {"prior": [f]}, {"importance": [f]})."""
        gate, up = gate_and_up(w["gate_up"], x)  # [B, T, f] each
        gate = jax.nn.silu(gate)
        h = gate * up
        importance = prefill_importance(h, valid, w["down_norm"])
        y = masked_down(h, rank_channels(importance)[: self.n_keep], w["down"])
        return y, {"prior": self._prior(w, gate, up, valid, importance)}, {"importance": importance}

    def _prior(self, w, gate, up, valid, importance):
        """û_j · ‖W_d[:, j]‖₂ [f] fp32 from the prompt's gate activations and up projections [B, T, f]."""
        down_norm = w["down_norm"].astype(jnp.float32)
        if self.prior == "up":
            return prefill_importance(up, valid, down_norm)
        if self.prior == "gated_up":  # ‖H‖·‖W_d‖ / ‖silu(G)‖; a gate closed on every token gives 0
            gate_norm = prefill_importance(gate, valid, jnp.ones_like(down_norm))
            return jnp.where(gate_norm > 0, importance / jnp.where(gate_norm > 0, gate_norm, 1.0), 0.0)
        return down_norm

    def _decode(self, w, state, x, step, valid):
        """x [B, 1, d] -> (y [B, 1, d], state (unchanged), {"selected", "scores": [n_keep]})."""
        g = jnp.einsum("bsd,nd->bsn", x, w["gate_up"][0])  # [B, 1, f]
        shortlist = jax.lax.top_k(gate_scores(g, valid, state["prior"]), self.s)[1]  # channel ids [s]
        up = jnp.einsum("bsd,nd->bsn", x, take_channels(w["gate_up"][1], shortlist, axis=0))
        h = jax.nn.silu(take_channels(g, shortlist, axis=-1)) * up  # exact H of the shortlist [B, 1, s]
        norms = take_channels(w["down_norm"], shortlist, axis=0)
        top_scores, pick = jax.lax.top_k(step_importance(h, valid, norms), self.n_keep)  # within the shortlist
        selected = take_channels(shortlist, pick, axis=0)
        # The selection's down columns, gathered as rows [n_keep, d] (a row gather is contiguous).
        y = take_channels(h, pick, axis=-1) @ take_channels(w["down"], selected, axis=1).T
        return y, state, {"selected": selected, "scores": top_scores}

    def ffn_flops_per_token(self, d: int) -> int:
        """Multiply-adds: gate of every channel, up of the shortlist, down of the selection."""
        return 2 * d * (self.f + self.s + self.n_keep)

    def ffn_weights_read(self, d: int) -> int:
        return d * (self.f + self.s + self.n_keep)


@dataclasses.dataclass(frozen=True)
class ShortlistDynamic(RatioMethod):
    """Dynamic selection over a shortlist of every channel:
    ``ShortlistDynamic(ratio=0.4, shortlist=0.65, prior="up", aggregate="shared" | "per_sequence")``.

    Args:
      ratio: global fraction of decoder parameters removed (SPEC §1), all from the FFN.
      shortlist: σ in (0, 1], the fraction of all f channels scored exactly per step
        (s = round(σ·f), at least n_keep); 1 selects what dynamic selects.
      prior: the per-channel weight of the gate estimate, from the prompt: "up" (the up
        projection's norm), "gated_up" (the up magnitude where the gate opens) or "none".
      aggregate: "shared" (one selection per batch) or "per_sequence".
    """

    name: ClassVar[str] = "dynamic-shortlist"
    plan_class: ClassVar[type] = ShortlistDynamicPlan
    shortlist: float = dataclasses.field(default=0.65, kw_only=True)
    prior: str = dataclasses.field(default="up", kw_only=True)

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.shortlist, bool) or not isinstance(self.shortlist, (int, float)) or not 0 < self.shortlist <= 1:
            raise MethodError(f"shortlist={self.shortlist!r} is outside (0, 1] (the fraction of all f channels scored exactly)")
        if self.prior not in PRIORS:
            raise MethodError(f"prior={self.prior!r} is not one of {PRIORS}")

    def plan_sizes(self, f: int, n_keep: int) -> dict[str, int]:
        return {"s": min(f, max(n_keep, round_half_up(self.shortlist * f))), "prior": self.prior}
