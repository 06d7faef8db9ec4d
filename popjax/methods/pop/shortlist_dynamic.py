"""Shortlisted dynamic selection: every channel is a candidate, a cheap estimate shortlists them,
exact scores choose (docs/methods.md §7.5; docs/frontier_methods.md §5).

Shortlisted POP can only choose inside POP's band, and at its widest band POP already scores
almost every channel exactly, so there it can at best tie POP; dynamic selection, which also
reaches the prompt's bottom channels, is 0.06 nats better on held-out text at 40%. This method
keeps no pruned region. At decode step t, over all f channels:

    g       = x_t W_gᵀ                                        every gate row (d·f)
    a_t[j]  = ‖silu(g_j)‖₂ · û_j · ‖W_d[:, j]‖₂                 the estimate of dynamic's score
    L_t     = top_s of a_t                                    the shortlist (``lax.top_k``)
    H_t[L]  = silu(g_L) ⊙ x_t W_u[L]ᵀ                         up rows of the shortlist (d·s)
    S_t     = top_{n_keep} over L of ‖H_t[c]‖₂ · ‖W_d[:, c]‖₂  dynamic's exact score
    y_t     = H_t[S_t] W_d[:, S_t]ᵀ                           down rows of the selection

(‖·‖₂ over the batch's valid rows, as in POP.) The **up prior** û is computed once at prefill
from the prompt's valid tokens (shortlist.py): ``prior="up"`` (default) û_j = ‖U[:, j]‖₂;
``"gated_up"`` and ``"none"`` are ablations (measured worse, docs/frontier.md).

**One plan with shortlisted POP.** This selection is shortlisted POP's scorer under the unkept
band with m = n_keep (R empty, every channel a candidate): `ShortlistDynamic` is a preset of that
plan, and ``ShortlistPOP(gamma=1, band="all", prior="up", shortlist=σ)`` binds to the very same
plan as ``ShortlistDynamic(shortlist=σ)``. Of the two implementations that existed, the one kept
copies the f channels' gate, up and down rows into compact blocks at prefill; the one removed read
the model's own matrices every step (a strided gather of down columns, no copy). At equal bytes
per step the copies decode faster (the measured speeds, batch 1 at 40%, are in docs/frontier.md);
the price is memory: a copy of the layer's FFN per request (per sequence with
``aggregate="per_sequence"``) where the removed one held one ``[f]`` vector.

Sizes: ``s = round(σ·f)`` clipped to ``[n_keep, f]`` for ``shortlist=σ``. Weights read per decode
token and layer: ``d·f + d·s + d·n_keep``; σ = 1 is dynamic (exact scores on every channel), and
s = n_keep is selection by the estimate alone. The prompt's own output is dynamic's (top n_keep
channels by prompt importance).

Ties: ``lax.top_k`` keeps the earlier position: in prompt order for the shortlist (the removed
implementation: the lower channel id), then in shortlist order for the selection.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from ... import kernels
from ..base import MethodError, RatioMethod
from .plan import UNKEPT_BAND, POPPlan, check_choice
from .shortlist import ShortlistScorer, shortlist_size

PRIORS = ("up", "gated_up", "none")


def shortlist_dynamic_plan(f: int, n_keep: int, s: int = 0, prior: str = "up", aggregate: str = "shared") -> POPPlan:
    """The plan `ShortlistDynamic` binds to, at these sizes: m = n_keep of all f channels."""
    return POPPlan(f=f, n_keep=n_keep, aggregate=aggregate, m=n_keep, scorer=ShortlistScorer(s, prior), band=UNKEPT_BAND)




@dataclasses.dataclass(frozen=True)
class ShortlistDynamic(RatioMethod):
    """Dynamic selection over a shortlist of every channel:
    ``ShortlistDynamic(ratio=0.4, shortlist=0.65, prior="up", aggregate="per_sequence" | "shared")``.

    Args:
      ratio: global fraction of decoder parameters removed (docs/methods.md §1), all from the FFN.
      shortlist: σ in (0, 1], the fraction of all f channels scored exactly per step
        (s = round(σ·f), at least n_keep); 1 selects what dynamic selects.
      prior: the per-channel weight of the gate estimate, from the prompt: "up" (the up
        projection's norm), "gated_up" (the up magnitude where the gate opens) or "none".
      aggregate: "per_sequence" (default: a selection per sequence) or "shared" (one per batch).
      kernel: how a step reads the shortlist's up rows and the selected down columns: "auto"
        (default: the Pallas kernels on TPU and GPU, XLA on a CPU), "xla" or "pallas" (as
        shortlisted POP's; interpret mode on a CPU).
    """

    name: ClassVar[str] = "dynamic-shortlist"
    plan_class: ClassVar[type] = POPPlan
    shortlist: float = dataclasses.field(default=0.65, kw_only=True)
    prior: str = dataclasses.field(default="up", kw_only=True)
    kernel: str = dataclasses.field(default="auto", kw_only=True)

    def __post_init__(self):
        super().__post_init__()
        check_choice("kernel", self.kernel, kernels.KERNELS)
        if isinstance(self.shortlist, bool) or not isinstance(self.shortlist, (int, float)) or not 0 < self.shortlist <= 1:
            raise MethodError(f"shortlist={self.shortlist!r} is outside (0, 1] (the fraction of all f channels scored exactly)")
        check_choice("prior", self.prior, PRIORS)

    def plan_sizes(self, f: int, n_keep: int) -> dict:
        """m = n_keep under the unkept band: R is empty and every channel a candidate (n_C = f)."""
        s = shortlist_size(self.shortlist, n_keep, f)
        return {"m": n_keep, "scorer": ShortlistScorer(s, self.prior), "band": UNKEPT_BAND, "kernel": kernels.choose(self.kernel)}
