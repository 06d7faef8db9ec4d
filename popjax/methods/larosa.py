"""LaRoSa — layerwise rotated sparse activation (ICML 2025, arXiv 2507.01299; docs/methods.md
§5.11).

Magnitude sparsity (TEAL) drops the small entries of a layer's input, but in the model's own
basis the input's energy is spread over many entries. LaRoSa rotates each layer's FFN input
into the principal axes of its calibration activations first, where the energy concentrates in
few coordinates, keeps exactly the top k of each token there, and rotates back:

    Q      = eigenvectors of Σ_t x_t x_tᵀ over calibration tokens (descending eigenvalues)   [d, d]
    x'     = x Q;  keep the top k_x of |x'|;  x̂ = S(x') Qᵀ                 (the gate/up input)
    H      = act(x̂ W_g) ⊙ x̂ W_u;  keep the top k_h of |H|                  (the down input)

x̂ W = S(x') (Qᵀ W): a kernel reads k_x columns of the rotated gate/up weights (folded once),
plus Q itself at run time. Through XLA (``kernel="xla"``, the default on a CPU) the rotation is
applied to x and the model's weights are kept (the same product), so no weight is copied; with a
Pallas kernel (TPU, GPU) the rotation is folded once per model into an input-major copy of
W_gu Q, of which a step reads the k_x kept rows (`input_rows`: TEAL's kernel on that copy, and
TEAL's down copy for the kept channels of H; int8 weights: the folded copy re-quantized per
output channel, so its path is within int8 rounding of XLA's, not equal).

Decisions (docs/methods.md §5.11 gives the reasons):

* **FFN only**: LaRoSa also rotates attention's input; popjax never prunes attention.
* **The rotation is applied at run time** (x → xQ → top-k → Qᵀ), as the official code does, and
  its d² weights are counted in the bytes a step reads: 2·f·k_x + d·k_h + d².
* **Q from the post-norm FFN input** (γ included, the official code's choice), one per layer
  (on a MoE model one per FFN block, from the tokens routed to it), with the code's 1% damping
  of the second-moment matrix before ``eigh``.
* **Budget**: TEAL's sparsity s = 1 − n_keep/f; the rotated input takes ``alpha`` · s
  (the paper's α), the down input whatever keeps the FFN's weight reads at TEAL's
  (2(1 − αs) + (1 − s_h) = 3(1 − s)), capped below 1. α = 1 (default): s on both.
* **The down input is not rotated** (a SwiGLU product has no rotation to fold into); its top k
  is by |H|, as in the official code.
* **Prefill is dense**, decode is sparse (as TEAL and WINA here); **batches** as WINA's.

The rotations reach the compiled steps as the method's data, ``{"larosa": {"rotation":
[L, d, d]}}`` ([L · slots, d, d] on a MoE model: `models.moe.table_row`), with a Pallas kernel
also ``"rows"``: the folded gate/up copy and TEAL's down copy.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from .. import kernels
from ..calibration import Statistic, calibrate
from ..kernels.ffn_layout import InputRows, stacked_input_layout
from ..kernels.int8 import row_quantize
from ..loaded import unrolled
from ..models.config import ModelConfig
from ..models.moe import table_row
from .base import DensePlan, block_rows, MethodError, Plan, activations, check_choice, down_proj, gate_activation, resolve_corpus
from .fitted import FittedArrays, array_digest
from .activation_sparsity import DensePrefillPlan, SparsityBudget, top_k_mask
from .input_rows import float_gate_up, input_rows_data, kernel_activations, kernel_down, kernel_weights_read, replicated, resolve_kernel

DAMPING = 0.01  # of the mean diagonal, added before eigh (the official code's)


@dataclasses.dataclass(frozen=True)
class SecondMoment(Statistic):
    """LaRoSa's calibration statistic: Σ_t x_t x_tᵀ of the FFN input over valid tokens -> {"xx": [d, d]}."""

    name: ClassVar[str] = "larosa_second_moment"
    version: ClassVar[int] = 1

    def collect(self, w, x, valid, h):
        xv = jnp.where(valid[..., None], x.astype(jnp.float32), 0.0)
        return {"xx": jnp.einsum("btd,bte->de", xv, xv)}


def rotation_from_moment(xx: np.ndarray) -> np.ndarray:
    """Eigenvectors of the damped second moment, columns by descending eigenvalue: [d, d] -> [d, d]."""
    xx = np.asarray(xx, np.float64)
    xx = xx + DAMPING * max(float(np.mean(np.diag(xx))), 1e-12) * np.eye(xx.shape[0])
    values, vectors = np.linalg.eigh(xx)
    return vectors[:, np.argsort(-values, kind="stable")]


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Rotations(FittedArrays):
    """One orthogonal Q [d, d] per FFN block: ``q`` [L, d, d] (a MoE model: [L · slots, d, d]);
    ``source``: the model and calibration corpus."""

    source: str
    q: np.ndarray
    blocks: int = 0


