"""Shortlisted POP: gate scores shortlist the band, exact scores choose within the shortlist
(issue 15; docs/frontier_methods.md §4).

Gate-scored POP (gate_scored.py) affords a band twice as wide as POP's for the same bytes, but at
the same band its gate-only scores choose worse than POP's exact ones. This method spends bytes
between the two: at decode step t, with POP's partition (R retained, C the 2m candidates),

    g_c      = x_t W_g[c]ᵀ                                   gate rows of all of C
    L_t      = top_s over c ∈ C of ‖silu(g_c)‖₂ · ‖W_d[:, c]‖₂   the shortlist (``lax.top_k``)
    H_t[c]   = silu(g_c) ⊙ x_t W_u[c]ᵀ                       up rows of the shortlist only
    S_t      = top_m over c ∈ L_t of ‖H_t[c]‖₂ · ‖W_d[:, c]‖₂    POP's exact score
    y_t      = H_t[R] W_d[:, R]ᵀ + H_t[S_t] W_d[:, S_t]ᵀ

(‖·‖₂ over the batch's valid rows, as in POP). Sizes: POP's ``m``, ``n_R = n_keep − m`` and
``n_C = 2m`` from γ; the shortlist ``s = round(σ·n_C)`` clipped to [m, n_C] for ``shortlist=σ``.

Weights read per decode token per layer: ``3d·n_R + d·n_C + d·s + d·m``. The two ends are the
existing methods: s = m is gate-scored POP (every shortlisted channel is selected) and s = n_C
is POP (exact scores over the whole band), so σ moves continuously from one to the other.

Two options reach the widest budgets, where POP's own band already scores almost every channel
exactly (docs/frontier_methods.md §4). ``band="all"`` makes every channel outside R a candidate
(``n_C = f − n_R``, no pruned region; ``m = round(γ·n_keep)``, so γ = 1 leaves R empty).
``prior="up"`` weights the shortlist's gate score by the prompt's up-projection norm per
candidate, ‖x W_u[c]ᵀ‖₂ over the prompt's valid tokens (computed once at prefill; no byte per
step). With γ = 1, ``band="all"`` and ``prior="up"`` the method selects what ``ShortlistDynamic``
selects (tested), from compact copies where that one reads the model's matrices.

Ties: ``lax.top_k`` keeps the lower position, within C for the shortlist and within the
shortlist (in shortlist order) for the final choice.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from .base import MethodError, down_proj, prefill_importance, round_half_up, step_importance, take_channels
from .gate_scored import GateScoredPlan, GateScoredPOP, gate_scores

BANDS = ("pop", "all")
PRIORS = ("none", "up")


@dataclasses.dataclass(frozen=True)
class ShortlistPlan(GateScoredPlan):
    """GateScoredPlan's partition state (gate/up rows of R and gate rows of C in one block; up
    rows and down rows of C as ``[n_C, d]`` blocks), with a shortlist of ``s`` channels."""

    name: ClassVar[str] = "pop-shortlist"
    s: int = 0  # channels shortlisted per step by gate score, m ≤ s ≤ n_C
    band_all: bool = False  # every channel outside R is a candidate (n_C = f − n_R)
    prior: str = "none"  # "up": the shortlist's gate score × the prompt's up norm per candidate

    @property
    def n_candidates(self) -> int:
        return self.f - self.n_retained if self.band_all else 2 * self.m

    def _prefill(self, w, x, valid):
        """GateScoredPlan's prefill; with ``prior="up"`` also ``shortlist_weight [n_C]`` =
        ‖U[valid, c]‖₂ · ‖W_d[:, c]‖₂ from the candidates' up rows (one more prefill matmul)."""
        y, state, aux = super()._prefill(w, x, valid)
        if self.prior == "up":
            up = jnp.einsum("btd,nd->btn", x, state["up_candidates"])
            state["shortlist_weight"] = prefill_importance(up, valid, state["down_norm_candidates"])
        return y, state, aux

    def _decode(self, w, state, x, step, valid):
        """x [B, 1, d] -> (y [B, 1, d], state (unchanged), {"selected", "scores": [m]})."""
        h_retained, g = self._step_rows(state, x)  # g: gate pre-activations of the candidates
        y = down_proj(h_retained, state["down_retained"])
        if self.m == 0:
            return y, state, {}
        weight = state["shortlist_weight"] if self.prior == "up" else state["down_norm_candidates"]
        shortlist = jax.lax.top_k(gate_scores(g, valid, weight), self.s)[1]  # [s] within C
        up = jnp.einsum("bsd,nd->bsn", x, take_channels(state["up_candidates"], shortlist, axis=0))
        h = jax.nn.silu(take_channels(g, shortlist, axis=-1)) * up  # exact H of the shortlist [B, 1, s]
        norms = take_channels(state["down_norm_candidates"], shortlist, axis=0)
        top_scores, pick = jax.lax.top_k(step_importance(h, valid, norms), self.m)  # within the shortlist
        selected = take_channels(shortlist, pick, axis=0)  # positions within C
        y = y + take_channels(h, pick, axis=-1) @ take_channels(state["down_candidates"], selected, axis=0)
        aux = {"selected": take_channels(state["candidate_idx"], selected, axis=0), "scores": top_scores}
        return y, state, aux

    def ffn_flops_per_token(self, d: int) -> int:
        """Multiply-adds: gate/up of R, gate of C, up of the shortlist, down of n_keep."""
        return 2 * d * (2 * self.n_retained + self.n_candidates + self.s) + 2 * d * self.n_keep

    def ffn_weights_read(self, d: int) -> int:
        return 3 * d * self.n_retained + d * self.n_candidates + d * self.s + d * self.m


