"""Per-layer bands: POP with a candidate band per layer, wider where the channel ranking drifts
more, under POP's total byte budget (docs/methods.md §7.3; docs/frontier_methods.md §3).

**Drift** of a prompt at a layer (prefill statistics only): split each sequence's valid tokens
into its first and second half (token p of n is in the first half when 2p < n), score
``I^A``, ``I^B`` (POP's metric, §2) on each half, and

    drift = 1 − |top_{n_keep}(I^A) ∩ top_{n_keep}(I^B)| / n_keep  ∈ [0, 1]

the fraction of the kept set that changes within the prompt, a proxy for how far decode steps
will move from the prompt's partition.

**Allocation** (`allocate_bands`): budget ``Σ_l m_l ≤ L·m`` with POP's m at the same γ, so the
total FFN weights read, ``Σ_l (3d·n_keep + 2d·m_l)``, never exceeds POP's. Widths come from a
small static set ``{min(round(c·m), f − n_keep, n_keep) : c ∈ levels}``; every layer starts at the
narrowest, then the layer furthest below its proportional target ``L·m·D_l/Σ D`` (ties: lower
layer) moves up one width while the budget allows. Equal drifts give POP's uniform bands.

**Where the drift comes from.** A per-prompt allocation needs every layer's drift before any
layer's band is fixed, and the method interface sees one layer at a time (no hook after the
prefill of all layers). So `prepare` measures the mean drift per layer over the calibration
corpus (each window is one prompt; popjax.calibration, cached) and fixes the bands per model.
The prompt's own drift is still reported as the prefill aux ``drift``.

**The band rule** (`PerLayerBands`, the band of a `POPPlan` with POP's exact scorer). Its state
holds the top ``n_keep + m_max`` channels (m_max = widest band), ordered by prefill rank: the
first ``n_keep − m_max`` (retained in every branch) as gate/up ``[2, n, d]`` and down ``[d, n]``
blocks that one dot per step reads whole (split over ``model`` on a mesh, base.copy_channels),
and the next ``2·m_max`` (the band zone) as gate/up rows ``[2m_max, 2, d]`` and down rows
``[2m_max, d]``. Decode runs ``lax.switch`` over one branch per distinct width; branch m_l reads
the static prefix of ``m_max + m_l`` band-zone rows (retained: the first m_max − m_l;
candidates: the next 2m_l) and top-k's inside its band. The switch index is a per-layer constant
(from ``w.layer``), so each layer executes one branch. The bands stay in the plan (a tuple of
ints, hashable): the branches and the state's shapes depend on them anyway.

**Mixture-of-experts models** (docs/moe.md): every FFN block is a unit of the allocation — its
drift measured on the calibration tokens routed to it (all tokens for a shared-expert or
dense-layer block), its own band ``m_b``, with ``Σ_b m_b ≤ (number of blocks)·m`` — and the
branch index is a per-block constant (``w.block``). A block no calibration window reached
has drift 0.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from ...calibration import Statistic, calibrate
from ...loaded import unrolled
from ...models.config import ModelConfig
from ...models.moe import table_row
from ..base import (
    gate_activation, copy_candidates, DensePlan, MethodError, Plan, activations, dot, down_proj, kept_channels, prefill_importance, round_half_up, score_prompt,
    take_channels,
)
from .core import POPPreset
from .gate_scored import kernel_down, kernel_row_width
from .plan import EXACT, GLOBAL_BAND, BandRule, POPPlan, candidate_rows, copy_channels_or_empty

DEFAULT_LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0)


def prompt_drift(h: jax.Array, valid: jax.Array, down_norm: jax.Array, n_keep: int) -> jax.Array:
    """1 − |top_n_keep(I^A) ∩ top_n_keep(I^B)| / n_keep over the batch's first/second halves:
    h [B, T, f], valid [B, T] -> fp32 scalar."""
    pos = jnp.cumsum(valid, axis=1) - 1
    first = valid & (2 * pos < jnp.sum(valid, axis=1, keepdims=True))
    halves = [prefill_importance(h, v, down_norm) for v in (first, valid & ~first)]
    kept = [jnp.zeros(h.shape[-1], jnp.int32).at[jax.lax.top_k(i, n_keep)[1]].set(1) for i in halves]
    changed = n_keep - jnp.sum(kept[0] * kept[1])  # an integer: the drift can never round below 0
    return changed.astype(jnp.float32) / n_keep


@dataclasses.dataclass(frozen=True)
class BandDrift(Statistic):
    """Σ over calibration windows of each window's `prompt_drift`, and the window count."""

    name: ClassVar[str] = "band_drift"
    version: ClassVar[int] = 2  # 2: drift as (n_keep − overlap)/n_keep, never −ε
    n_keep: int = 1

    def collect(self, w, x, valid, h):
        one = lambda hb, vb: prompt_drift(hb[None], vb[None], w.down_norm, self.n_keep)
        drift = jax.vmap(one)(h, valid)  # [B]
        has = jnp.any(valid, axis=1)
        return {"drift": jnp.sum(jnp.where(has, drift, 0.0)), "prompts": jnp.sum(has)}


