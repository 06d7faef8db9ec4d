"""POP as one plan (docs/methods.md §2, §7): a prompt partition, a candidate scorer, a band rule.

Prefill ranks every FFN channel by the prompt's importance ``I_j = ‖H[S, j]‖₂ · ‖W_d[:, j]‖₂``
and cuts the ranking into

    R  retained   the top n_R = n_keep − m            used at every decode step
    C  candidate  the next n_C                        m of them chosen per decode step
    P  pruned     the rest                            never used again

and the prompt's own output uses its top n_keep channels (base.score_prompt). Two parts of a
`POPPlan` vary, each a small frozen dataclass (so the plan stays a hashable jit static argument):

* the **band rule** says how wide C is: `GlobalBand` (n_C = 2m, straddling the cut: §2),
  `UnkeptBand` (n_C = f − n_R, every channel outside R: §7.4 ``band="all"``) or per-layer bands
  (layer_bands.PerLayerBands, m_l per layer: §7.3);
* the **candidate scorer** says how a decode step scores C, and so which rows of C it copies at
  prefill and reads per step: `ExactScorer` (POP's exact score, §2), gate_scored.GateScorer
  (§7.1), shortlist.ShortlistScorer (§7.4, §7.5) or low_rank.LowRankScorer (§7.2).

A scorer owns the partition state it reads (its compact blocks), its decode step and its byte
and FLOP counts; a band rule with one partition for every layer hands it R and C. The method
presets (core.POP, GateScoredPOP, ...) map their hyper-parameters onto one scorer and one rule.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from ... import kernels
from ...kernels.decode_ffn import block_matvec, gather_matvec
from ...kernels.ffn_layout import InputRows, channel_lines, input_layout
from ...kernels.int8 import Int8Weight, empty_along
from ...sharding import pad_ids
from ..prompt_tokens import scoring_tokens
from ..base import (
    gate_activation, check_choice, copy_candidates, AggregatedPlan, MethodError, activations, block_channels, copy_channels, copy_gate_up, down_proj,
    round_half_up, score_prompt, step_importance, take_channels, take_gate_up, top_blocks,
)


@dataclasses.dataclass(frozen=True)
class CandidateScorer:
    """How a decode step scores the candidates C and picks m of them (part of a `POPPlan`)."""

    name: ClassVar[str] = "pop"  # the registry name of the method this scorer makes of POP
    requires_data: ClassVar[bool] = False  # reads the method's calibrated data (w.data)

    @property
    def compact_weights(self) -> bool:
        """Whether the state holds copied weight rows (see base.AggregatedPlan)."""
        return True

    @property
    def kernel_wired(self) -> bool:
        """Whether the step reads its selected rows through a Pallas kernel when the plan's
        ``kernel`` names one (the exact scorer with compact weights, the gate and shortlist scorers)."""
        return False

    def prefill_state(self, plan: "POPPlan", w, x, valid, retained, candidates) -> dict:
        """The partition state of R = ``retained`` [n_R] and C = ``candidates`` [n_C] (channel
        ids by decreasing prompt importance), from the layer's weights ``w`` and the prompt
        x [B, T, d], valid [B, T]."""
        raise NotImplementedError  # pragma: no cover - interface

    def decode(self, plan: "POPPlan", w, state, x, valid) -> tuple[jax.Array, dict]:
        """x [B, 1, d], valid [B, 1] -> (y [B, 1, d], aux {"selected", "scores": [m]}, or {} when m = 0)."""
        raise NotImplementedError  # pragma: no cover - interface

    def weights_read(self, plan: "POPPlan", d: int) -> int:
        raise NotImplementedError  # pragma: no cover - interface

    def flops(self, plan: "POPPlan", d: int) -> int:
        raise NotImplementedError  # pragma: no cover - interface


@dataclasses.dataclass(frozen=True)
class ExactScorer(CandidateScorer):
    """POP's own step (§2): gate and up of R ∪ C, exact scores ``‖H_t[c]‖₂ · ‖W_d[:, c]‖₂``.

    The gate/up rows of R ∪ C and the down rows of R and of C are gathered once at prefill into
    the state (on a mesh split over "model", base.copy_channels); a step runs dense matmuls on
    those blocks and gathers only the m selected down rows. ``gather=True`` (POP's
    ``weights="gather"``) keeps channel ids only and gathers the rows from the model's weights
    at every step instead: same outputs, no copy.

    With a Pallas ``plan.kernel`` (POP's ``kernel``) C's down rows are copied at prefill as
    `ffn_layout.InputRows` [n_C, L, 128] (row i = candidate i's down column, zero past d) and a
    step adds the m selected ones through `kernels.decode_ffn.gather_matvec`, which reads only
    those m rows (block POP, ``block`` > 1: `kernels.decode_ffn.block_matvec`, its m/b blocks).
    The gate/up rows of R ∪ C stay a dense compact block: every candidate's score needs its H,
    so a step reads them all whatever the kernel (docs/kernels.md)."""

    gather: bool = False
    block: int = 1  # candidates chosen in whole blocks of this many consecutive positions of C (blocks.py)

    @property
    def compact_weights(self) -> bool:
        return not self.gather

    @property
    def kernel_wired(self) -> bool:
        return not self.gather

    def prefill_state(self, plan, w, x, valid, retained, candidates):
        """-> {retained_idx [n_R], candidate_idx [n_C], down_norm_candidates [n_C]} and, unless
        ``gather``, the compact blocks (`exact_blocks`)."""
        state = {
            "retained_idx": retained,
            "candidate_idx": candidates,
            "down_norm_candidates": copy_candidates(w.down_norm, candidates, axis=0),
        }
        if not self.gather:
            state.update(exact_blocks(w, retained, candidates))
            if plan.kernel != "xla":
                state["down_candidates"] = candidate_rows(w.down, candidates)
        return state

    def decode(self, plan, w, state, x, valid):
        """With ``gather`` the R ∪ C gate/up rows and R's down columns are gathered from the
        model's weights here, every step, instead of read from the prefill's copy."""
        if self.gather:
            gate_up = take_gate_up(w.gate_up, jnp.concatenate([state["retained_idx"], state["candidate_idx"]]))
        else:
            gate_up = state["gate_up"]
        h = activations(gate_up, x, gate_activation(w))  # [B, 1, (n_R' + n_C)']
        down_retained = take_channels(w.down, state["retained_idx"], axis=1) if self.gather else state["down_retained"]
        n_r = down_retained.shape[-1]  # n_R' (padded on a mesh, see exact_blocks)
        h_retained, h_candidates = h[..., :n_r], h[..., n_r : n_r + plan.n_candidates]
        y = down_proj(h_retained, down_retained)
        if plan.m == 0:
            return y, {}
        scores = step_importance(h_candidates, valid, state["down_norm_candidates"])  # [n_C]
        top_scores, selected = top_candidates(scores, plan.m, self.block)  # S_t, positions within C
        selected_ids = take_channels(state["candidate_idx"], selected, axis=0)
        if plan.kernel != "xla":  # the kernel reads the m selected rows of C's InputRows copy
            batch, d = x.shape[0], x.shape[-1]
            h_c = h_candidates.reshape(batch, plan.n_candidates)
            if self.block > 1:  # whole blocks: their ids, each block fetched as one contiguous slab
                y_c = kernel_block_down(plan, h_c, state["down_candidates"], selected, self.block, d)
            else:
                y_c = gather_matvec(h_c, state["down_candidates"], selected, out_features=d, kernel=plan.kernel)
            return y + y_c.reshape(y.shape).astype(y.dtype), {"selected": selected_ids, "scores": top_scores}
        if self.gather:  # only the m selected down columns, as rows [m, d]
            down_selected = take_channels(w.down, selected_ids, axis=1).T
        else:
            down_selected = take_channels(state["down_candidates"], selected, axis=0)
        y = y + take_channels(h_candidates, selected, axis=-1) @ down_selected
        return y, {"selected": selected_ids, "scores": top_scores}

    def weights_read(self, plan, d):
        """Gate/up of R ∪ C, down of the n_keep used: 3d·n_R + 2d·n_C + d·m. The TPU kernel
        (and its interpret mode) reads each selected down row whole, L·128 ≥ d elements
        (`ffn_layout.channel_lines`); the GPU kernel loads only the first d."""
        width = channel_lines(d) * 128 if plan.kernel in kernels.TPU_KERNELS else d
        return 2 * d * (plan.n_retained + plan.n_candidates) + d * plan.n_retained + width * plan.m

    def flops(self, plan, d):
        return 4 * d * (plan.n_retained + plan.n_candidates) + 2 * d * plan.n_keep


def copy_channels_or_empty(w: jax.Array, ids: jax.Array, axis: int) -> jax.Array:
    """base.copy_channels, where a copy of no channel is an empty array: R is empty when
    m = n_keep (the unkept band at γ = 1: shortlisted dynamic selection), and on a mesh the
    copy's reduce-scatter does not lower at size 0."""
    if ids.shape[-1] == 0:
        return empty_along(w, axis)
    return copy_channels(w, ids, axis)


def exact_blocks(w, retained, candidates) -> dict:
    """The compact weight blocks of a partition: gate/up rows of R ∪ C [2, (n_R' + n_C)', d],
    down columns of R [d, n_R'] and down rows of C [n_C, d] (rows, so that a step gathers its m
    selected channels contiguously). On a mesh the first two are split over "model"
    (`copy_channels`; R and then R ∪ C padded with zero channels to a multiple of the split:
    n_R' ≥ n_R); C's down rows, which every step gathers from, stay replicated."""
    retained = pad_ids(retained)
    return {
        "gate_up": copy_gate_up(w.gate_up, jnp.concatenate([retained, candidates])),
        "down_retained": copy_channels_or_empty(w.down, retained, axis=1),
        "down_candidates": copy_candidates(w.down, candidates, axis=1).T,
    }


def top_candidates(scores: jax.Array, m: int, block: int = 1) -> tuple[jax.Array, jax.Array]:
    """The m best candidates of C's scores [n_C] -> (their scores [m], positions in C [m]):
    single channels, or (``block`` > 1, block POP) the m/block blocks of consecutive positions
    whose scores have the largest L2 norm, each block's positions in order (with its norm)."""
    if block == 1:
        return jax.lax.top_k(scores, m)
    top, ids = top_blocks(scores, m // block, block)
    return jnp.repeat(top, block), block_channels(ids, block)


def kernel_block_down(plan, h_c: jax.Array, rows: InputRows, selected: jax.Array, block: int, d: int) -> jax.Array:
    """C's down rows applied to h_c [B, n_C] over the selected positions ``selected`` [m] (whole
    blocks of ``block``, in order within each) by the plan's Pallas kernel -> [B, d]: each block
    fetched as one contiguous piece (`kernels.decode_ffn.block_matvec`)."""
    return block_matvec(h_c, rows, selected[::block] // block, block=block, out_features=d, kernel=plan.kernel)


def candidate_rows(down, candidates: jax.Array) -> InputRows:
    """C's down columns as the kernel's input-major rows: down [d, f] (an array or an
    `Int8Weight`, its per-output-channel scale [d, 1] kept), candidates [n_C] ->
    `ffn_layout.InputRows` values [n_C, L, 128] (+ scale [1, L·128] for int8). The kernel
    reads int8 weight-only (its h stays float), also on a model whose dots quantize
    activations (``Int8Weight.activations == "int8"``)."""
    columns = copy_candidates(down, candidates, axis=1)  # [d, n_C]
    if isinstance(columns, Int8Weight):
        return input_layout(columns.values, jnp.broadcast_to(columns.scale, (columns.shape[0], 1)))
    return input_layout(columns)


@dataclasses.dataclass(frozen=True)
class BandRule:
    """How wide the candidate band is. This base is a band fixed for every layer: prefill cuts
    the prompt ranking at n_R and n_R + n_C and the scorer does the rest."""

    def n_candidates(self, f: int, n_keep: int, m: int) -> int:
        raise NotImplementedError  # pragma: no cover - interface

    def selected(self, gamma: float, f: int, n_keep: int) -> int:
        """m, the candidates chosen per step, for a band of width ``gamma``."""
        raise NotImplementedError  # pragma: no cover - interface

    def check(self, scorer: CandidateScorer) -> None:
        """MethodError when this rule cannot run ``scorer`` (a fixed band runs every scorer)."""

    def plan_name(self, scorer: CandidateScorer) -> str:
        return scorer.name

    def prefill(self, plan: "POPPlan", w, x, valid):
        """x [B, T, d], valid [B, T] -> (y [B, T, d], partition state, {"importance": [f]})."""
        y, order, importance, h = score_prompt(w, x, valid, plan.n_keep, with_h=True)
        n_r, n_c = plan.n_retained, plan.n_candidates
        candidates = self.candidate_order(w, h, valid, order[n_r : n_r + n_c])
        state = plan.scorer.prefill_state(plan, w, x, valid, order[:n_r], candidates)
        return y, state, {"importance": importance}

    def candidate_order(self, w, h, valid, candidates: jax.Array) -> jax.Array:
        """C's channel ids [n_C] in the order prefill copies them: prompt importance (this rule;
        block POP may group co-active channels, blocks.py), from H [B, T, f] over valid [B, T]."""
        return candidates

    def decode(self, plan: "POPPlan", w, state, x, valid):
        return plan.scorer.decode(plan, w, state, x, valid)

    def weights_read(self, plan: "POPPlan", d: int) -> int:
        return plan.scorer.weights_read(plan, d)

    def flops(self, plan: "POPPlan", d: int) -> int:
        return plan.scorer.flops(plan, d)


@dataclasses.dataclass(frozen=True)
class GlobalBand(BandRule):
    """POP's band (§2): n_C = 2m channels straddling the cut at n_keep, with
    ``m = min(round(γ·f/2), f − n_keep, n_keep)`` so that C fits on both sides."""

    def n_candidates(self, f, n_keep, m):
        return 2 * m

    def selected(self, gamma, f, n_keep):
        return min(round_half_up(gamma * f / 2), f - n_keep, n_keep)


@dataclasses.dataclass(frozen=True)
class UnkeptBand(BandRule):
    """Every channel outside R is a candidate (§7.4 ``band="all"``): n_C = f − n_R, no pruned
    region, and ``m = min(round(γ·n_keep), n_keep)`` (γ = 1 leaves R empty: the selection of
    §7.5, dynamic over every channel)."""

    def n_candidates(self, f, n_keep, m):
        return f - (n_keep - m)

    def selected(self, gamma, f, n_keep):
        return min(n_keep, round_half_up(gamma * n_keep))


EXACT, GLOBAL_BAND, UNKEPT_BAND = ExactScorer(), GlobalBand(), UnkeptBand()


@dataclasses.dataclass(frozen=True)
class POPPlan(AggregatedPlan):
    """POP resolved for one model: sizes f, n_keep, m (static), a candidate scorer and a band rule.

    ``blocks``: block slots per layer of a mixture-of-experts model (models.moe.MoEConfig.slots),
    the row stride of the per-block tables a part reads (models.moe.table_row); 0 for a dense
    model or a plan that reads none."""

    m: int = 0  # candidates selected per step (per-layer bands: POP's m, the budget)
    scorer: CandidateScorer = EXACT
    band: BandRule = GLOBAL_BAND
    blocks: int = 0
    prompt_tokens: str = "all"  # which prompt tokens of a VLM's prompt score the partition (prompt_tokens.py)
    # what reads the selected candidates' rows at decode (`popjax.kernels.RESOLVED`, resolved at
    # bind by `kernels.choose`): "xla", or a Pallas kernel (a scorer whose `kernel_wired` says so)
    kernel: str = "xla"

    def __post_init__(self):
        self.band.check(self.scorer)
        check_choice("kernel", self.kernel, kernels.RESOLVED)
        if self.kernel != "xla" and not self.scorer.kernel_wired:
            raise MethodError(f"kernel={self.kernel!r} is wired for the exact scorer with compact weights, the gate, the "
                              f"shortlist and the low-rank scorers only, not {self.scorer!r}")

    @property
    def name(self) -> str:  # what the presets are registered as: "pop", "pop-gate", ...
        return self.band.plan_name(self.scorer)

    @property
    def n_retained(self) -> int:
        return self.n_keep - self.m

    @property
    def n_candidates(self) -> int:
        return self.band.n_candidates(self.f, self.n_keep, self.m)

    @property
    def bands(self) -> tuple[int, ...]:
        """m_l per layer (a MoE model: per (layer, block slot)) of a per-layer band rule; () when
        the band is the same for every layer."""
        return getattr(self.band, "bands", ())

    @property
    def compact_weights(self) -> bool:  # see AggregatedPlan
        return self.scorer.compact_weights

    @property
    def requires_data(self) -> bool:
        return self.scorer.requires_data

    def prefill(self, w, x, valid):
        """The prompt tokens that score the partition replace ``valid`` (image tokens read from
        ``w.image_tokens``, present for a batch with images)."""
        per_row = self.aggregate == "per_sequence"
        return super().prefill(w, x, scoring_tokens(valid, w.image_tokens, self.prompt_tokens, per_row))

    def _prefill(self, w, x, valid):
        return self.band.prefill(self, w, x, valid)

    def _decode(self, w, state, x, step, valid):
        """x [B, 1, d] -> (y [B, 1, d], state (unchanged), the scorer's aux)."""
        y, aux = self.band.decode(self, w, state, x, valid)
        return y, state, aux

    def ffn_flops_per_token(self, d: int) -> int:
        return self.band.flops(self, d)

    def ffn_weights_read(self, d: int) -> int:
        return self.band.weights_read(self, d)