@dataclasses.dataclass(frozen=True)
class ShortlistPOP(GateScoredPOP):
    """POP whose band is shortlisted by gate scores before exact scoring:
    ``ShortlistPOP(ratio=0.4, gamma=1.0, shortlist=0.75, aggregate="shared" | "per_sequence")``.

    Args:
      ratio: global fraction of decoder parameters removed (SPEC §1), all from the FFN.
      gamma: candidate band width as a fraction of f, in [0, 1] (POP's sizes: n_C = 2m).
      shortlist: σ in [0.5, 1], the fraction of the band kept by gate score for exact scoring
        (s = round(σ·n_C), at least m): 0.5 is gate-scored POP, 1 is POP (with band="pop"; with
        band="all" σ may go down to 0, s staying at least m).
      band: "pop" (POP's sizes: n_C = 2m) or "all" (every channel outside R is a candidate, and
        m = round(γ·n_keep) channels are chosen per step: γ = 1 leaves R empty).
      prior: "none" (gate score) or "up" (gate score × the prompt's up norm per candidate).
      aggregate: "shared" (one partition and selection per batch) or "per_sequence".
    """

    name: ClassVar[str] = "pop-shortlist"
    plan_class: ClassVar[type] = ShortlistPlan
    shortlist: float = dataclasses.field(default=0.75, kw_only=True)
    band: str = dataclasses.field(default="pop", kw_only=True)
    prior: str = dataclasses.field(default="none", kw_only=True)

    def __post_init__(self):
        super().__post_init__()
        if self.band not in BANDS:
            raise MethodError(f"band={self.band!r} is not one of {BANDS}")
        if self.prior not in PRIORS:
            raise MethodError(f"prior={self.prior!r} is not one of {PRIORS}")
        lowest = 0.5 if self.band == "pop" else 0.0
        if isinstance(self.shortlist, bool) or not isinstance(self.shortlist, (int, float)) or not lowest <= self.shortlist <= 1:
            raise MethodError(f"shortlist={self.shortlist!r} is outside [{lowest}, 1] (the fraction of the band scored exactly)")

    def plan_sizes(self, f: int, n_keep: int) -> dict[str, int]:
        sizes = super().plan_sizes(f, n_keep)
        if self.band == "all":  # m = γ·n_keep: γ = 1 leaves R empty at any ratio
            sizes["m"] = min(n_keep, round_half_up(self.gamma * n_keep))
        m = sizes["m"]
        n_c = f - (n_keep - m) if self.band == "all" else 2 * m
        s = min(n_c, max(m, round_half_up(self.shortlist * n_c)))
        return sizes | {"s": s, "band_all": self.band == "all", "prior": self.prior}
