"""Low-rank-scored POP: POP's prefill partition, candidates scored through a truncated SVD of
the gate and up projections (docs/methods.md §7.2; docs/frontier_methods.md §2).

Offline, once per model and rank (cached next to the calibration statistics, keyed by a hash of
every weight and the rank): per layer, in float64 NumPy, ``W_g = U S Vᵀ`` and the same for W_u,
truncated to rank r and stored as ``in = V_r [d, r]`` and ``out = S_r U_rᵀ [r, f]`` (fp32), so
that ``x W_gᵀ ≈ (x V_r)(S_r U_rᵀ)``.

Decode step t, per layer (R, C and m as POP, §2):

1. R: exact ``H_t[R]`` from the compact gate/up rows, as POP.
2. C: ``g̃ = (x_t V_r^g) out^g[:, C]``, ``ũ = (x_t V_r^u) out^u[:, C]`` and the estimate
   ``ŝ_c = ‖silu(g̃_c) ⊙ ũ_c‖₂ · ‖W_d[:, c]‖₂`` (``project="gate_up"``, the default: POP's own
   score, approximated) or ``ŝ_c = ‖silu(g̃_c)‖₂ · ‖W_d[:, c]‖₂`` (``project="gate"``: one factor
   pair, half the scoring bytes, the gate-scored method's score).
3. ``S_t = top_m(ŝ)`` (``lax.top_k`` over the band only), then EXACT gate, up and down for S_t.

Weights read per token per layer: ``3d·n_R + k·r·(d + n_C) + 3d·m`` (k = 2 factor pairs for
"gate_up", 1 for "gate"), against POP's ``3d·n_R + 2d·n_C + d·m``. The factor's ``r·d`` is a
fixed cost, so low-rank scoring pays off for wide bands (at d = 576, r = 64, "gate": γ ≈ 0.53
for POP's bytes at γ = 0.1). At rank = min(d, f) the scores are exact (POP's selection).

**The factors are the method's calibrated data** (`LowRankPOP.data`: ``{"lowrank": {"inputs",
"outputs"}}``), passed by the engine into its compiled programs beside the weights
(``w.data``), not constants of the plan: a new model or rank compiles no new program for the
same sizes. Prefill copies the layer's ``in`` [d, k·r] and the band's columns of ``out``
[k, r, n_C] into the partition state, so a decode step reads only compact blocks.

**Mixture-of-experts models** (docs/moe.md): one pair of factors per FFN block (every routed
expert, every shared-expert or dense-layer block), rows ``[L · slots]`` by (layer, block slot),
and each block's prefill takes its own (``w.block``, models.moe.table_row).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import ClassVar, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ... import calibration
from ...loaded import unrolled
from ...models.config import ModelConfig
from ...models.moe import table_row
from ..base import (
    gate_activation, copy_candidates, DensePlan, MethodError, Plan, activations, dot, down_proj, gate_up_blocks, kept_channels, prefill_importance, take_channels,
)
from .core import POPPreset
from .gate_scored import kernel_down, kernel_row_dots, kernel_row_width, output_rows
from .plan import CandidateScorer, POPPlan, candidate_rows, check_choice, copy_channels_or_empty

log = logging.getLogger(__name__)

PROJECTS = ("gate_up", "gate")
SVD_VERSION = 1


@dataclasses.dataclass(frozen=True, eq=False)
class LowRankFactors:
    """Truncated SVD factors of every layer's gate (index 0) and up (index 1) projection.

    ``inputs`` [L, 2, d, r] = V_r; ``outputs`` [L, 2, r, f] = S_r U_rᵀ (fp32, read-only); a MoE
    model's have ``L · blocks`` rows, one per (layer, block slot). Equal and hashed by ``key``
    (the model fingerprint) and ``rank``: a method holding them stays hashable and comparable."""

    key: str
    rank: int
    inputs: np.ndarray
    outputs: np.ndarray
    blocks: int = 0  # block slots per layer of a MoE model (models.moe.MoEConfig.slots), 0: dense

    def __hash__(self) -> int:
        return hash((self.key, self.rank))

    def __eq__(self, other) -> bool:
        return isinstance(other, LowRankFactors) and (self.key, self.rank) == (other.key, other.rank)

    def __repr__(self) -> str:
        L, _, d, r = self.inputs.shape
        return f"LowRankFactors(rank={r}, layers={L}, d={d}, f={self.outputs.shape[-1]}, key={self.key[:12]})"


def check_rank(rank: int, d: int | None = None, f: int | None = None) -> None:
    """rank must be an integer in [1, min(d, f)] (the upper bound once the model is known)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise MethodError(f"rank={rank!r} is invalid: the SVD rank must be an integer ≥ 1")
    if d is not None and f is not None and rank > min(d, f):
        raise MethodError(f"rank={rank} exceeds min(d, f) = min({d}, {f}) = {min(d, f)}; use 1 ≤ rank ≤ {min(d, f)}")