def band_widths(m: int, cap: int, levels: tuple[float, ...]) -> tuple[int, ...]:
    """The distinct band widths (ascending) of ``levels`` × m, clamped to ``cap``."""
    return tuple(sorted({min(round_half_up(c * m), cap) for c in levels}))


def allocate_bands(drift, m: int, cap: int, levels: tuple[float, ...] = DEFAULT_LEVELS) -> tuple[int, ...]:
    """Per-layer selected counts m_l with Σ m_l ≤ L·m, wider where ``drift`` [L] is larger (see
    the module docstring)."""
    drift = np.asarray(drift, np.float64)
    widths = band_widths(m, cap, levels)
    L, budget = len(drift), len(drift) * m
    target = np.full(L, float(m)) if drift.sum() <= 0 else budget * drift / drift.sum()
    level = np.zeros(L, int)
    spent = L * widths[0]
    while True:
        fits = [l for l in range(L) if level[l] + 1 < len(widths) and spent + widths[level[l] + 1] - widths[level[l]] <= budget]
        if not fits:
            break
        l = max(fits, key=lambda i: (target[i] - widths[level[i]], -i))
        spent += widths[level[l] + 1] - widths[level[l]]
        level[l] += 1
    return tuple(int(widths[k]) for k in level)


@dataclasses.dataclass(frozen=True)
class BandAllocation:
    """Per-layer band widths m_l and the mean drift they came from (the method's calibration)."""

    bands: tuple[int, ...]
    drift: tuple[float, ...] = ()
    source: str = ""

    def __repr__(self) -> str:
        return f"BandAllocation(bands={list(self.bands)}, from {self.source!r})"


