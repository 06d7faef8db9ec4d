"""Wanda-sp — the structured variant of Wanda ("A Simple and Effective Pruning Approach for Large
Language Models", Sun, Liu, Bair and Kolter, ICLR 2024), as defined and used as a baseline by FLAP
(An et al., AAAI 2024; docs/methods.md §5.1). Also the machinery both offline baselines share.

**Metric.** For the input a = H of W_d (the intermediate activation) on calibration tokens,

    S_j = mean_i |W_d[i, j]| · sqrt(mean_t a_{t,j}²)

and every layer keeps its top n_keep channels (uniform ratio; n_keep from docs/methods.md §1's global ratio).

**Pruned in order.** Layer l is scored on inputs that already went through the pruned layers
< l. The calibration pass does exactly that in one prefill: the whole corpus goes through as ONE
batch, and at each layer the collector scores the channels on that batch, keeps the top n_keep
and gives the next layer the pruned output (``WandaSPInOrder.output``). So a Wanda-sp
calibration holds ``n_windows × window`` tokens in one batch (16384 by default): choose the
corpus size with the activation memory in mind.

**Two forms.** ``WandaSP(ratio).calibrate(model)`` (or ``prepare``: calibrate once, cached by
popjax.calibration) gives a method whose kept channels are fixed; used in ``generate`` it gathers
the kept gate/up rows and down columns at prefill and runs the prompt and every step on them
(`SelectionPlan`). The kept ids are the method's data (``data(model)``: arrays passed into the
compiled programs beside the weights), not plan fields, so no id table is baked into a program
and a new calibration compiles nothing (FLAP's: unless its widest layer's width changes, a
shape). ``popjax.pruned.prune_model(model, WandaSP(ratio))`` writes them into a smaller
checkpoint instead: the deployable form, with the same outputs.

**Mixture-of-experts models** (docs/moe.md): every FFN block is pruned on its own — a routed
expert scored on the calibration tokens the router sent to it, a shared-expert or dense-layer
block on all tokens — and keeps n_keep of its f_e channels (the selection has one entry per
layer and block slot). A block no calibration token reached keeps its first n_keep channels in
stored order, i.e. the weight-only ranking (docs/moe.md). Only the method form runs on MoE
models; ``prune_model`` refuses them (popjax.pruned).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from ..loaded import unrolled
from ..calibration import Corpus, Statistic, calibrate
from ..models.config import ModelConfig
from .base import gate_activation, DensePlan, Method, MethodError, Plan, activations, check_global_ratio, down_proj, kept_channels, masked_down
from .base import copy_channels, copy_gate_up, rank_channels, resolve_corpus


@dataclasses.dataclass(frozen=True)
class ChannelSelection:
    """What an offline method calibrated: per layer the kept channel ids (ascending) and, for FLAP,
    the bias b_l [d] added to the down projection. What ``calibrate`` produces and the
    calibration cache stores; `selection_data` turns it into the arrays the plan reads.

    ``method`` and ``ratio`` say what it was calibrated for; ``source`` names model and corpus.
    ``blocks`` > 0 (a MoE model): ``kept`` and ``bias`` hold one entry per FFN block, row-major
    over (layer, block slot) with ``blocks`` slots per layer (`models.moe.MoEConfig.slots`)."""

    method: str
    ratio: float
    kept: tuple[tuple[int, ...], ...]
    bias: tuple[tuple[float, ...], ...] | None = None
    source: str = ""
    blocks: int = 0

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(len(k) for k in self.kept)

    def __repr__(self) -> str:  # the channel ids and bias values would fill a screen
        return f"ChannelSelection({self.method}, ratio={self.ratio}, widths={list(self.widths)}, from {self.source!r})"


def selection_data(kept, bias=None, blocks: int = 0) -> dict[str, jax.Array]:
    """Kept channel ids (and FLAP's bias) as the calibrated data `SelectionPlan` reads
    (`Method.data`, ``w.data``).

    kept: R rows of ascending ids (R = L, or L·blocks row-major over (layer, block slot) on a MoE
    model); bias: R rows of d values, or None ->
    ``{"kept": [L, n_max] int32, "bias": [L, d] float32}`` (no "bias" without one; [L, blocks,
    ...] when ``blocks`` > 0). Rows narrower than the widest, n_max, are padded with −1."""
    n_max = max(len(k) for k in kept)
    ids = np.full((len(kept), n_max), -1, np.int32)
    for r, k in enumerate(kept):
        ids[r, : len(k)] = k
    lead = (-1, blocks) if blocks else (-1,)
    out = {"kept": jnp.asarray(ids.reshape(*lead, n_max))}
    if bias is not None:
        b = np.asarray(bias, np.float32)
        out["bias"] = jnp.asarray(b.reshape(*lead, b.shape[-1]))
    return out


@dataclasses.dataclass(frozen=True)
class SelectionPlan(Plan):
    """A fixed channel selection per layer, read from the method's data (`selection_data`):
    ``w.data["kept"]`` [L, n_max] int32 (−1: padding) and, for FLAP, ``w.data["bias"]``
    [L, d]; ``w.layer`` picks the layer's row inside jit (in a MoE model the arrays are
    [L, blocks, ...] and ``w.block`` picks the block too). Layers may keep different numbers
    of channels: they are padded to the widest, and the padded down columns are zero, so they
    add nothing. ``n_keep`` is the mean width (the global budget), ``n_max`` the widest (the
    compact copies' static width)."""

    name: ClassVar[str] = "selection"
    n_max: int  # the widest layer's kept channels
    blocks: int = 0  # block slots per layer (MoE), 0: one entry per layer

    @property
    def requires_data(self) -> bool:
        return True

    def _tables(self, w):
        """This layer's (block's) ids [n_max] int32, column mask [n_max] float32 and bias [d]
        float32 (or None). Padding ids (−1) gather channel 0, whose column the mask zeroes."""
        data = w.data
        at = (w.layer, w.block) if self.blocks else (w.layer,)
        ids = data["kept"][at]
        if ids.shape != (self.n_max,):
            raise ValueError(f"selection data holds {ids.shape} ids per FFN block; this plan keeps up to n_max={self.n_max}: "
                             "pass data=method.data(model) of the method this plan was bound from")
        bias = data.get("bias")
        return jnp.maximum(ids, 0), (ids >= 0).astype(jnp.float32), None if bias is None else bias[at]

    def _apply(self, w, state, x, bias):
        """The kept channels' FFN on x (``w`` supplies the model's gate activation, `gate_activation`)."""
        y = down_proj(activations(state["gate_up"], x, gate_activation(w)), state["down"])
        return y if bias is None else y + bias.astype(y.dtype)

    def prefill(self, w, x, valid):
        """x [B, T, d] -> (y [B, T, d], compact kept blocks, {}) — the prompt runs pruned too."""
        idx, mask, bias = self._tables(w)
        down = copy_channels(w.down, idx, axis=1)  # [d, n_max'] (split over "model" on a mesh)
        mask = jnp.pad(mask, (0, down.shape[1] - mask.shape[0]))  # padding channels are zeros already
        state = {"gate_up": copy_gate_up(w.gate_up, idx), "down": down * mask.astype(down.dtype)}  # [2, n_max', d]
        return self._apply(w, state, x, bias), state, {}

    def decode(self, w, state, x, step, valid):
        return self._apply(w, state, x, self._tables(w)[2]), state, {}

    def ffn_flops_per_token(self, d: int) -> int:
        return 6 * d * self.n_max

    def ffn_weights_read(self, d: int) -> int:
        return 3 * d * self.n_max


def check_uniform_ffn(cfg: ModelConfig, method: str) -> None:
    if cfg.intermediate_sizes is not None:
        raise MethodError(
            f"{method} needs one FFN width for all layers; this model was pruned to per-layer widths "
            f"{list(cfg.intermediate_sizes)} (only dense inference runs on it)"
        )


@dataclasses.dataclass(frozen=True)
class CalibratedPruning(Method):
    """Base of the offline baselines: a global ``ratio`` and, once calibrated, a `ChannelSelection`."""

    calibrates: ClassVar[bool] = True
    ratio: float = 0.2
    _: dataclasses.KW_ONLY
    selection: ChannelSelection | None = None

    def __post_init__(self):
        check_global_ratio(self.ratio)
        if self.selection is not None and not isinstance(self.selection, ChannelSelection):
            raise MethodError(f"{self.name}: selection={self.selection!r} is not a ChannelSelection (use calibrate)")

    def n_keep(self, cfg: ModelConfig) -> int:
        n_keep = kept_channels(cfg, self.ratio)
        if n_keep < 1:
            raise MethodError(f"{self.name}: ratio={self.ratio} keeps no FFN channel of f={cfg.intermediate_size}; use a smaller ratio")
        return n_keep

    def select(self, model, corpus: Corpus, **calibrate_kwargs: Any) -> ChannelSelection:
        raise NotImplementedError  # pragma: no cover - interface

    def calibrate(self, model, corpus: Corpus | str | Path | None = None, **calibrate_kwargs: Any) -> "CalibratedPruning":
        """A copy holding the channels calibrated on ``corpus`` (default: the Shakespeare corpus;
        a path: a UTF-8 text file), cached on disk by `popjax.calibration.calibrate`."""
        check_uniform_ffn(model.config, self.name)
        model = unrolled(model)  # the selection walks model.layers[i]
        corpus = resolve_corpus(model, corpus)
        return dataclasses.replace(self, selection=self.select(model, corpus, **calibrate_kwargs))

    def prepare(self, model) -> "CalibratedPruning":
        """Ready for ``model``: itself when calibrated or when the ratio prunes nothing, else `calibrate`."""
        if self.selection is not None or kept_channels(model.config, self.ratio) == model.config.intermediate_size:
            return self
        return self.calibrate(model)

    def bind(self, cfg: ModelConfig) -> Plan:
        check_uniform_ffn(cfg, self.name)
        f, n_keep = cfg.intermediate_size, self.n_keep(cfg)
        if n_keep == f:
            return DensePlan(f=f, n_keep=f)
        sel = self.selection
        if sel is None:
            raise MethodError(f"{self.name} has no kept channels yet: use {type(self).__name__}(...).calibrate(model) (or .prepare(model)) first")
        L = cfg.num_hidden_layers
        blocks = 0 if cfg.moe is None else cfg.moe.slots(L)
        if (sel.method, sel.ratio) != (self.name, self.ratio) or len(sel.kept) != L * max(blocks, 1) or sel.blocks != blocks:
            raise MethodError(
                f"{self.name}(ratio={self.ratio}): its selection was calibrated by {sel.method} at ratio={sel.ratio} for "
                f"{len(sel.kept)} layers; this model has {L}"
                + (f" layers × {blocks} FFN block slots" if blocks else "") + ": calibrate again"
            )
        if sum(sel.widths) != n_keep * len(sel.kept) or any(max(k, default=-1) >= f for k in sel.kept):
            raise MethodError(f"{self.name}: the selection (widths {list(sel.widths)}) does not fit f={f}, n_keep={n_keep}: calibrate again")
        return SelectionPlan(f=f, n_keep=n_keep, n_max=max(sel.widths), blocks=blocks)

    def data(self, model) -> dict | None:
        """The selection for ``model`` as arrays, checked against it as ``bind`` checks:
        ``{"kept": [L, n_max] int32, "bias": [L, d] float32}`` (FLAP only; [L, blocks, ...] on a
        MoE model; see `selection_data`); None when the ratio prunes nothing."""
        if not isinstance(self.bind(model.config), SelectionPlan):
            return None
        sel = self.selection
        return selection_data(sel.kept, sel.bias, sel.blocks)


def wanda_sp_scores(h: jax.Array, valid: jax.Array, down: jax.Array) -> jax.Array:
    """S_j = mean_i |W_d[i,j]| · sqrt(mean_t a_tj²) over valid tokens: h [B, T, f] -> [f] fp32."""
    hv = jnp.where(valid[..., None], h.astype(jnp.float32), 0.0)
    mean_sq = jnp.sum(hv * hv, axis=(0, 1)) / jnp.maximum(jnp.sum(valid), 1)
    return jnp.mean(jnp.abs(down.astype(jnp.float32)), axis=0) * jnp.sqrt(mean_sq)


@dataclasses.dataclass(frozen=True)
class WandaSPInOrder(Statistic):
    """Wanda-sp's calibration in one pass over ONE batch: each layer is scored on the output of
    the already pruned layers before it, keeps its top ``n_keep`` and passes its pruned output on."""

    name: ClassVar[str] = "wanda_sp_in_order"
    version: ClassVar[int] = 1
    n_keep: int = 1

    def _kept(self, w, valid, h):
        scores = wanda_sp_scores(h, valid, w.down)
        return rank_channels(scores)[: self.n_keep], scores

    def collect(self, w, x, valid, h):
        kept, scores = self._kept(w, valid, h)
        hv = jnp.where(valid[..., None], h.astype(jnp.float32), 0.0)
        return {
            "kept": jnp.zeros(h.shape[-1], jnp.int32).at[kept].set(1),
            "scores": scores,
            "sumsq": jnp.sum(hv * hv, axis=(0, 1)),
            "tokens": jnp.sum(valid, dtype=jnp.int32),
        }

    def output(self, w, x, valid, h):
        return masked_down(h, self._kept(w, valid, h)[0], w.down)


@dataclasses.dataclass(frozen=True)
class WandaSP(CalibratedPruning):
    """Wanda-sp: ``WandaSP(ratio=0.2)``; ``.calibrate(model, corpus)`` fixes the kept channels
    (see the module docstring). ``ratio`` is docs/methods.md §1's global ratio: every layer keeps n_keep."""

    name: ClassVar[str] = "wanda-sp"

    def select(self, model, corpus: Corpus, **calibrate_kwargs: Any) -> ChannelSelection:
        if "batch_size" in calibrate_kwargs:
            raise MethodError("wanda-sp calibrates the whole corpus as one batch (layers pruned in order); batch_size cannot be set")
        stat = WandaSPInOrder(n_keep=self.n_keep(model.config))
        sums = calibrate(model, stat, corpus, batch_size=len(corpus.windows), **calibrate_kwargs)
        rows = np.asarray(sums["kept"])
        blocks = 0 if rows.ndim == 2 else rows.shape[1]  # a MoE model's [L, slots, f]
        rows = rows.reshape(-1, rows.shape[-1])
        # a slot without a block (zeros) keeps what a block without tokens keeps: the first n_keep
        kept = tuple(tuple(int(j) for j in (np.flatnonzero(r) if r.any() else range(stat.n_keep))) for r in rows)
        source = f"{model.source} / {corpus.name} ({corpus.n_tokens} tokens)"
        return ChannelSelection(self.name, self.ratio, kept, None, source, blocks)
