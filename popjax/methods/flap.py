"""FLAP — FLuctuation-based Adaptive structured Pruning ("Fluctuation-based Adaptive Structured
Pruning for Large Language Models", An, Zhao, Yu, Tang and Wang, AAAI 2024; docs/methods.md §5.2), FFN part.

From the dense model's activations a = H (the input of W_d) on calibration tokens, per layer l:

    μ_j = mean_t a_{t,j}                      F_j = mean_t (a_{t,j} − μ_j)²   (fluctuation)
    S_j = F_j · Σ_i W_d[i, j]²                z_j = (S_j − mean_l S) / std_l S  (standardised)

then ONE global threshold over the z-scores of all layers keeps ``L · n_keep`` channels in total
(the global budget of docs/methods.md §1), so each layer gets its own width. The output of a pruned channel
is replaced by its calibration mean: **bias compensation** ``b_l = W_d[:, P_l] · μ[P_l]`` (P_l the
pruned channels of layer l) is added to the down projection's output.

Decisions where the paper is silent (documented in docs too):

* **Floor.** A layer keeps at least ``max(1, ⌈min_keep · f⌉)`` channels (default 5% of f): each
  layer's top channels by z up to the floor are kept first, the rest of the budget goes by the
  global threshold. Without a floor a layer with uniformly low scores could lose its FFN. A ratio
  whose n_keep is below the floor cannot be met: a MethodError naming it.
* **Ties** in the global ranking go to the lower (layer, channel).
* F is the population variance (FLAP's code uses N − 1: a common factor that the per-layer
  standardisation removes); std in the z-score is also the population one (a factor common to all
  layers of the same width, so the global ranking is unchanged).
* Statistics come from the dense model in one pass (FLAP computes all layers' metrics before
  pruning any), accumulated as Σa, Σa² over batches in float64 on the host.

**Mixture-of-experts models** (docs/moe.md): every FFN block is one unit of FLAP — a routed
expert with the moments of the calibration tokens the router sent to it, a shared-expert or
dense-layer block with those of all tokens: its own z-scores, floor and bias (added to the
block's output, so the router weight scales it with the expert), and one global threshold over
the blocks keeps ``n_keep`` channels per block on average. Blocks keep different widths; the
method form pads them to the widest (static shapes). A block no calibration token reached keeps
its first n_keep channels in stored order (the weight-only ranking, docs/moe.md) with no bias.
Only the method form runs on MoE models; ``prune_model`` refuses them (popjax.pruned).

**Two forms.** ``popjax.pruned.prune_model(model, FLAP(ratio))`` gives the deployable checkpoint
(per-layer FFN widths plus a down bias); ``FLAP(ratio).calibrate(model)`` used as a method in
``generate`` applies the same kept channels and bias on the unpruned weights (SelectionPlan),
both passed into the compiled programs as the method's data (``data(model)``: ids [L, n_max]
int32, bias [L, d] float32), not baked into them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np
from flax import nnx

from .. import distributed
from ..calibration import CalibrationError, Corpus, Statistic, calibrate
from .base import MethodError, ffn_ratio
from .wanda_sp import CalibratedPruning, ChannelSelection
from ..convert.fused import dequantize_tree
from ..models.moe import slot_array


@dataclasses.dataclass(frozen=True)
class ActivationMoments(Statistic):
    """Σ_t a_tj, Σ_t a_tj² and the token count per layer (dense model)."""

    name: ClassVar[str] = "mlp_down_input_moments"
    version: ClassVar[int] = 1

    def collect(self, w, x, valid, h):
        hv = jnp.where(valid[..., None], h.astype(jnp.float32), 0.0)
        return {"sum": jnp.sum(hv, axis=(0, 1)), "sumsq": jnp.sum(hv * hv, axis=(0, 1)), "tokens": jnp.sum(valid, dtype=jnp.int32)}


def flap_layer_scores(var: np.ndarray, down: np.ndarray) -> np.ndarray:
    """S_j = F_j · Σ_i W_d[i,j]²: var [f]; down [d, f] -> [f] float64."""
    return var * np.sum(np.square(down.astype(np.float64)), axis=0)


def standardise(scores: np.ndarray) -> np.ndarray:
    """Per-layer z-scores of [L, f] scores (a constant layer gets 0)."""
    mu, sd = scores.mean(axis=1, keepdims=True), scores.std(axis=1, keepdims=True)
    return np.where(sd > 0, (scores - mu) / np.where(sd > 0, sd, 1.0), 0.0)


def layer_floor(f: int, min_keep: float) -> int:
    return max(1, math.ceil(min_keep * f - 1e-9))


def global_selection(z: np.ndarray, n_keep: int, floor: int) -> list[np.ndarray]:
    """Kept channel ids (ascending) per layer: each layer's top ``floor`` by z, then the rest of
    the ``L·n_keep`` budget by one global threshold on z. z [L, f]."""
    L, f = z.shape
    channel = np.arange(f)
    keep = np.zeros((L, f), bool)
    for l in range(L):
        keep[l, np.lexsort((channel, -z[l]))[:floor]] = True  # by z descending, ties to the lower id
    layer_of, channel_of = np.nonzero(~keep)
    order = np.lexsort((channel_of, layer_of, -z[layer_of, channel_of]))
    take = order[: L * n_keep - L * floor]
    keep[layer_of[take], channel_of[take]] = True
    return [np.flatnonzero(row) for row in keep]


def flap_selection(stats: dict[str, np.ndarray], downs: list[np.ndarray], n_keep: int, floor: int):
    """Calibration sums + the layers' W_d [d, f] -> (kept ids per layer, bias [L, d] float64, z [L, f])."""
    tokens = np.asarray(stats["tokens"], np.float64).reshape(-1)
    if np.any(tokens <= 0):
        raise CalibrationError("the calibration corpus gave no tokens; FLAP needs activations to score channels")
    mean = np.asarray(stats["sum"], np.float64) / tokens[:, None]
    var = np.maximum(np.asarray(stats["sumsq"], np.float64) / tokens[:, None] - mean**2, 0.0)
    scores = np.stack([flap_layer_scores(var[l], downs[l]) for l in range(len(downs))])
    z = standardise(scores)
    kept = global_selection(z, n_keep, floor)
    bias = []
    for l, down in enumerate(downs):
        pruned = np.setdiff1d(np.arange(down.shape[1]), kept[l])
        bias.append(down[:, pruned].astype(np.float64) @ mean[l, pruned])
    return kept, np.stack(bias), z