@dataclasses.dataclass(frozen=True)
class PerLayerBands(BandRule):
    """m_l of 2·m_l candidates per layer (a MoE model: per (layer, block slot) row of
    ``bands``, row-major; ``used`` marks the rows that hold a block, for the cost accounting).
    Runs POP's exact scorer only (its state has its own layout, see the module docstring)."""

    bands: tuple[int, ...] = ()
    used: tuple[bool, ...] = ()

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.bands)))

    @property
    def m_max(self) -> int:
        return max(self.bands)

    def n_candidates(self, f, n_keep, m):  # POP's at the budget m; each layer has 2·m_l
        return 2 * m

    def selected(self, gamma, f, n_keep):  # the budget: POP's m at γ
        return GLOBAL_BAND.selected(gamma, f, n_keep)

    def check(self, scorer):
        if scorer != EXACT:
            raise MethodError(f"per-layer bands run POP's exact scorer with compact copies only, not {scorer!r}")

    def plan_name(self, scorer):
        return "pop-bands"

    def prefill(self, plan, w, x, valid):
        """x [B, T, d], valid [B, T] -> (y [B, T, d], state, {"importance": [f], "drift": []})."""
        y, order, importance = score_prompt(w, x, valid, plan.n_keep)
        n_core = plan.n_keep - self.m_max
        kept = order[: plan.n_keep + self.m_max]
        core, band = kept[:n_core], kept[n_core:]
        state = {
            "kept_idx": kept,  # [n_keep + m_max], by decreasing prompt importance
            # retained in every branch: split over "model" on a mesh (zero channels pad to n_core')
            "core_gate_up": copy_channels_or_empty(w.gate_up, core, axis=1),  # [2, n_core', d]
            "core_down": copy_channels_or_empty(w.down, core, axis=1),  # [d, n_core']
            # the widest band's zone: retained or candidate by branch, gathered from per step
            "band_gate_up": copy_candidates(w.gate_up, band, axis=1).swapaxes(0, 1),  # [2 m_max, 2, d]
            # [2 m_max, d], or the kernel's input-major rows (`plan.candidate_rows`)
            "band_down_rows": copy_candidates(w.down, band, axis=1).T if plan.kernel == "xla" else candidate_rows(w.down, band),
            "band_down_norm": copy_candidates(w.down_norm, band, axis=0),  # [2 m_max]
        }
        h = activations(w.gate_up, x, gate_activation(w))  # XLA shares it with score_prompt's
        return y, state, {"importance": importance, "drift": prompt_drift(h, valid, w.down_norm, plan.n_keep)}

    def _branch(self, plan, m_l: int, act):
        """The band part of the decode of a layer that selects m_l of 2·m_l candidates: the band
        zone's first m_max − m_l rows are retained, the next 2·m_l its candidates."""

        def run(state, x, valid):
            n_r, rows = self.m_max - m_l, self.m_max + m_l  # within the band zone
            y = jnp.zeros_like(x)
            selected = jnp.full((self.m_max,), -1, jnp.int32)
            if rows == 0:
                return y, {"band": jnp.int32(m_l), "selected": selected}
            gu = dot("bsd,nkd->bsnk", x, state["band_gate_up"][:rows])  # static prefix only
            h = act(gu[..., 0]) * gu[..., 1]  # [B, 1, rows]
            used, h_used = jnp.arange(n_r, dtype=jnp.int32), h[..., :n_r]  # the zone's down rows this branch reads
            if m_l:
                h_c = h[..., n_r:]
                scores = prefill_importance(h_c, valid, state["band_down_norm"][n_r:rows])
                pick = jax.lax.top_k(scores, m_l)[1]
                used, h_used = jnp.concatenate([used, n_r + pick]), jnp.concatenate([h_used, take_channels(h_c, pick, axis=-1)], -1)
                band_ids = state["kept_idx"][plan.n_keep - self.m_max :]
                selected = selected.at[:m_l].set(take_channels(band_ids[n_r:rows], pick, axis=0))
            if plan.kernel != "xla":  # every branch reads m_max down rows of the zone: one kernel call
                y = kernel_down(plan, state["band_down_rows"], h_used, used, x.shape[-1]).astype(x.dtype)
            else:
                y = h_used[..., :n_r] @ state["band_down_rows"][:n_r]
                if m_l:
                    y = y + h_used[..., n_r:] @ take_channels(state["band_down_rows"], used[n_r:], axis=0)
            return y, {"band": jnp.int32(m_l), "selected": selected}

        return run

    def decode(self, plan, w, state, x, valid):
        """x [B, 1, d] -> (y [B, 1, d], {"band": [], "selected": [m_max] (−1 pads)})."""
        widths = self.widths
        level = jnp.asarray([widths.index(b) for b in self.bands], jnp.int32)[table_row(w, plan.blocks)]
        y, aux = jax.lax.switch(level, [self._branch(plan, m_l, gate_activation(w)) for m_l in widths], state, x, valid)
        return y + down_proj(activations(state["core_gate_up"], x, gate_activation(w)), state["core_down"]), aux

    def _counted(self) -> tuple[int, ...]:
        """The bands of the rows that hold an FFN (all of them in a dense model)."""
        return tuple(b for b, u in zip(self.bands, self.used or (True,) * len(self.bands)) if u)

    def weights_read_per_layer(self, plan, d: int) -> tuple[int, ...]:
        """Per layer (a MoE model: per block that exists); the TPU kernel reads each of the zone's
        m_max down rows whole, L·128 ≥ d (`kernel_row_width`)."""
        wider = (kernel_row_width(plan, d) - d) * self.m_max
        return tuple(3 * d * plan.n_keep + 2 * d * m_l + wider for m_l in self._counted())

    def weights_read(self, plan, d):
        """The mean over layers (the total is at most POP's at the same γ)."""
        return round_half_up(float(np.mean(self.weights_read_per_layer(plan, d))))

    def flops(self, plan, d):
        return round_half_up(float(np.mean([6 * d * plan.n_keep + 4 * d * m_l for m_l in self._counted()])))


def layer_bands_plan(f: int, n_keep: int, m: int = 0, bands: tuple[int, ...] = (), aggregate: str = "shared",
                     blocks: int = 0, used: tuple[bool, ...] = ()) -> POPPlan:
    """The plan `LayerBandsPOP` binds to: POP's exact scorer under `PerLayerBands`."""
    return POPPlan(f=f, n_keep=n_keep, aggregate=aggregate, m=m, band=PerLayerBands(tuple(bands), tuple(used)), blocks=blocks)