def factors_from_weights(gate_ups: Sequence[np.ndarray], rank: int, key: str = "weights") -> LowRankFactors:
    """Truncated SVDs (float64 NumPy) of each layer's gate and up rows: gate_ups L × [2, f, d]."""
    gate_ups = [np.asarray(g, np.float64) for g in gate_ups]
    f, d = gate_ups[0].shape[1:]
    check_rank(rank, d, f)
    inputs = np.zeros((len(gate_ups), 2, d, rank), np.float32)
    outputs = np.zeros((len(gate_ups), 2, rank, f), np.float32)
    for l, gate_up in enumerate(gate_ups):
        for k, w in enumerate(gate_up):  # gate, then up: w [f, d] = U S Vᵀ
            u, s, vt = np.linalg.svd(w, full_matrices=False)
            inputs[l, k] = vt[:rank].T
            outputs[l, k] = (u[:, :rank] * s[:rank]).T
    inputs.flags.writeable = outputs.flags.writeable = False
    return LowRankFactors(key, rank, inputs, outputs)


def lowrank_factors(model, rank: int, cache: bool = True, cache_dir: str | Path | None = None) -> LowRankFactors:
    """`factors_from_weights` for a loaded model (an int8 model's dequantized weights), computed
    once per (weights, rank) and kept in popjax's cache (kind "calibration", entry
    ``lowrank-svd-r<rank>``: made atomically, checksummed; ``cache_dir`` another cache root)."""
    cfg = model.config
    if cfg.intermediate_sizes is not None:
        raise MethodError(f"low-rank scoring needs one FFN width for all layers, got {list(cfg.intermediate_sizes)}")
    check_rank(rank, cfg.hidden_size, cfg.intermediate_size)
    model_key = calibration.model_fingerprint(model)
    blocks = 0 if cfg.moe is None else cfg.moe.slots(cfg.num_hidden_layers)

    def compute() -> dict[str, np.ndarray]:
        factors = factors_from_weights(gate_up_blocks(model), rank, model_key)  # all hosts' blocks
        return {"inputs": factors.inputs, "outputs": factors.outputs}

    key = {"format": calibration.CACHE_FORMAT, "model": model_key, "statistic": {"name": "lowrank_svd", "version": SVD_VERSION, "rank": rank}}
    arrays = (calibration.cached_arrays("calibration", key, compute, name=f"lowrank-svd-r{rank}", root=cache_dir)
              if cache else compute())
    arrays["inputs"].flags.writeable = arrays["outputs"].flags.writeable = False
    return LowRankFactors(model_key, rank, arrays["inputs"], arrays["outputs"], blocks)


def lowrank_data(factors: LowRankFactors) -> dict:
    """The factors as the calibrated data a `LowRankScorer` reads from ``w.data``:
    ``{"lowrank": {"inputs": [rows, 2, d, r], "outputs": [rows, 2, r, f]}}`` fp32 (rows = L,
    or L · block slots on a MoE model)."""
    return {"lowrank": {"inputs": jnp.asarray(factors.inputs), "outputs": jnp.asarray(factors.outputs)}}