@dataclasses.dataclass(frozen=True)
class LaRoSaPlan(DensePrefillPlan):
    """LaRoSa's decode (see the module docstring): the rotations are the method's data."""

    name: ClassVar[str] = "larosa"
    k_x: int = 0  # rotated entries kept per step (n_keep: down-input entries kept)
    aggregate: str = "per_token"
    blocks: int = 0  # block slots per layer of a MoE model, 0: dense
    # "xla" (the rotation applied to x, masks before dense matmuls) or a Pallas kernel on the folded
    # W_gu Q copy and TEAL's down copy in ``w.data["rows"]`` (`input_rows`)
    kernel: str = "xla"

    def __post_init__(self):
        check_choice("kernel", self.kernel, kernels.RESOLVED)

    def decode(self, w, state, x, step, valid):
        """x [B, 1, d], valid [B, 1] -> (y [B, 1, d], state, {})."""
        q = w.data["larosa"]["rotation"][table_row(w, self.blocks)]  # [d, d]
        rotated = jnp.einsum("btd,de->bte", x.astype(jnp.float32), q)
        keep_x = top_k_mask(jnp.abs(rotated), valid, self.k_x, self.aggregate)
        if self.kernel == "xla":
            x_hat = jnp.einsum("bte,de->btd", jnp.where(keep_x, rotated, 0.0), q).astype(x.dtype)
            h = activations(w.gate_up, x_hat, gate_activation(w))  # [B, 1, f]
        else:  # x̂ W_guᵀ = S(x') (W_gu Q)ᵀ: the kept rotated entries' rows of the folded copy
            h = kernel_activations(w, rotated.astype(x.dtype), keep_x, f=self.f, expected_active=self.k_x, kernel=self.kernel)
        keep_h = top_k_mask(jnp.abs(h.astype(jnp.float32)), valid, self.n_keep, self.aggregate)
        if self.kernel == "xla":
            return down_proj(jnp.where(keep_h, h, 0), w.down), state, {}
        return kernel_down(w, h, keep_h, d=x.shape[-1], expected_active=self.n_keep, kernel=self.kernel), state, {}

    def ffn_weights_read(self, d: int) -> int:
        """A kernel's read: Q (d²), k_x columns of the rotated gate and up, n_keep columns of down
        (the TPU kernel reads whole rows: `input_rows.kernel_weights_read`)."""
        return d * d + kernel_weights_read(self.kernel, d, self.f, self.k_x, self.n_keep)

    def ffn_flops_per_token(self, d: int) -> int:
        return 2 * (2 * d * d + 2 * self.f * self.k_x + d * self.n_keep)