@dataclasses.dataclass(frozen=True)
class LayerBandsPOP(POPPreset):
    """POP with per-layer bands under POP's byte budget: ``LayerBandsPOP(ratio=0.2, gamma=0.1,
    levels=DEFAULT_LEVELS, aggregate="per_sequence" | "shared")``; ``prepare(model)`` measures
    the drift on the calibration corpus and allocates the bands (cached).

    Args:
      ratio, gamma, aggregate: as POP; γ sets the budget (POP's bytes at this γ).
      levels: band widths as multiples of POP's m (a small static set; one must be ≤ 1).
      allocation: the per-layer bands (`BandAllocation`; from ``prepare`` or `allocate_bands`).
      kernel: how a step reads its band zone's down rows: "auto" (the Pallas kernel on TPU and
        GPU, XLA on a CPU), "xla" or "pallas" (`kernels.decode_ffn.values_matvec`: each branch
        reads m_max rows, its retained and its selected ones, in one call).
    """

    name: ClassVar[str] = "pop-bands"
    calibrates: ClassVar[bool] = True  # the per-layer drift, once per model (cached)
    levels: tuple[float, ...] = dataclasses.field(default=DEFAULT_LEVELS, kw_only=True)
    allocation: BandAllocation | None = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self):
        super().__post_init__()
        levels = self.levels
        if not (isinstance(levels, tuple) and levels and all(isinstance(c, (int, float)) and c >= 0 for c in levels)):
            raise MethodError(f"levels={levels!r} must be a non-empty tuple of multiples of m, each ≥ 0")
        if min(levels) > 1:
            raise MethodError(f"levels={levels!r} has no multiple ≤ 1, so no allocation meets POP's budget")
        if self.allocation is not None and not isinstance(self.allocation, BandAllocation):
            raise MethodError(f"allocation={self.allocation!r} is not a BandAllocation (use prepare(model))")

    def sizes(self, cfg: ModelConfig) -> tuple[int, int, int]:
        """-> (n_keep, POP's m, the cap f − n_keep, n_keep on any band)."""
        f, n_keep = cfg.intermediate_size, kept_channels(cfg, self.ratio)
        return n_keep, GLOBAL_BAND.selected(self.gamma, f, n_keep), min(f - n_keep, n_keep)

    def with_drift(self, drift, source: str = "") -> "LayerBandsPOP":
        """A copy whose bands are allocated from a per-layer drift [L] (`allocate_bands`)."""
        values = np.asarray(drift, np.float64)
        if values.ndim != 1 or not np.all(np.isfinite(values)) or np.any(values < 0):
            raise MethodError(f"drift={drift!r} must be a finite, non-negative vector [L]")
        return dataclasses.replace(self, allocation=BandAllocation((), tuple(map(float, values)), source))

    def prepare(self, model, **calibrate_kwargs) -> "LayerBandsPOP":
        """Ready for ``model``: mean prompt drift per layer on the calibration corpus (cached)."""
        if self.allocation is not None:
            return self
        n_keep, _, _ = self.sizes(model.config)
        if n_keep == model.config.intermediate_size:
            return self  # binds to the dense plan
        sums = calibrate(unrolled(model), BandDrift(n_keep=n_keep), **calibrate_kwargs)
        drift = np.asarray(sums["drift"], np.float64) / np.maximum(np.asarray(sums["prompts"]), 1)
        return self.with_drift(drift.reshape(-1), f"{model.source} / calibration corpus")  # MoE: [L, slots] row-major

    def bind(self, cfg: ModelConfig) -> Plan:
        f = cfg.intermediate_size
        n_keep, m, cap = self.sizes(cfg)
        if n_keep == f:
            return DensePlan(f=f, n_keep=f)
        if self.allocation is None:
            raise MethodError("LayerBandsPOP has no band allocation: use LayerBandsPOP(...).prepare(model) first")
        L = cfg.num_hidden_layers
        blocks = 0 if cfg.moe is None else cfg.moe.slots(L)
        used = np.ones(L, bool) if not blocks else cfg.moe.slot_mask(L).reshape(-1)  # rows of the band table
        units = f"{L} layers" + (f" × {blocks} FFN block slots" if blocks else "")
        bands = self.allocation.bands
        if not bands:  # drift given, bands not yet allocated for this model's sizes
            drift = np.asarray(self.allocation.drift, np.float64)
            if len(drift) != len(used):
                raise MethodError(f"drift has {len(drift)} {'layers' if not blocks else 'entries'}, the model has {units}")
            bands = np.full(len(used), band_widths(m, cap, self.levels)[0])  # rows without a block: the narrowest
            bands[used] = allocate_bands(drift[used], m, cap, self.levels)
            bands = tuple(int(b) for b in bands)
        n_units = int(used.sum())
        if len(bands) != len(used) or sum(np.asarray(bands)[used]) > n_units * m or max(bands) > cap:
            raise MethodError(
                f"bands {list(bands)} do not fit this model: need {units}, "
                f"Σ m_l ≤ {'L' if not blocks else 'blocks'}·m = {n_units * m} (POP's budget at gamma={self.gamma}), each ≤ {cap}"
            )
        plan = layer_bands_plan(f, n_keep, m, tuple(bands), self.aggregate, blocks, tuple(bool(u) for u in used) if blocks else ())
        return dataclasses.replace(plan, prompt_tokens=self.prompt_tokens, kernel=self.resolved_kernel())
