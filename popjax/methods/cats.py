"""CATS — contextually-aware thresholding for sparsity (arXiv 2404.08763; docs/methods.md §5.6).

Per layer l one threshold t[l], calibrated offline on dense activations so that
``P(|silu(W_g x)| < t) = s`` on the calibration corpus. At a decode step the gate activations
``g = silu(W_g x)`` are computed on all f channels; channels with ``|g_j| ≤ t`` are zeroed, so a
sparse kernel skips row j of W_u and column j of W_d:

    y = W_d[:, J] (g[J] ⊙ (W_u[J] x)),   J = {j : |g_j| > t}

With ``kernel="xla"`` the zeros are applied as a mask before dense matmuls (no speed claim in
XLA), and ``ffn_weights_read`` reports what a sparse kernel would read at the TARGET sparsity;
the decode aux gives the ACTUAL channel density per step and layer. With a Pallas ``kernel``
(TPU, GPU; ``"auto"`` there) that is what the step reads: g = act(W_g x) densely (XLA), then one
kernel call fetches only the kept channels' rows of W_u and W_d from a copy of them as channel
rows (`popjax.methods.input_rows.kernel_gated_ffn`; docs/kernels.md, "CATS and dynamic POP").

**Budget** (``ratio`` → sparsity): the gate projection is always read in full, so matching the
expected weights read of a structured method keeping n_keep channels,
``d·f + 2·d·f·(1 − s) = 3·d·n_keep``, needs ``s = 3(f − n_keep) / (2f) = 1.5·(1 − n_keep/f)``.
That is possible only while s < 1 (n_keep > f/3); a larger ratio is an error, not a clamp.
``ffn_sparsity=s`` gives the paper's channel sparsity directly (and then reads more weights).

**Batches**, **prefill**, **calibration**, **MoE models** (one threshold per expert) and the
**thresholds as data** (``data(model)``, not plan fields): as TEAL (`popjax.methods.teal`): ``aggregate``
"max"/"mean" aggregate |g| over the batch's valid rows and threshold once per batch
(per-token at batch 1), "per_token" masks every row alone; the prompt runs dense.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from ..models.config import ModelConfig
from .. import kernels
from ..kernels.ffn_layout import channel_lines
from .base import gate_activation, DensePlan, MethodError, Plan, check_choice, dot, down_proj, gate_and_up, kept_channels
from .activation_sparsity import DensePrefillPlan
from .input_rows import kernel_gated_ffn, up_down_rows_data
from .teal import ThresholdMethod, layer_threshold, threshold_keep


@dataclasses.dataclass(frozen=True)
class CATSPlan(DensePrefillPlan):
    """CATS's decode (docs/methods.md §5.6): static budget and batch rule only; the thresholds
    are the method's data, ``w.data["thresholds"]["gate"]`` [L] float32 ([L, slots] on a MoE
    model; `popjax.methods.teal.thresholds_data`)."""

    name: ClassVar[str] = "cats"
    sparsity: float = 0.0  # target fraction of channels zeroed
    aggregate: str = "max"
    # what reads the kept channels' up rows and down columns (`popjax.kernels.RESOLVED`, resolved
    # at bind): "xla" (a mask before dense matmuls) or a Pallas kernel on the channel rows of
    # ``w.data["up_down"]`` (`input_rows.kernel_gated_ffn`)
    kernel: str = "xla"

    def __post_init__(self):
        check_choice("kernel", self.kernel, kernels.RESOLVED)

    def decode(self, w, state, x, step, valid):
        """x [B, 1, d], valid [B, 1] -> (y [B, 1, d], state, densities: fp32 scalars)."""
        t = layer_threshold(w.data["thresholds"]["gate"], w.layer, w.block)
        if self.kernel == "xla":
            gate, up = gate_and_up(w.gate_up, x)
            gate = gate_activation(w)(gate)
            keep, density = threshold_keep(gate, valid, t, self.aggregate)
            y = down_proj(jnp.where(keep, gate * up, 0), w.down)
        else:  # only the gate densely; the kernel reads the kept channels' up and down rows
            gate = gate_activation(w)(dot("btd,nd->btn", x, w.gate_up[0]))
            keep, density = threshold_keep(gate, valid, t, self.aggregate)
            kept = round(self.f * (1.0 - self.sparsity))
            y = kernel_gated_ffn(w, x, gate, keep, expected_active=kept, kernel=self.kernel)
        return y, state, {"density": (1 + 2 * density) / 3, "density_channels": density}

    def ffn_weights_read(self, d: int) -> int:
        """At the target sparsity: all of W_g, the kept rows of W_u and columns of W_d (the
        Pallas kernel: those rows of its copy, each L·128 wide on TPU, `ffn_layout.channel_lines`)."""
        kept = self.f * (1.0 - self.sparsity)
        width = channel_lines(d) * 128 if self.kernel in kernels.TPU_KERNELS else d
        return round(d * self.f + 2.0 * width * kept)

    def ffn_flops_per_token(self, d: int) -> int:
        return 2 * self.ffn_weights_read(d)


@dataclasses.dataclass(frozen=True)
class CATS(ThresholdMethod):
    """``CATS(ratio=0.2, aggregate="max")`` or ``CATS(ffn_sparsity=0.5)``; thresholds from
    ``.calibrate(model)`` (see the module docstring)."""

    name: ClassVar[str] = "cats"

    def sparsity(self, cfg: ModelConfig) -> float:
        if self.ratio is None:
            return float(self.ffn_sparsity)
        f, n_keep = cfg.intermediate_size, kept_channels(cfg, self.ratio)
        s = 3.0 * (f - n_keep) / (2.0 * f)
        if s >= 1.0:
            raise MethodError(
                f"CATS: ratio={self.ratio} keeps n_keep={n_keep} of f={f} channels; CATS reads all of W_g, so it "
                f"can match that budget only while n_keep > f/3 (a smaller ratio), or give ffn_sparsity= instead"
            )
        return s

    def targets(self, cfg):
        return {"gate": ("gate", self.sparsity(cfg))}

    def kernel_data(self, model) -> dict:
        """``{"up_down": ChannelRows}``: every layer's up and down rows as channel rows
        (`input_rows.up_down_rows_data`, built once per model): 2/3 of the FFN weights again."""
        return {"up_down": up_down_rows_data(model)}

    def bind(self, cfg: ModelConfig) -> Plan:
        f, s = cfg.intermediate_size, self.sparsity(cfg)
        if s == 0.0:
            return DensePlan(f=f, n_keep=f)
        self._thresholds_for(cfg)  # an unprepared or mismatched method fails here, as it always has
        return CATSPlan(f=f, n_keep=round(f * (1.0 + 2.0 * (1.0 - s)) / 3.0), sparsity=s, aggregate=self.aggregate,
                        kernel=self.resolved_kernel(cfg))
