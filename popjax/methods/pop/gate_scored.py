"""Gate-scored POP: POP's prefill partition, candidates scored from the gate projection alone
(docs/methods.md §7.1; docs/frontier_methods.md §1).

POP (§2) computes gate AND up for every candidate at every decode step only to score them, then
keeps m of the 2m. Here a step reads the candidates' gate rows only, scores

    s_c(t) = ‖silu(x_t W_g[c]ᵀ)‖₂ · ‖W_d[:, c]‖₂      (‖·‖₂ over the batch's valid rows)

takes ``S_t = top_m(s)`` with ``lax.top_k`` inside the band, and computes the up projection and
the down projection for the m selected channels only:

    y_t = H_t[R] W_d[:, R]ᵀ + (silu(x_t W_g[S_t]ᵀ) ⊙ x_t W_u[S_t]ᵀ) W_d[:, S_t]ᵀ

Sizes are POP's (``m = min(round(γ·f/2), f − n_keep, n_keep)``, ``n_R = n_keep − m``,
``n_C = 2m``). Weights read per decode token per layer: 3·d per retained channel, d per candidate
(its gate row) and 2·d per selected one (its up row and down column): ``3d·n_R + d·n_C + 2d·m``
against POP's ``3d·n_R + 2d·n_C + d·m``, so the same budget affords twice POP's band
(``m' = 2m``: γ' = 2γ). With γ covering every channel (n_R = n_P = 0, possible when
n_keep = f/2 and γ = 1) it is dynamic selection by the gate score.

The prompt's own output is POP's (top n_keep channels by prompt importance). The compact blocks
are gathered once at prefill (`gate_partition_state`), which the shortlist scorer (shortlist.py)
shares.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from ... import kernels
from ...kernels.decode_ffn import gather_row_dots, values_matvec
from ...kernels.ffn_layout import InputRows, OutputRows, channel_lines, output_layout
from ...kernels.int8 import Int8Weight
from ...sharding import pad_ids
from ..base import copy_candidates, copy_rows, dot, down_proj, gate_activation, prefill_importance, take_channels
from .core import POPPreset
from .plan import CandidateScorer, POPPlan, candidate_rows, copy_channels_or_empty


def gate_scores(g: jax.Array, valid: jax.Array, down_norm: jax.Array, act=jax.nn.silu) -> jax.Array:
    """s_c = ‖act(g[valid, c])‖₂ · ‖W_d[:, c]‖₂: g (gate pre-activations) [B, 1, n], valid
    [B, 1], down_norm [n] -> [n] fp32 (act: the model's gate activation, `gate_activation`)."""
    return prefill_importance(act(g), valid, down_norm)


def gate_partition_state(w, retained, candidates, kernel: str = "xla", up=None) -> dict:
    """The partition state of a step that reads C's gate rows whole and C's up and down rows
    only where selected: one ``step_rows`` block [(2n_R' + n_C)', d] (gate and up rows of R,
    gate rows of C) for one dense matmul per step and R's down columns [d, n_R'], both split
    over ``model`` on a mesh (base.copy_rows / copy_channels, R padded with zero channels to a
    multiple of the split: n_R' ≥ n_R), and C's up rows and down columns as row blocks
    [n_C, d] from which a step gathers its selection (replicated, as POP's candidate down rows).
    With a Pallas ``kernel`` those two are the kernels' layouts: C's up rows as
    `ffn_layout.OutputRows` [n_C, L, 128] and its down columns as `ffn_layout.InputRows`.
    ``up``: C's up rows [n_C, d] when the caller has copied them already."""
    f = w.gate_up.shape[1]
    padded = pad_ids(retained)
    up_padded = jnp.where(padded >= 0, f + padded, -1)  # up row c of gate_up read as [2f, d] is f + c
    up = copy_candidates(w.gate_up[1], candidates, axis=0) if up is None else up  # [n_C, d]
    return {
        "retained_idx": retained,  # [n_R]
        "candidate_idx": candidates,  # [n_C]
        # gate R', up R', gate C: [(2 n_R' + n_C)', d]
        "step_rows": copy_rows(w.gate_up, jnp.concatenate([padded, up_padded, candidates])),
        "up_candidates": up if kernel == "xla" else output_rows(up),
        "down_retained": copy_channels_or_empty(w.down, padded, axis=1),  # [d, n_R']
        "down_candidates": copy_candidates(w.down, candidates, axis=1).T if kernel == "xla" else candidate_rows(w.down, candidates),
        "down_norm_candidates": copy_candidates(w.down_norm, candidates, axis=0),  # [n_C]
    }


def output_rows(w) -> OutputRows:
    """Rows [n, d] (an array or an `Int8Weight`, its per-row scale [n, 1] kept) -> the row-dot
    kernel's `ffn_layout.OutputRows` [n, L, 128]."""
    if isinstance(w, Int8Weight):
        return output_layout(w.values, jnp.broadcast_to(w.scale, (w.shape[0], 1)))
    return output_layout(w)


def kernel_row_dots(plan, rows: OutputRows, x, ids) -> jax.Array:
    """x's dots with C's rows ``ids`` [k] (positions in C) of ``rows`` (its up rows, or gate rows)
    through the plan's Pallas kernel: x [B, 1, d] -> [B, 1, k] in x's dtype (only those k rows
    are read)."""
    batch = x.shape[0]
    dots = gather_row_dots(x.reshape(batch, -1), rows, ids, kernel=plan.kernel)
    return dots.astype(x.dtype).reshape(batch, 1, -1)


def kernel_down(plan, rows: InputRows, h, ids, d: int) -> jax.Array:
    """Σ over the channels ``ids`` [k] (positions in ``rows``: C's down columns as
    `ffn_layout.InputRows`) of h [B, 1, k] times their down columns, through the plan's Pallas
    kernel (only those k rows are read) -> [B, 1, d]."""
    batch = h.shape[0]
    return values_matvec(h.reshape(batch, -1), rows, ids, out_features=d, kernel=plan.kernel).reshape(batch, 1, d)


def kernel_row_width(plan, d: int) -> int:
    """The elements a step reads per selected row: L·128 through the TPU kernels (and their
    interpret mode; `ffn_layout.channel_lines`), d through XLA or the GPU kernels."""
    return channel_lines(d) * 128 if plan.kernel in kernels.TPU_KERNELS else d


def retained_and_gates(state, x, n_candidates: int, act=jax.nn.silu) -> tuple[jax.Array, jax.Array]:
    """The step's one dot over ``step_rows``: x [B, 1, d] -> (H of R' [B, 1, n_R'], the gate
    pre-activations of C [B, 1, n_C]); n_R' = n_R without a mesh (`gate_partition_state`)."""
    n_r = state["down_retained"].shape[-1]
    z = dot("bsd,nd->bsn", x, state["step_rows"])  # [B, 1, (2 n_R' + n_C)']
    return act(z[..., :n_r]) * z[..., n_r : 2 * n_r], z[..., 2 * n_r : 2 * n_r + n_candidates]


@dataclasses.dataclass(frozen=True)
class GateScorer(CandidateScorer):
    """Candidates scored by ``‖silu(x_t W_g[c]ᵀ)‖₂ · ‖W_d[:, c]‖₂``; up and down of the m chosen."""

    name: ClassVar[str] = "pop-gate"

    @property
    def kernel_wired(self) -> bool:
        return True

    def prefill_state(self, plan, w, x, valid, retained, candidates):
        return gate_partition_state(w, retained, candidates, plan.kernel)

    def decode(self, plan, w, state, x, valid):
        """With a Pallas ``plan.kernel`` the m selected up rows and down columns are read by the
        kernels (`kernel_row_dots`, `kernel_down`) instead of XLA's gathers."""
        act = gate_activation(w)
        h_retained, g = retained_and_gates(state, x, plan.n_candidates, act)  # g: gate pre-activations of C
        y = down_proj(h_retained, state["down_retained"])
        if plan.m == 0:
            return y, {}
        scores = gate_scores(g, valid, state["down_norm_candidates"], act)
        top_scores, selected = jax.lax.top_k(scores, plan.m)  # positions within C
        aux = {"selected": take_channels(state["candidate_idx"], selected, axis=0), "scores": top_scores}
        if plan.kernel != "xla":
            h_selected = act(take_channels(g, selected, axis=-1)) * kernel_row_dots(plan, state["up_candidates"], x, selected)
            return y + kernel_down(plan, state["down_candidates"], h_selected, selected, x.shape[-1]).astype(y.dtype), aux
        up = dot("bsd,md->bsm", x, take_channels(state["up_candidates"], selected, axis=0))
        h_selected = act(take_channels(g, selected, axis=-1)) * up  # [B, 1, m]
        return y + h_selected @ take_channels(state["down_candidates"], selected, axis=0), aux

    def weights_read(self, plan, d):
        """The TPU kernels read each selected row whole, L·128 ≥ d (`kernel_row_width`)."""
        return 3 * d * plan.n_retained + d * plan.n_candidates + 2 * kernel_row_width(plan, d) * plan.m

    def flops(self, plan, d):
        """Multiply-adds: gate/up of R, gate of C, up of the m selected, down of n_keep."""
        return 2 * d * (2 * plan.n_retained + plan.n_candidates + plan.m) + 2 * d * plan.n_keep


GATE = GateScorer()


def gate_scored_plan(f: int, n_keep: int, m: int = 0, aggregate: str = "shared") -> POPPlan:
    """The plan `GateScoredPOP` binds to, at these sizes."""
    return POPPlan(f=f, n_keep=n_keep, aggregate=aggregate, m=m, scorer=GATE)




@dataclasses.dataclass(frozen=True)
class GateScoredPOP(POPPreset):
    """POP with candidates scored from the gate alone: ``GateScoredPOP(ratio=0.2, gamma=0.2,
    aggregate="per_sequence" | "shared")``.

    Args:
      ratio: global fraction of decoder parameters removed (docs/methods.md §1), all from the FFN.
      gamma: candidate band width as a fraction of f, in [0, 1] (POP's sizes). A candidate costs
        half of POP's per step, so γ = 2·γ_POP reads the same bytes as POP at γ_POP.
      aggregate: "per_sequence" (default: a partition and selection per sequence) or "shared" (one per batch).
      kernel: how a step reads the m selected candidates' up rows and down columns: "auto"
        (default: the Pallas kernels on TPU and GPU, XLA on a CPU), "xla" or "pallas"
        (`kernels.decode_ffn.gather_row_dots`, then `values_matvec`; interpret mode on a CPU).
    """

    name: ClassVar[str] = "pop-gate"

    def candidate_scorer(self, f, n_keep, m):
        return GATE
