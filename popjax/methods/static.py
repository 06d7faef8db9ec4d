"""Static ablation (POP paper Table 6, variant 1; ≈ GRIFFIN with POP's metric; docs/methods.md §2).

The top n_keep channels by prefill importance are fixed for the whole generation; their
gate/up rows and down columns are gathered once at prefill (on a mesh: split over "model",
base.copy_channels).

``block=b`` (b > 1) keeps whole blocks of b consecutive channels (j·b … j·b + b − 1 of the
model's order): n_keep rounded to whole blocks, the top n_keep/b blocks by the L2 norm of their
channels' prompt importance; the prompt's own output uses those channels. Through XLA a step
reads a compact copy of them, as channel static does. With a Pallas ``kernel`` prefill copies
nothing: the state is the kept block ids, and a step reads those blocks' gate, up and down rows
from a block slab of the model's FFN weights (`input_rows.block_slab_data`, built once per
model) through the fused `kernels.decode_ffn.block_ffn`. Per sequence, a batch is served as
the union of its rows' blocks with a per-row mask: a block two rows kept is read once, where
per-sequence compact copies read one copy per row.

Blocks of the model's own channel order (``block_order="model"``) cost much NLL: neighbouring
channel ids share nothing. ``block_order="calibrated"`` lays each layer's channels out by their
importance over a calibration corpus first (`channel_order`), so a block holds channels of
neighbouring typical importance; the slab is built in that order and the blocks are of it.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from .. import kernels
from ..models.config import ModelConfig
from .base import (gate_activation, AggregatedPlan, DensePlan, MethodError, Plan, RatioMethod, activations, check_block,
                   check_choice, copy_channels, copy_gate_up, down_proj, kept_channels, masked_down, score_prompt)
from .channel_order import BlockOrdered, layer_order, ordered_blocks
from .dynamic import block_keep
from .input_rows import block_slab_data, kernel_block_ffn, resolve_kernel


@dataclasses.dataclass(frozen=True)
class StaticPlan(AggregatedPlan):
    name: ClassVar[str] = "static"
    block: int = 1  # channels kept in whole blocks of this many consecutive channels (n_keep a multiple)
    # what a step reads (`popjax.kernels.RESOLVED`, resolved at bind): "xla" (the compact copy)
    # or a Pallas kernel on the kept blocks of the slab in ``w.data["slab"]`` (block > 1)
    kernel: str = "xla"
    calibrated_order: bool = False  # blocks of ``w.data["order"]``'s layout (block_order="calibrated")

    def __post_init__(self):
        check_choice("kernel", self.kernel, kernels.RESOLVED)
        if self.kernel != "xla" and self.block == 1:
            raise MethodError(f"kernel={self.kernel!r} reads whole blocks of channels; static selection needs block > 1 for it")

    @property
    def compact_weights(self) -> bool:  # the kernel path copies nothing per sequence
        return self.kernel == "xla"

    def _prefill(self, w, x, valid):
        if self.block == 1:
            y, order, importance = score_prompt(w, x, valid, self.n_keep)
            kept = order[: self.n_keep]
        else:  # whole blocks: the top n_keep/b by the L2 norm of their channels' importance
            _, _, importance, h = score_prompt(w, x, valid, self.n_keep, with_h=True)
            order = layer_order(w, self.calibrated_order)
            blocks, kept = ordered_blocks(importance, order, self.n_keep // self.block, self.block)
            y = masked_down(h, kept, w.down)
            if self.kernel != "xla":
                return y, {"kept_blocks": blocks}, {"importance": importance}  # [n_keep/b]
        state = {
            "kept_idx": kept,  # [n_keep]
            "gate_up": copy_gate_up(w.gate_up, kept),  # [2, n_keep', d] (n_keep' ≥ n_keep: copy_channels)
            "down": copy_channels(w.down, kept, axis=1),  # [d, n_keep']
        }
        return y, state, {"importance": importance}

    def decode(self, w, state, x, step, valid):
        """Through the kernel the batch is one call, per sequence too: each row's kept blocks
        [B, n_keep/b] are served as their union with a per-row mask (no vmap over rows)."""
        if self.kernel == "xla":
            return super().decode(w, state, x, step, valid)
        return kernel_block_ffn(w, x, state["kept_blocks"], kernel=self.kernel), state, {}

    def _decode(self, w, state, x, step, valid):
        return down_proj(activations(state["gate_up"], x, gate_activation(w)), state["down"]), state, {}

    def ffn_flops_per_token(self, d: int) -> int:
        return 6 * d * self.n_keep

    def ffn_weights_read(self, d: int) -> int:
        return 3 * d * self.n_keep

    def ffn_weights_read_per_step(self, d: int, batch: int) -> int:
        """Through the kernel per sequence: the union of the rows' blocks, at most B·n_keep
        channels (rows that kept other blocks) and at most f."""
        if self.kernel == "xla" or self.aggregate == "shared":
            return super().ffn_weights_read_per_step(d, batch)
        return 3 * d * min(self.f, batch * self.n_keep)


@dataclasses.dataclass(frozen=True)
class Static(BlockOrdered, RatioMethod):
    """Prefill-fixed structured pruning: the top n_keep channels by prompt importance, kept for
    the whole generation. ``Static(ratio, aggregate="per_sequence" | "shared", block=1,
    kernel="auto", block_order="model")``: ``block=b`` keeps whole blocks of b channels (b
    divides f), of the model's order or of a calibrated one (`channel_order`: ``calibrate``
    or ``prepare`` first), which a Pallas ``kernel`` ("auto": on TPU and GPU; "pallas"; "xla")
    reads from a block slab of the model's weights instead of a prefill copy (the module
    docstring). With ``block=1`` the step reads a compact copy, contiguous whatever the
    selection: "auto" is XLA, "pallas" a MethodError."""

    name: ClassVar[str] = "static"
    plan_class: ClassVar[type] = StaticPlan
    block: int = dataclasses.field(default=1, kw_only=True)
    kernel: str = dataclasses.field(default="auto", kw_only=True)

    def __post_init__(self):
        super().__post_init__()
        check_block(self.block)
        check_choice("kernel", self.kernel, kernels.KERNELS)
        if self.kernel == "pallas" and self.block == 1:
            raise MethodError("kernel='pallas' reads whole blocks of channels: use block > 1 (block=1 reads a compact copy, "
                              "contiguous already), or kernel='xla' or 'auto'")
        self.check_block_order()

    def resolved_kernel(self, cfg: ModelConfig) -> str:
        """What the decode step runs: XLA for single channels, else `input_rows.resolve_kernel`."""
        return "xla" if self.block == 1 else resolve_kernel("Static", self.kernel, cfg)

    def bind(self, cfg: ModelConfig) -> Plan:
        f, n_keep = cfg.intermediate_size, kept_channels(cfg, self.ratio)
        if n_keep == f:
            return DensePlan(f=f, n_keep=f)
        return StaticPlan(f=f, n_keep=block_keep(f, n_keep, self.block), aggregate=self.aggregate, block=self.block,
                          kernel=self.resolved_kernel(cfg), calibrated_order=self.checked_order(cfg))

    def data(self, model) -> dict | None:
        """``{"order": [L, f] int32}`` with a calibrated order, and with a Pallas kernel
        ``{"slab": BlockSlab}``: every layer's FFN weights in blocks of ``block`` of that order
        (`input_rows.block_slab_data`, built once per model and order), which the steps read."""
        plan = self.bind(model.config)
        if not isinstance(plan, StaticPlan) or plan.block == 1:
            return None
        data = {name: jnp.asarray(a) for name, a in self.order_data().items()}
        if plan.kernel != "xla":
            data["slab"] = block_slab_data(model, self.block, None if self.order is None else self.order.order)
        return data or None