@dataclasses.dataclass(frozen=True)
class LowRankScorer(CandidateScorer):
    """Candidates scored by a rank-``rank`` estimate of POP's score (``project="gate_up"``) or of
    the gate score (``"gate"``); exact gate, up and down for the m chosen."""

    name: ClassVar[str] = "pop-lowrank"
    requires_data: ClassVar[bool] = True
    rank: int = 1
    project: str = "gate_up"

    def __post_init__(self):
        check_choice("project", self.project, PROJECTS)

    @property
    def kernel_wired(self) -> bool:
        return True

    @property
    def n_factors(self) -> int:
        return 2 if self.project == "gate_up" else 1

    def prefill_state(self, plan, w, x, valid, retained, candidates):
        k = self.n_factors
        row = table_row(w, plan.blocks)  # the layer (a MoE model: the layer's block)
        factors = w.data["lowrank"]
        inputs, outputs = factors["inputs"][row, :k], factors["outputs"][row, :k]  # [k, d, r], [k, r, f]
        state = {
            "retained_idx": retained,  # [n_R]
            "candidate_idx": candidates,  # [n_C]
            # split over "model" on a mesh, padded with zero channels to n_R' (base.copy_channels)
            "gate_up": copy_channels_or_empty(w.gate_up, retained, axis=1),  # [2, n_R', d]
            "down_retained": copy_channels_or_empty(w.down, retained, axis=1),  # [d, n_R']
            "score_in": jnp.transpose(inputs, (1, 0, 2)).reshape(x.shape[-1], -1),  # [d, k r]
            "score_out": take_channels(outputs, candidates, axis=2),  # [k, r, n_C]
            "down_norm_candidates": copy_candidates(w.down_norm, candidates, axis=0),  # [n_C]
        }
        if plan.kernel == "xla":  # a candidate's gate row and up row side by side: a step gathers m rows
            state["gate_up_candidates"] = copy_candidates(w.gate_up, candidates, axis=1).swapaxes(0, 1)  # [n_C, 2, d]
            state["down_candidates"] = copy_candidates(w.down, candidates, axis=1).T  # [n_C, d]
        else:  # the kernels' layouts: C's gate and up rows as OutputRows, its down columns as InputRows
            state["gate_candidates"] = output_rows(copy_candidates(w.gate_up[0], candidates, axis=0))
            state["up_candidates"] = output_rows(copy_candidates(w.gate_up[1], candidates, axis=0))
            state["down_candidates"] = candidate_rows(w.down, candidates)
        return state

    def estimated_scores(self, state, x, valid, act=jax.nn.silu) -> jax.Array:
        """ŝ over the band from the rank-r factors: x [B, 1, d] -> [n_C] fp32."""
        z = jnp.einsum("bsd,dq->bsq", x, state["score_in"])  # [B, 1, k r]
        z = z.reshape(*z.shape[:-1], self.n_factors, self.rank)
        est = jnp.einsum("bskr,krc->bskc", z, state["score_out"])  # [B, 1, k, n_C]
        h = act(est[..., 0, :])  # the model's gate activation (`gate_activation`)
        if self.project == "gate_up":
            h = h * est[..., 1, :]
        return prefill_importance(h, valid, state["down_norm_candidates"])

    def decode(self, plan, w, state, x, valid):
        y = down_proj(activations(state["gate_up"], x, gate_activation(w)), state["down_retained"])
        if plan.m == 0:
            return y, {}
        act = gate_activation(w)
        top_scores, selected = jax.lax.top_k(self.estimated_scores(state, x, valid, act), plan.m)
        aux = {"selected": take_channels(state["candidate_idx"], selected, axis=0), "scores": top_scores}
        if plan.kernel != "xla":  # the m selected gate, up and down rows through the row kernels
            gate = kernel_row_dots(plan, state["gate_candidates"], x, selected)
            h_selected = act(gate) * kernel_row_dots(plan, state["up_candidates"], x, selected)  # [B, 1, m], exact
            return y + kernel_down(plan, state["down_candidates"], h_selected, selected, x.shape[-1]).astype(y.dtype), aux
        rows = take_channels(state["gate_up_candidates"], selected, axis=0)  # [m, 2, d]
        gu = dot("bsd,mkd->bsmk", x, rows)
        h_selected = act(gu[..., 0]) * gu[..., 1]  # [B, 1, m], exact
        return y + h_selected @ take_channels(state["down_candidates"], selected, axis=0), aux

    def scoring_elements(self, plan, d: int) -> int:
        """The factors a step reads: k·r·(d + n_C) (none when nothing is selected)."""
        return self.n_factors * self.rank * (d + plan.n_candidates) if plan.m else 0

    def weights_read(self, plan, d):
        """R's three rows, the factors, and the m selected rows' three (each L·128 ≥ d wide
        through the TPU kernels, `kernel_row_width`)."""
        return 3 * d * plan.n_retained + 3 * kernel_row_width(plan, d) * plan.m + self.scoring_elements(plan, d)

    def flops(self, plan, d):
        return 2 * (3 * d * plan.n_keep + self.scoring_elements(plan, d))


