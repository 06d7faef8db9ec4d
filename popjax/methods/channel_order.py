"""A calibrated channel order for block-granular selection over the model's channels (block
static and block dynamic selection, ``block_order="calibrated"``).

Blocks of b consecutive channels of the model's own order group channels that share nothing,
and choosing whole blocks of them costs much NLL (docs/kernels.md, "Block-granular
selection"). A method that reads its blocks from one model-level copy (a block slab, an
input-major down copy) can hold one other order per model instead: each layer's channels by
decreasing importance over a calibration corpus,

    importance_j = √(Σ_t H[t, j]²) · ‖W_d[:, j]‖₂      over the corpus's valid tokens

(FLAP's statistic, `flap.ActivationMoments`, through the one calibration pipeline and cache), so
that a block holds channels of neighbouring typical importance. The copy is built in that order
and a step chooses blocks of it: block k holds channels ``order[l, k·b … k·b + b − 1]``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from ..calibration import calibrate
from ..loaded import check_uniform_ffn, unrolled
from ..models.config import ModelConfig
from .base import MethodError, block_channels, check_choice, kept_channels, resolve_corpus, top_blocks
from .fitted import FittedArrays
from .flap import ActivationMoments

BLOCK_ORDERS = ("model", "calibrated")  # the channel order blocks are of


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class ChannelOrder(FittedArrays):
    """Every layer's channels by decreasing calibration importance, ``order`` [L, f] int32;
    ``source``: the model and corpus it came from."""

    source: str
    order: np.ndarray


def calibrated_order(model, corpus=None, **calibrate_kwargs: Any) -> ChannelOrder:
    """``model``'s `ChannelOrder` over ``corpus`` (a `Corpus`, a UTF-8 text file, or None: the
    default Shakespeare corpus), its statistic cached by `popjax.calibration.calibrate`."""
    try:
        check_uniform_ffn(model.config)
    except ValueError as err:
        raise MethodError(f"block_order='calibrated' orders one stack of equal FFNs: {err}") from None
    model = unrolled(model)
    corpus = resolve_corpus(model, corpus)
    sumsq = calibrate(model, ActivationMoments(), corpus, **calibrate_kwargs)["sumsq"]  # [L, f]
    stack = model.ffn_stack()
    down = np.asarray(stack.down, np.float64) * (1.0 if stack.down_scale is None else np.asarray(stack.down_scale, np.float64))
    importance = np.sqrt(np.asarray(sumsq, np.float64)) * np.linalg.norm(down, axis=1)  # [L, f]
    order = np.argsort(-importance, axis=1, kind="stable").astype(np.int32)
    order.flags.writeable = False
    return ChannelOrder(f"{model.source} / {corpus.name} ({corpus.n_tokens} tokens)", order)


def layer_order(w, calibrated: bool) -> jax.Array | None:
    """The layer's calibrated channel order [f] (the method's data ``w.data["order"]`` at
    ``w.layer``), or None for the model's own order."""
    return jax.lax.dynamic_index_in_dim(w.data["order"], w.layer, keepdims=False) if calibrated else None


def ordered_blocks(scores: jax.Array, order: jax.Array | None, count: int, block: int) -> tuple[jax.Array, jax.Array]:
    """The top ``count`` blocks of ``block`` consecutive channels of ``order`` (None: the model's
    order) by the L2 norm of their channels' ``scores`` [f] -> (their block ids in that layout
    [count], their channel ids [count · block])."""
    blocks = top_blocks(scores if order is None else scores[order], count, block)[1]
    positions = block_channels(blocks, block)
    return blocks, positions if order is None else order[positions]


@dataclasses.dataclass(frozen=True)
class BlockOrdered:
    """What a ratio method with ``block`` adds for its blocks' channel order: ``block_order``
    ("model" or "calibrated") and the fitted ``order`` (`calibrate`, or `prepare`)."""

    block_order: str = dataclasses.field(default="model", kw_only=True)
    order: ChannelOrder | None = dataclasses.field(default=None, kw_only=True, repr=False)

    def check_block_order(self) -> None:
        """MethodError for a bad ``block_order`` or ``order``, or an order without blocks."""
        check_choice("block_order", self.block_order, BLOCK_ORDERS)
        if self.block_order != "model" and self.block == 1:
            raise MethodError(f"block_order={self.block_order!r} applies to block > 1 (block={self.block})")
        if self.order is not None and not isinstance(self.order, ChannelOrder):
            raise MethodError(f"{type(self).__name__}: order={self.order!r} is not a ChannelOrder (use calibrate or prepare)")

    @property
    def needs_calibration(self) -> bool:
        return self.block_order == "calibrated"

    def calibrate(self, model, corpus=None, **calibrate_kwargs: Any):
        """A copy holding ``model``'s `ChannelOrder` over ``corpus`` (`calibrated_order`)."""
        return dataclasses.replace(self, order=calibrated_order(model, corpus, **calibrate_kwargs))

    def prepare(self, model):
        """Ready for ``model``: `calibrate` where a calibrated order is asked for and missing."""
        cfg = model.config
        if not self.needs_calibration or self.order is not None or kept_channels(cfg, self.ratio) == cfg.intermediate_size:
            return self
        return self.calibrate(model)

    def checked_order(self, cfg: ModelConfig) -> bool:
        """Whether the blocks are of a calibrated order, with the order checked against ``cfg``."""
        if not self.needs_calibration:
            return False
        name = type(self).__name__
        if self.order is None:
            raise MethodError(f"{name}: block_order='calibrated' has no channel order: use {name}(...).calibrate(model) "
                              "(or .prepare(model)) first")
        if self.order.order.shape != (cfg.num_hidden_layers, cfg.intermediate_size):
            raise MethodError(f"{name}: {self.order!r} does not fit this model ((layers, f) = "
                              f"{(cfg.num_hidden_layers, cfg.intermediate_size)}): calibrate on it")
        return True

    def order_data(self) -> dict:
        """``{"order": [L, f] int32}`` with a calibrated order, else {}."""
        return {} if self.order is None else {"order": self.order.order}
