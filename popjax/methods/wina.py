"""WINA — weight-informed neuron activation (arXiv 2505.19427; docs/methods.md §5.9).

TEAL zeroes the small entries of a linear layer's input; WINA ranks them by what they change
in the output instead: for y = W v, dropping v_i moves y by |v_i| · ‖W[:, i]‖₂ (exactly so when
W's columns are orthogonal), so each decode token keeps the top k of

    x  (the gate/up input, d entries)    |x_i| · c_i      c_i = ‖[W_g; W_u][:, i]‖₂
    H  (the down input, f entries)       |H_j| · ‖W_d[:, j]‖₂

and a sparse kernel reads only the kept columns of gate/up and of down.

Decisions (docs/methods.md §5.9 gives the reasons):

* **FFN only.** WINA sparsifies the inputs of attention's projections too; popjax prunes the
  FFN alone (attention is never pruned), so WINA here is its gate/up and down inputs.
* **One mask for gate and up.** The official code masks gate's and up's copies of x apart
  (a weight norm on gate, plain |x| on up). Reading column i of both matrices together, the
  output change of dropping x_i is |x_i| times the norm of the stacked column, c_i above.
* **Weight norms on both tensors** (``weight_norms="both"``, the paper's rule);
  ``weight_norms="x"`` scores H by |H_j| alone, as the official code does for down_proj.
* **Exact top-k per token** (the paper's ``mask_by=topk``), at TEAL's budget: the same
  sparsity s = 1 − n_keep/f on both tensors, k_x = round(d(1 − s)) and k_h = n_keep, so a
  kernel reads 2·f·k_x + d·k_h weights per step (≈ 3·d·n_keep, a structured method's bytes).
  No per-layer allocation search (the paper's greedy search spreads sparsity over attention
  and FFN projections, which do not both exist here).
* **No orthogonal transform.** WINA's optional SVD rotation of the residual stream changes
  every layer's weights; it is not applied.
* **Prefill is dense**, decode is sparse (as TEAL and BWAP here).
* **Batches** (``aggregate``): "per_token" (default, the paper's) masks each row by its own
  top k; "max" / "mean" rank the batch's aggregated scores and share one mask.

The column norms c are computed once in ``prepare`` (an int8 model's from its dequantized
weights) and reach the compiled steps as the method's data, ``{"wina": {"x_norm": [L, d]}}``
([L · slots, d] on a MoE model, one row per expert block: `models.moe.table_row`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from .. import calibration, kernels
from ..loaded import unrolled
from ..models.config import ModelConfig
from ..models.moe import table_row
from .base import (DensePlan, block_rows, check_choice, gate_up_blocks, MethodError, Plan, activations, down_proj,
                   gate_activation)
from .fitted import FittedArrays
from .input_rows import input_rows_data, kernel_activations, kernel_down, kernel_weights_read, resolve_kernel
from .activation_sparsity import DensePrefillPlan, SparsityBudget, top_k_mask

WEIGHT_NORMS = ("both", "x")


@dataclasses.dataclass(frozen=True)
class WINAPlan(DensePrefillPlan):
    """WINA's decode (see the module docstring): the column norms are the method's data,
    ``w.data["wina"]["x_norm"]``."""

    name: ClassVar[str] = "wina"
    k_x: int = 0  # entries of x kept per step
    aggregate: str = "per_token"
    weight_norms: str = "both"
    blocks: int = 0  # block slots per layer of a MoE model, 0: dense
    # what reads the kept inputs' weight rows (`popjax.kernels.RESOLVED`): "xla" (masks before
    # dense matmuls) or a Pallas kernel on the input-major copies in ``w.data["rows"]`` (`input_rows`)
    kernel: str = "xla"

    def __post_init__(self):
        check_choice("kernel", self.kernel, kernels.RESOLVED)

    def decode(self, w, state, x, step, valid):
        """x [B, 1, d], valid [B, 1] -> (y [B, 1, d], state, {})."""
        c = w.data["wina"]["x_norm"][table_row(w, self.blocks)]  # [d]
        keep_x = top_k_mask(jnp.abs(x.astype(jnp.float32)) * c, valid, self.k_x, self.aggregate)
        if self.kernel == "xla":
            h = activations(w.gate_up, jnp.where(keep_x, x, 0), gate_activation(w))  # [B, 1, f]
        else:
            h = kernel_activations(w, x, keep_x, f=self.f, expected_active=self.k_x, kernel=self.kernel)
        scores = jnp.abs(h.astype(jnp.float32))
        if self.weight_norms == "both":
            scores = scores * w.down_norm
        keep_h = top_k_mask(scores, valid, self.n_keep, self.aggregate)
        if self.kernel == "xla":
            return down_proj(jnp.where(keep_h, h, 0), w.down), state, {}
        return kernel_down(w, h, keep_h, d=x.shape[-1], expected_active=self.n_keep, kernel=self.kernel), state, {}

    def ffn_weights_read(self, d: int) -> int:
        """A sparse kernel's read: the kept columns of gate and up (2·f·k_x), of down (d·n_keep)
        (the TPU kernel reads whole rows: `input_rows.kernel_weights_read`)."""
        return kernel_weights_read(self.kernel, d, self.f, self.k_x, self.n_keep)

    def ffn_flops_per_token(self, d: int) -> int:
        return 2 * self.ffn_weights_read(d)


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class ColumnNorms(FittedArrays):
    """c_i = ‖[W_g; W_u][:, i]‖₂ of every FFN block: ``norms`` [L, d] (a MoE model: [L · slots,
    d]); ``key``: the model's fingerprint."""

    key: str
    norms: np.ndarray
    blocks: int = 0


