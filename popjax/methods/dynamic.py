"""Fully dynamic ablation (POP paper Table 6, variant 2; docs/methods.md §2).

Every decode step computes H_t on all f channels and keeps the top n_keep by
``‖H_t[:, j]‖₂ · ‖W_d[:, j]‖₂``. The prompt is processed like POP's prefill (top n_keep by
prompt importance), so the three variants differ only in decoding.

A step needs H on all f channels (its scores), so gate and up are read whole; only the down read
follows the selection. With a Pallas ``kernel`` (TPU, GPU; ``"auto"`` there) it reads just the
n_keep selected channels' rows of the model's input-major down copy
(`popjax.methods.input_rows.kernel_down`), where XLA gathers W_d's columns every step.

``block=b`` (b > 1) selects whole blocks of b consecutive channels (channels j·b … j·b + b − 1
of the model's order): n_keep rounded to whole blocks, the top n_keep/b blocks by the L2 norm
of their channels' scores, so a kernel reads b contiguous rows of the down copy per choice
(`kernels.decode_ffn.block_matvec`, one BlockSpec fetch per block on TPU). The prompt's own
output stays channel-granular (prefill is dense). ``block_order="calibrated"`` makes the blocks
those of a calibrated channel order (`channel_order`: the down copy laid out in it).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from .. import kernels
from ..models.config import ModelConfig
from .base import (gate_activation, AggregatedPlan, DensePlan, MethodError, Plan, RatioMethod, activations, check_block,
                   check_choice, down_proj, kept_channels, round_half_up, score_prompt, step_importance, take_channels)
from .channel_order import BlockOrdered, layer_order, ordered_blocks
from .input_rows import input_rows_data, kernel_down, kernel_down_blocks, kernel_weights_read, ordered_down_rows, resolve_kernel


@dataclasses.dataclass(frozen=True)
class DynamicPlan(AggregatedPlan):
    name: ClassVar[str] = "dynamic"
    compact_weights: ClassVar[bool] = False  # reads the model's own weights every step
    # what reads the selected channels' down rows (`popjax.kernels.RESOLVED`, resolved at bind):
    # "xla" (a gather of W_d's columns) or a Pallas kernel on the down copy in ``w.data["rows"]``
    kernel: str = "xla"
    block: int = 1  # channels selected in whole blocks of this many consecutive channels (n_keep a multiple)
    calibrated_order: bool = False  # blocks of ``w.data["order"]``'s layout (block_order="calibrated")

    def __post_init__(self):
        check_choice("kernel", self.kernel, kernels.RESOLVED)

    def _prefill(self, w, x, valid):
        y, _, importance = score_prompt(w, x, valid, self.n_keep)
        # A zero-size placeholder keeps the state a (vmappable) array pytree.
        return y, jnp.zeros((0,), jnp.int32), {"importance": importance}

    def _decode(self, w, state, x, step, valid):
        h = activations(w.gate_up, x, gate_activation(w))  # [B, 1, f]
        scores = step_importance(h, valid, w.down_norm)  # [f]
        if self.block > 1:  # whole blocks: the top n_keep/b by the L2 norm of their channels' scores
            order = layer_order(w, self.calibrated_order)
            blocks, selected = ordered_blocks(scores, order, self.n_keep // self.block, self.block)
            if self.kernel != "xla":  # the down copy is laid out in the blocks' order
                y = kernel_down_blocks(w, h if order is None else h[..., order], blocks, block=self.block, d=x.shape[-1],
                                       kernel=self.kernel)
                return y, state, {"scores": scores}
        else:
            _, selected = jax.lax.top_k(scores, self.n_keep)
        if self.kernel == "xla":
            y = down_proj(take_channels(h, selected, axis=-1), take_channels(w.down, selected, axis=1))
        else:
            keep = jnp.zeros((self.f,), bool).at[selected].set(True)
            y = kernel_down(w, h, keep, d=x.shape[-1], expected_active=self.n_keep, kernel=self.kernel)
        return y, state, {"scores": scores}

    def ffn_flops_per_token(self, d: int) -> int:
        return 4 * d * self.f + 2 * d * self.n_keep

    def ffn_weights_read(self, d: int) -> int:
        """All of gate and up, the n_keep selected down columns (the TPU kernel reads whole
        rows of the down copy: `input_rows.kernel_weights_read`)."""
        return 2 * d * self.f + kernel_weights_read(self.kernel, d, self.f, 0, self.n_keep)


def block_keep(f: int, n_keep: int, block: int) -> int:
    """n_keep in whole blocks of ``block`` channels (at least one); MethodError when ``block``
    does not divide f."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 1 or f % block:
        raise MethodError(f"block={block!r} does not divide the FFN width f={f}; use a positive divisor of {f} (1: single channels)")
    return min(f, max(1, round_half_up(n_keep / block)) * block)


@dataclasses.dataclass(frozen=True)
class Dynamic(BlockOrdered, RatioMethod):
    """Re-selects the top n_keep of all channels at every decode step (the accuracy ceiling of
    POP at a much higher cost). ``Dynamic(ratio, aggregate="per_sequence" | "shared",
    kernel="auto" | "xla" | "pallas")``: ``kernel`` reads the selected down rows (the module
    docstring); "auto" is the Pallas kernel on TPU and GPU, XLA on a CPU and a mixture of experts.
    ``block=b``: channels selected in whole blocks of b (the module docstring; b divides f), of
    the model's order or (``block_order="calibrated"``; ``calibrate`` or ``prepare`` first) of a
    calibrated one."""

    name: ClassVar[str] = "dynamic"
    plan_class: ClassVar[type] = DynamicPlan
    kernel: str = dataclasses.field(default="auto", kw_only=True)
    block: int = dataclasses.field(default=1, kw_only=True)

    def __post_init__(self):
        super().__post_init__()
        check_choice("kernel", self.kernel, kernels.KERNELS)
        check_block(self.block)
        self.check_block_order()

    def resolved_kernel(self, cfg: ModelConfig) -> str:
        """What the decode step runs (`input_rows.resolve_kernel`)."""
        return resolve_kernel("Dynamic", self.kernel, cfg)

    def bind(self, cfg: ModelConfig) -> Plan:
        f, n_keep = cfg.intermediate_size, kept_channels(cfg, self.ratio)
        if n_keep == f:
            return DensePlan(f=f, n_keep=f)
        n_keep = block_keep(f, n_keep, self.block)
        return DynamicPlan(f=f, n_keep=n_keep, aggregate=self.aggregate, kernel=self.resolved_kernel(cfg), block=self.block,
                           calibrated_order=self.checked_order(cfg))

    def data(self, model) -> dict | None:
        """With a Pallas kernel ``{"rows": {"down": InputRows}}``: W_d as an input-major copy
        (`input_rows.input_rows_data`, built once per model; with a calibrated order, its rows in
        that order), which the decode steps read; with a calibrated order ``{"order": [L, f]}``."""
        plan = self.bind(model.config)
        if not isinstance(plan, DynamicPlan):
            return None
        data = {name: jnp.asarray(a) for name, a in self.order_data().items()}
        if plan.kernel != "xla":
            data["rows"] = {"down": ordered_down_rows(model, self.order.order)} if plan.calibrated_order else \
                input_rows_data(model, ("down",))
        return data or None