def lowrank_plan(f: int, n_keep: int, m: int = 0, aggregate: str = "shared", rank: int = 1, project: str = "gate_up",
                 blocks: int = 0) -> POPPlan:
    """The plan `LowRankPOP` binds to, at these sizes; it reads `lowrank_data` from ``w.data``."""
    return POPPlan(f=f, n_keep=n_keep, aggregate=aggregate, m=m, scorer=LowRankScorer(rank, project), blocks=blocks)




@dataclasses.dataclass(frozen=True)
class LowRankPOP(POPPreset):
    """POP with candidates scored at rank r: ``LowRankPOP(ratio=0.2, gamma=0.5, rank=64,
    project="gate_up" | "gate", aggregate="per_sequence" | "shared")``.

    Args:
      ratio, gamma, aggregate: as POP.
      rank: SVD rank of the scoring factors, 1 ≤ rank ≤ min(d, f).
      project: "gate_up" (estimate POP's score, two factor pairs) or "gate" (estimate the gate
        score only, one pair, half the scoring bytes).
      factors: the model's `LowRankFactors` (``prepare(model)`` computes or loads them); the
        engine receives them through `data`.
      kernel: how a step reads the m selected candidates' gate, up and down rows: "auto" (the
        Pallas kernels on TPU and GPU, XLA on a CPU), "xla" or "pallas"
        (`kernels.decode_ffn.gather_row_dots` twice, then `values_matvec`).
    """

    name: ClassVar[str] = "pop-lowrank"
    calibrates: ClassVar[bool] = True  # the SVD factors, once per model (cached)
    rank: int = dataclasses.field(default=64, kw_only=True)
    project: str = dataclasses.field(default="gate_up", kw_only=True)
    factors: LowRankFactors | None = dataclasses.field(default=None, kw_only=True, repr=False)

    def __post_init__(self):
        super().__post_init__()
        check_rank(self.rank)
        check_choice("project", self.project, PROJECTS)
        if self.factors is not None and not isinstance(self.factors, LowRankFactors):
            raise MethodError(f"factors={self.factors!r} is not LowRankFactors (use prepare(model))")

    def prepare(self, model) -> "LowRankPOP":
        """Ready for ``model``: the rank-r factors computed once per model (cached on disk)."""
        if self.factors is not None and self.factors.key == calibration.model_fingerprint(model) and self.factors.rank == self.rank:
            return self
        check_rank(self.rank, model.config.hidden_size, model.config.intermediate_size)
        return dataclasses.replace(self, factors=lowrank_factors(unrolled(model), self.rank))

    def candidate_scorer(self, f, n_keep, m):
        return LowRankScorer(self.rank, self.project)

    def bind(self, cfg: ModelConfig) -> Plan:
        check_rank(self.rank, cfg.hidden_size, cfg.intermediate_size)
        if self.factors is None:
            raise MethodError("LowRankPOP has no SVD factors: use LowRankPOP(...).prepare(model) first")
        L, _, d, r = self.factors.inputs.shape
        blocks = 0 if cfg.moe is None else cfg.moe.slots(cfg.num_hidden_layers)
        want = (cfg.num_hidden_layers * max(blocks, 1), cfg.hidden_size, self.rank, cfg.intermediate_size)
        if (L, d, r, self.factors.outputs.shape[-1]) != want or self.factors.blocks != blocks:
            raise MethodError(f"factors {self.factors!r} do not fit this model (layers{' × block slots' if blocks else ''}, d, rank, f) = {want}")
        plan = super().bind(cfg)
        return plan if isinstance(plan, DensePlan) else dataclasses.replace(plan, blocks=blocks)

    def data(self, model) -> dict | None:
        """The SVD factors for ``model`` (`lowrank_data`, checked by `bind`); None when the
        ratio keeps every channel (the dense plan reads none)."""
        self.bind(model.config)
        if kept_channels(model.config, self.ratio) == model.config.intermediate_size:
            return None
        return lowrank_data(self.factors)