def column_norms(model) -> ColumnNorms:
    """`ColumnNorms` of a loaded (unrolled) model, from its dequantized weights, in float64."""
    blocks, _ = block_rows(model.config)
    norms = np.stack([np.sqrt(np.sum(np.asarray(g, np.float64) ** 2, axis=(0, 1))) for g in gate_up_blocks(model)])
    norms = norms.astype(np.float32)
    norms.flags.writeable = False
    return ColumnNorms(calibration.model_fingerprint(model), norms, blocks)


@dataclasses.dataclass(frozen=True)
class WINA(SparsityBudget):
    """``WINA(ratio=0.2, aggregate="per_token", weight_norms="both")`` or ``WINA(ffn_sparsity=0.5)``;
    ``prepare(model)`` computes the gate/up column norms (see the module docstring).

    Args:
      ratio: global fraction of decoder parameters removed (docs/methods.md §1), as the FFN
        sparsity s = 1 − n_keep/f on both of its inputs; or ``ffn_sparsity``: s itself.
      aggregate: "per_token" (each row its own top k), "max" or "mean" (one mask per batch).
      weight_norms: "both" (x and H scored with their weight norms) or "x" (H by |H| alone).
      kernel: how a decode step reads the kept inputs' weights: "auto" (the Pallas kernel on TPU
        and GPU, XLA on a CPU), "xla" (masks before dense matmuls) or "pallas" (input-major
        copies of the FFN weights, only the kept rows read: `popjax.methods.input_rows`).
    """

    name: ClassVar[str] = "wina"
    calibrates: ClassVar[bool] = True  # the column norms, once per model
    weight_norms: str = dataclasses.field(default="both", kw_only=True)
    norms: ColumnNorms | None = dataclasses.field(default=None, kw_only=True, repr=False)
    kernel: str = dataclasses.field(default="auto", kw_only=True)

    def __post_init__(self):
        super().__post_init__()
        check_choice("kernel", self.kernel, kernels.KERNELS)
        if self.weight_norms not in WEIGHT_NORMS:
            raise MethodError(f"WINA: weight_norms={self.weight_norms!r} is not one of {WEIGHT_NORMS}")
        if self.norms is not None and not isinstance(self.norms, ColumnNorms):
            raise MethodError(f"WINA: norms={self.norms!r} is not ColumnNorms (use prepare(model))")

    def prepare(self, model) -> "WINA":
        if self.norms is not None and self.norms.key == calibration.model_fingerprint(model):
            return self
        return dataclasses.replace(self, norms=column_norms(unrolled(model)))

    def bind(self, cfg: ModelConfig) -> Plan:
        f, d, s = cfg.intermediate_size, cfg.hidden_size, self.sparsity(cfg)
        if s == 0.0:
            return DensePlan(f=f, n_keep=f)
        if self.norms is None:
            raise MethodError("WINA has no column norms: use WINA(...).prepare(model) first (popjax.generate does)")
        blocks, rows = block_rows(cfg)
        want = (rows, d)
        if self.norms.norms.shape != want or self.norms.blocks != blocks:
            raise MethodError(f"WINA: {self.norms!r} do not fit this model ((layers{' × block slots' if blocks else ''}, d) = {want}): prepare it on this model")
        k_x = max(1, round(d * (1.0 - s)))
        return WINAPlan(f=f, n_keep=round(f * (1.0 - s)), k_x=k_x, aggregate=self.aggregate,
                        weight_norms=self.weight_norms, blocks=blocks, kernel=resolve_kernel("WINA", self.kernel, cfg))

    def data(self, model) -> dict | None:
        """``{"wina": {"x_norm": [L, d] float32}}`` ([L · slots, d] on a MoE model), and with a
        Pallas kernel ``"rows"`` (`input_rows.input_rows_data`); None when the budget prunes
        nothing."""
        plan = self.bind(model.config)
        if not isinstance(plan, WINAPlan):
            return None
        data = {"wina": {"x_norm": jnp.asarray(self.norms.norms)}}
        return data if plan.kernel == "xla" else {**data, "rows": input_rows_data(model)}