@dataclasses.dataclass(frozen=True)
class LaRoSa(SparsityBudget):
    """``LaRoSa(ratio=0.2, alpha=1.0, aggregate="per_token")`` or ``LaRoSa(ffn_sparsity=0.5)``;
    ``calibrate(model, corpus)`` or ``prepare(model)`` computes the rotations.

    Args:
      ratio: global fraction of decoder parameters removed (docs/methods.md §1), as TEAL's FFN
        sparsity s; or ``ffn_sparsity``: s itself.
      alpha: the rotated input's share of the sparsity (s_x = alpha · s), in (0, 1.5].
      aggregate: "per_token" (each row its own top k), "max" or "mean" (one mask per batch).
      kernel: "auto" (default: the Pallas kernels on TPU and GPU, XLA on a CPU and on a mixture
        of experts), "xla" or "pallas" (the module docstring; interpret mode on a CPU).
    """

    name: ClassVar[str] = "larosa"
    calibrates: ClassVar[bool] = True
    alpha: float = dataclasses.field(default=1.0, kw_only=True)
    rotations: Rotations | None = dataclasses.field(default=None, kw_only=True, repr=False)
    kernel: str = dataclasses.field(default="auto", kw_only=True)

    def __post_init__(self):
        super().__post_init__()
        check_choice("kernel", self.kernel, kernels.KERNELS)
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0.0 < self.alpha <= 1.5:
            raise MethodError(f"LaRoSa: alpha={self.alpha!r} is outside (0, 1.5]: it is the rotated input's share of the sparsity")
        if self.rotations is not None and not isinstance(self.rotations, Rotations):
            raise MethodError(f"LaRoSa: rotations={self.rotations!r} is not Rotations (use calibrate or prepare)")

    def kept(self, cfg: ModelConfig) -> tuple[int, int]:
        """(k_x, k_h): entries of the rotated input and of the down input kept per step."""
        d, f, s = cfg.hidden_size, cfg.intermediate_size, self.sparsity(cfg)
        s_x = min(self.alpha * s, 1.0 - 1.0 / d)
        s_h = min(max(3.0 * s - 2.0 * s_x, 0.0), 1.0 - 1.0 / f)  # 2(1 − s_x) + (1 − s_h) = 3(1 − s)
        return max(1, round(d * (1.0 - s_x))), max(1, round(f * (1.0 - s_h)))

    def calibrate(self, model, corpus=None, **calibrate_kwargs: Any) -> "LaRoSa":
        """A copy holding the rotations of ``model`` from ``corpus`` (a `Corpus`, a UTF-8 text file,
        or None: the default Shakespeare corpus), the moments cached by `popjax.calibration.calibrate`."""
        model = unrolled(model)
        corpus = resolve_corpus(model, corpus)
        moments = np.asarray(calibrate(model, SecondMoment(), corpus, **calibrate_kwargs)["xx"])  # [L, (slots,) d, d]
        d = moments.shape[-1]
        q = np.stack([rotation_from_moment(m) for m in moments.reshape(-1, d, d)]).astype(np.float32)
        q.flags.writeable = False
        blocks, _ = block_rows(model.config)
        return dataclasses.replace(self, rotations=Rotations(f"{model.source} / {corpus.name} ({corpus.n_tokens} tokens)", q, blocks))

    def prepare(self, model) -> "LaRoSa":
        """Ready for ``model``: itself when it holds rotations (or prunes nothing), else `calibrate`."""
        if self.rotations is not None or self.sparsity(model.config) == 0.0:
            return self
        return self.calibrate(model)

    def bind(self, cfg: ModelConfig) -> Plan:
        f, d = cfg.intermediate_size, cfg.hidden_size
        if self.sparsity(cfg) == 0.0:
            return DensePlan(f=f, n_keep=f)
        if self.rotations is None:
            raise MethodError("LaRoSa has no rotations: use LaRoSa(...).calibrate(model) (or .prepare(model)) first")
        blocks, rows = block_rows(cfg)
        want = (rows, d, d)
        if self.rotations.q.shape != want or self.rotations.blocks != blocks:
            raise MethodError(f"LaRoSa: {self.rotations!r} do not fit this model ((layers{' × block slots' if blocks else ''}, d, d) = {want}): calibrate on it")
        k_x, k_h = self.kept(cfg)
        return LaRoSaPlan(f=f, n_keep=k_h, k_x=k_x, aggregate=self.aggregate, blocks=blocks,
                          kernel=resolve_kernel("LaRoSa", self.kernel, cfg))

    def data(self, model) -> dict | None:
        """``{"larosa": {"rotation": [L, d, d] float32}}`` ([L · slots, d, d] on a MoE model);
        None when the budget prunes nothing. With a Pallas kernel also ``"rows"``: "gate_up",
        `folded_rows` (built once per model and rotations), and TEAL's "down"
        (`input_rows.input_rows_data`)."""
        plan = self.bind(model.config)
        if not isinstance(plan, LaRoSaPlan):
            return None
        data = {"larosa": {"rotation": jnp.asarray(self.rotations.q)}}
        if plan.kernel == "xla":
            return data
        folded = model.derived(f"larosa_folded/{array_digest(self.rotations.q)}",
                               lambda m: replicated(m, folded_rows(m.ffn_stack(), data["larosa"]["rotation"])))
        return {**data, "rows": {"gate_up": folded, "down": input_rows_data(model, ("down",))["down"]}}


def folded_rows(stack, q: jax.Array) -> InputRows:
    """Every layer's gate/up with its rotation folded in, W_gu Q [2f, d] per layer, as
    `ffn_layout.stacked_input_layout` (values [L, d, L_gu, 128]: row e multiplies rotated entry
    e): from the stacked FFN weights and rotations q [L, d, d]; float weights keep their dtype,
    int8 weights are dequantized, folded and re-quantized per output channel."""
    folded = jnp.einsum("lnd,lde->lne", float_gate_up(stack), q)
    if stack.gate_up_scale is None:
        return stacked_input_layout(folded.astype(stack.gate_up.dtype))
    values, scale = row_quantize(folded)
    return stacked_input_layout(values, scale[..., None].astype(jnp.float32))
