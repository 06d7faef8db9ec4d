"""Shortlisted POP: gate scores shortlist the band, exact scores choose within the shortlist
(docs/methods.md §7.4; docs/frontier_methods.md §4).

Gate-scored POP (gate_scored.py) affords a band twice as wide as POP's for the same bytes, but at
the same band its gate-only scores choose worse than POP's exact ones. This scorer spends bytes
between the two: at decode step t, with the partition's R (retained) and C (candidates),

    g_c      = x_t W_g[c]ᵀ                                   gate rows of all of C
    L_t      = top_s over c ∈ C of ‖silu(g_c)‖₂ · w_c        the shortlist (``lax.top_k``)
    H_t[c]   = silu(g_c) ⊙ x_t W_u[c]ᵀ                       up rows of the shortlist only
    S_t      = top_m over c ∈ L_t of ‖H_t[c]‖₂ · ‖W_d[:, c]‖₂    POP's exact score
    y_t      = H_t[R] W_d[:, R]ᵀ + H_t[S_t] W_d[:, S_t]ᵀ

(‖·‖₂ over the batch's valid rows, as in POP). The shortlist weight ``w_c`` is the **prior**,
computed once at prefill (no byte per step): ``"none"``: ‖W_d[:, c]‖₂ (gate-scored POP's score);
``"up"``: ‖U[valid, c]‖₂ · ‖W_d[:, c]‖₂ with U = X W_uᵀ the prompt's up projections (the gate
says whether a channel opens, the prompt says how large its up projection tends to be);
``"gated_up"``: ‖H[valid, c]‖₂ · ‖W_d[:, c]‖₂ / ‖silu(G[valid, c])‖₂ (0 for a gate closed on every
prompt token; an ablation of §7.5).

Weights read per decode token per layer: ``3d·n_R + d·n_C + d·s + d·m``. Under POP's band
(n_C = 2m) the two ends are the existing methods: s = m is gate-scored POP (every shortlisted
channel is selected) and s = n_C is POP (exact scores over the whole band). Under the unkept band
(``band="all"``: n_C = f − n_R) with γ = 1, R is empty and m = n_keep: that is shortlisted dynamic
selection (§7.5, shortlist_dynamic.py), the same plan.

Ties: ``lax.top_k`` keeps the lower position, within C (prompt order) for the shortlist and within
the shortlist (in shortlist order) for the final choice.

**Blocks** (``block=b`` > 1, band="pop"; blocks.py): m, s and n_C are whole blocks of b
consecutive positions of C (prompt-importance order, or with ``block_order="coactivation"``
channels that fired on the same prompt tokens, as block POP's). Both stages choose blocks by the L2 norm of
their channels' scores: the top s/b blocks by gate score form the shortlist, the top m/b of those
by exact score are selected, and a Pallas step reads the selected down rows block by block
(`kernels.decode_ffn.block_matvec`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from ..base import MethodError, block_channels, copy_candidates, dot, down_proj, gate_activation, prefill_importance, round_half_up, step_importance, take_channels, top_blocks
from .blocks import BlockBand, check_block_options
from .core import POPPreset
from .gate_scored import gate_partition_state, gate_scores, kernel_down, kernel_row_dots, kernel_row_width, retained_and_gates
from .plan import GLOBAL_BAND, UNKEPT_BAND, CandidateScorer, POPPlan, check_choice, kernel_block_down, top_candidates

PRIORS = ("none", "up", "gated_up")  # what the scorer computes; each preset offers its own subset
BANDS = ("pop", "all")


@dataclasses.dataclass(frozen=True)
class ShortlistScorer(CandidateScorer):
    """A shortlist of ``s`` candidates (m ≤ s ≤ n_C) by the gate score weighted by ``prior``,
    then the top m of it by exact score. State: gate-scored POP's, plus ``shortlist_weight``
    [n_C] (the prior w_c) unless ``prior="none"``. ``block`` > 1: both stages choose whole
    blocks of that many consecutive positions of C (s and m multiples of it)."""

    name: ClassVar[str] = "pop-shortlist"
    s: int = 0
    prior: str = "none"
    block: int = 1

    def __post_init__(self):
        check_choice("prior", self.prior, PRIORS)

    @property
    def kernel_wired(self) -> bool:
        return True

    def prefill_state(self, plan, w, x, valid, retained, candidates):
        up_rows = copy_candidates(w.gate_up[1], candidates, axis=0)  # [n_C, d]: the state's (or its kernel layout's) and the prior's
        state = gate_partition_state(w, retained, candidates, plan.kernel, up=up_rows)
        if self.prior == "up":  # one more prefill matmul: the candidates' up rows
            up = dot("btd,nd->btn", x, up_rows)
            state["shortlist_weight"] = prefill_importance(up, valid, state["down_norm_candidates"])
        elif self.prior == "gated_up":
            gate = gate_activation(w)(dot("btd,nd->btn", x, take_channels(w.gate_up[0], candidates, axis=0)))
            up = dot("btd,nd->btn", x, up_rows)
            importance = prefill_importance(gate * up, valid, state["down_norm_candidates"])
            gate_norm = prefill_importance(gate, valid, jnp.ones_like(state["down_norm_candidates"], jnp.float32))
            state["shortlist_weight"] = jnp.where(gate_norm > 0, importance / jnp.where(gate_norm > 0, gate_norm, 1.0), 0.0)
        return state

    def decode(self, plan, w, state, x, valid):
        act = gate_activation(w)
        h_retained, g = retained_and_gates(state, x, plan.n_candidates, act)  # g: gate pre-activations of C
        y = down_proj(h_retained, state["down_retained"])
        if plan.m == 0:
            return y, {}
        weight = state["down_norm_candidates"] if self.prior == "none" else state["shortlist_weight"]
        shortlist = self.shortlist(gate_scores(g, valid, weight, act))  # [s] within C
        if plan.kernel != "xla":  # the shortlist's up rows through the row-dot kernel
            up = kernel_row_dots(plan, state["up_candidates"], x, shortlist)
        else:
            up = dot("bsd,nd->bsn", x, take_channels(state["up_candidates"], shortlist, axis=0))
        h = act(take_channels(g, shortlist, axis=-1)) * up  # exact H of the shortlist [B, 1, s]
        norms = take_channels(state["down_norm_candidates"], shortlist, axis=0)
        top_scores, pick = top_candidates(step_importance(h, valid, norms), plan.m, self.block)  # within the shortlist
        selected = take_channels(shortlist, pick, axis=0)  # positions within C
        aux = {"selected": take_channels(state["candidate_idx"], selected, axis=0), "scores": top_scores}
        if plan.kernel != "xla" and self.block > 1:  # whole blocks of C's down rows: h of the selected, zero elsewhere
            batch = x.shape[0]
            h_c = jnp.zeros((batch, plan.n_candidates), h.dtype).at[:, selected].set(take_channels(h, pick, axis=-1).reshape(batch, -1))
            y_c = kernel_block_down(plan, h_c, state["down_candidates"], selected, self.block, x.shape[-1])
            return y + y_c.reshape(y.shape).astype(y.dtype), aux
        if plan.kernel != "xla":
            return y + kernel_down(plan, state["down_candidates"], take_channels(h, pick, axis=-1), selected, x.shape[-1]).astype(y.dtype), aux
        return y + take_channels(h, pick, axis=-1) @ take_channels(state["down_candidates"], selected, axis=0), aux

    def shortlist(self, scores: jax.Array) -> jax.Array:
        """C's shortlist scores [n_C] -> the s shortlisted positions within C: the top s, or
        (``block`` > 1) the top s/b blocks' positions, each block's in order."""
        if self.block == 1:
            return jax.lax.top_k(scores, self.s)[1]
        return block_channels(top_blocks(scores, self.s // self.block, self.block)[1], self.block)

    def weights_read(self, plan, d):
        """The TPU kernels read each shortlisted up row and selected down row whole (L·128 ≥ d)."""
        return 3 * d * plan.n_retained + d * plan.n_candidates + kernel_row_width(plan, d) * (self.s + plan.m)

    def flops(self, plan, d):
        """Multiply-adds: gate/up of R, gate of C, up of the shortlist, down of n_keep."""
        return 2 * d * (2 * plan.n_retained + plan.n_candidates + self.s) + 2 * d * plan.n_keep


def shortlist_size(sigma: float, m: int, n_c: int, block: int = 1) -> int:
    """s = round(σ·n_C) clipped to [m, n_C]; with blocks of b, round(σ·n_C/b)·b."""
    return min(n_c, max(m, round_half_up(sigma * n_c / block) * block))


def shortlist_plan(f: int, n_keep: int, m: int = 0, s: int = 0, aggregate: str = "shared", band_all: bool = False,
                   prior: str = "none") -> POPPlan:
    """The plan `ShortlistPOP` binds to, at these sizes (``band_all``: its ``band="all"``)."""
    band = UNKEPT_BAND if band_all else GLOBAL_BAND
    return POPPlan(f=f, n_keep=n_keep, aggregate=aggregate, m=m, scorer=ShortlistScorer(s, prior), band=band)




@dataclasses.dataclass(frozen=True)
class ShortlistPOP(POPPreset):
    """POP whose band is shortlisted by gate scores before exact scoring:
    ``ShortlistPOP(ratio=0.4, gamma=1.0, shortlist=0.75, aggregate="per_sequence" | "shared")``.

    Args:
      ratio: global fraction of decoder parameters removed (docs/methods.md §1), all from the FFN.
      gamma: candidate band width as a fraction of f, in [0, 1] (POP's sizes: n_C = 2m).
      shortlist: σ in [0.5, 1], the fraction of the band kept by gate score for exact scoring
        (s = round(σ·n_C), at least m): 0.5 is gate-scored POP, 1 is POP (with band="pop"; with
        band="all" σ may go down to 0, s staying at least m).
      band: "pop" (POP's sizes: n_C = 2m) or "all" (every channel outside R is a candidate, and
        m = round(γ·n_keep) channels are chosen per step: γ = 1 leaves R empty).
      prior: "none" (gate score) or "up" (gate score × the prompt's up norm per candidate).
      block: 1 (default: single channels) or b > 1 (band="pop" only): m, s and n_C in whole
        blocks of b consecutive positions of C, each stage choosing whole blocks (block POP's
        sizes, blocks.py); a Pallas step reads the selected down rows block by block.
      block_order: how prefill lays C out into those blocks, as POP's: "importance" (default)
        or "coactivation" (`blocks.coactive_blocks`); block > 1 only.
      aggregate: "per_sequence" (default: a partition and selection per sequence) or "shared" (one per batch).
      kernel: how a step reads the shortlist's up rows and the selected down columns: "auto"
        (default: the Pallas kernels on TPU and GPU, XLA on a CPU), "xla" or "pallas"
        (`kernels.decode_ffn.gather_row_dots`, then `values_matvec`; interpret mode on a CPU).
    """

    name: ClassVar[str] = "pop-shortlist"
    priors: ClassVar[tuple[str, ...]] = ("none", "up")
    shortlist: float = dataclasses.field(default=0.75, kw_only=True)
    band: str = dataclasses.field(default="pop", kw_only=True)
    prior: str = dataclasses.field(default="none", kw_only=True)
    block: int = dataclasses.field(default=1, kw_only=True)
    block_order: str = dataclasses.field(default="importance", kw_only=True)

    def __post_init__(self):
        super().__post_init__()
        check_choice("band", self.band, BANDS)
        check_choice("prior", self.prior, self.priors)
        check_block_options(self.block, self.block_order)
        if self.block > 1 and self.band != "pop":
            raise MethodError(f"block={self.block} applies to band='pop' only (band={self.band!r})")
        lowest = 0.5 if self.band == "pop" else 0.0
        if isinstance(self.shortlist, bool) or not isinstance(self.shortlist, (int, float)) or not lowest <= self.shortlist <= 1:
            raise MethodError(f"shortlist={self.shortlist!r} is outside [{lowest}, 1] (the fraction of the band scored exactly)")

    def band_rule(self):
        if self.band == "all":
            return UNKEPT_BAND
        return GLOBAL_BAND if self.block == 1 else BlockBand(self.block, self.block_order)

    def candidate_scorer(self, f, n_keep, m):
        n_c = self.band_rule().n_candidates(f, n_keep, m)
        return ShortlistScorer(s=shortlist_size(self.shortlist, m, n_c, self.block), prior=self.prior, block=self.block)