@dataclasses.dataclass(frozen=True)
class FLAP(CalibratedPruning):
    """FLAP: ``FLAP(ratio=0.2, min_keep=0.05)``; ``.calibrate(model, corpus)`` fixes the per-layer
    kept channels and bias (see the module docstring).

    Args:
      ratio: docs/methods.md §1's global ratio; the layers keep ``L · n_keep`` channels in total.
      min_keep: the floor, as a fraction of f each layer keeps at least (≥ 1 channel), in [0, 1].
    """

    name: ClassVar[str] = "flap"
    min_keep: float = dataclasses.field(default=0.05, kw_only=True)

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.min_keep, bool) or not (isinstance(self.min_keep, (int, float)) and 0.0 <= self.min_keep <= 1.0):
            raise MethodError(f"flap: min_keep={self.min_keep!r} is outside [0, 1]: the fraction of f every layer keeps at least")

    def n_keep(self, cfg) -> int:
        n_keep = super().n_keep(cfg)
        f = cfg.intermediate_size
        floor = layer_floor(f, self.min_keep)
        if n_keep < floor:
            p_attn, p_mlp = cfg.attention_params_per_layer(), cfg.mlp_params_per_layer()
            largest = (f - floor + 0.5) / f * p_mlp / (p_attn + p_mlp)  # the largest ratio whose n_keep reaches the floor
            raise MethodError(
                f"flap: ratio={self.ratio} keeps n_keep={n_keep} of f={f} channels per layer (FFN ratio "
                f"{ffn_ratio(cfg, self.ratio):.3f}), below every layer's floor of {floor} (min_keep={self.min_keep}); "
                f"use a ratio below about {largest:.3f} or a smaller min_keep"
            )
        return n_keep

    def select(self, model, corpus: Corpus, **calibrate_kwargs: Any) -> ChannelSelection:
        cfg = model.config
        n_keep = self.n_keep(cfg)
        stats = calibrate(model, ActivationMoments(), corpus, **calibrate_kwargs)
        floor = layer_floor(cfg.intermediate_size, self.min_keep)
        blocks = 0
        if cfg.moe is None:
            downs = [np.asarray(layer["mlp"]["down"], np.float32) for _, layer in sorted(_layers(model).items())]
            kept, bias, _ = flap_selection(stats, downs, n_keep, floor)
        else:
            blocks = cfg.moe.slots(cfg.num_hidden_layers)
            kept, bias = _block_selection(model, stats, n_keep, floor)
        return ChannelSelection(
            self.name,
            self.ratio,
            tuple(tuple(int(j) for j in k) for k in kept),
            tuple(tuple(float(v) for v in row) for row in bias.astype(np.float32)),
            f"{model.source} / {corpus.name} ({corpus.n_tokens} tokens)",
            blocks,
        )


def _block_selection(model, stats: dict[str, np.ndarray], n_keep: int, floor: int):
    """FLAP over the FFN blocks of a MoE model (stats [L, slots, ...]): the blocks with
    calibration tokens take part as FLAP's units; the others keep their first n_keep channels
    (the weight-only ranking) with no bias -> (kept ids per (layer, slot) row-major, bias [L·slots, d])."""
    cfg = model.config
    L = cfg.num_hidden_layers
    layers = _layers(model)
    downs = np.concatenate([slot_array(cfg, l, layers[l]["mlp"], "down") for l in range(L)]).astype(np.float32)
    flat = {k: np.asarray(v).reshape(downs.shape[0], *np.shape(v)[2:]) for k, v in stats.items()}
    scored = np.flatnonzero(cfg.moe.slot_mask(L).reshape(-1) & (flat["tokens"] > 0))
    if not scored.size:
        raise CalibrationError("the calibration corpus gave no tokens; FLAP needs activations to score channels")
    kept_scored, bias_scored, _ = flap_selection({k: v[scored] for k, v in flat.items()}, list(downs[scored]), n_keep, floor)
    kept = [np.arange(n_keep)] * downs.shape[0]
    bias = np.zeros(downs.shape[:2], np.float64)
    for i, k, b in zip(scored, kept_scored, bias_scored):
        kept[i], bias[i] = k, b
    return kept, bias


def _layers(model) -> dict[int, Any]:
    """The layers' parameter dicts of a LoadedModel, by index."""
    pure = dequantize_tree(distributed.to_host(nnx.to_pure_dict(model.params)))  # an int8 model's q · s; all hosts' blocks
    return {int(i): layer for i, layer in pure["layers"].items()}
