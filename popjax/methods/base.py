"""The method interface (docs/methods.md §6): ``Method`` (hyper-parameters; ``bind`` resolves a
plan, ``prepare`` calibrates), the global→FFN ratio allocation (§1), and the channel helpers the
FFN methods share (importance, ranking, compact copies). The plan protocol the engine calls and
the FFN math live one layer down, in ``popjax.ffn``."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from ..models.config import ModelConfig
from ..ffn import FFNWeights, Plan, activations, down_proj, gate_activation, gate_and_up  # noqa: F401 (FFNWeights, gate_and_up, gate_activation: re-exported for the methods)
from ..kernels.int8 import dot, take  # noqa: F401 (dot: re-exported for the methods)
from flax import nnx

from .. import distributed
from ..convert.fused import dequantize_tree
from ..corpus import Corpus, default_corpus, text_file_corpus
from ..models.moe import slot_array
from ..sharding import pad_ids, take_replicated, take_split, take_split_rows
from .per_sequence import decode_per_sequence, prefill_per_sequence

AGGREGATES = ("shared", "per_sequence")
# aggregates under which every row gets its own statistics (its output ignores its batch-mates)
ROW_AGGREGATES = ("per_sequence", "per_token")
# Channel indices come from top_k over the channels themselves, so they are always in bounds; jnp.take's
# default mode ("fill") adds a bounds-check select over every gathered block per step, "clip" clamps the ids.
TAKE_MODE = "clip"
IN_BOUNDS = "promise_in_bounds"


class MethodError(ValueError):
    """Invalid pruning-method hyper-parameters."""


def ffn_ratio(cfg: ModelConfig, ratio: float) -> float:
    """Global decoder-parameter ratio r -> FFN ratio r·(P_attn + P_mlp)/P_mlp (docs/methods.md §1)."""
    check_global_ratio(ratio)
    p_attn, p_mlp = cfg.attention_params_per_layer(), cfg.mlp_params_per_layer()
    r_ffn = ratio * (p_attn + p_mlp) / p_mlp
    if r_ffn >= 1.0:
        max_ratio = p_mlp / (p_attn + p_mlp)
        raise MethodError(f"ratio={ratio} needs an FFN ratio of {r_ffn:.3f} ≥ 1 for this model (attention is never "
                          f"pruned); valid global ratios are below {max_ratio:.3f}")
    return r_ffn


def round_half_up(x: float) -> int:
    return int(math.floor(x + 0.5))


def check_block(block) -> None:
    """MethodError unless ``block`` is a positive integer (a block-granular method's block size)."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise MethodError(f"block={block!r} is invalid; use a positive integer (1: single channels)")


def top_blocks(scores: jax.Array, count: int, block: int) -> tuple[jax.Array, jax.Array]:
    """The ``count`` best blocks of ``block`` consecutive entries of scores [n] by the L2 norm of
    their scores -> (those norms [count], block ids [count]; ``lax.top_k``: ties to the lower id)."""
    return jax.lax.top_k(jnp.sqrt(jnp.sum(jnp.square(scores.reshape(-1, block)), axis=-1)), count)


def block_channels(ids: jax.Array, block: int) -> jax.Array:
    """Block ids [nb] -> their entries [nb · block], each block's in order."""
    return (ids[:, None] * block + jnp.arange(block, dtype=ids.dtype)).reshape(-1)


def kept_channels(cfg: ModelConfig, ratio: float) -> int:
    """n_keep = f − round(r_ffn · f), static per model and ratio."""
    if cfg.intermediate_sizes is not None:
        raise MethodError(f"pruning methods need one FFN width for all layers; this model was pruned to per-layer widths "
                          f"{list(cfg.intermediate_sizes)} (only dense inference runs on it)")
    f = cfg.intermediate_size
    return f - round_half_up(ffn_ratio(cfg, ratio) * f)


def resolve_corpus(model, corpus) -> Corpus:
    """The calibration corpus a method's ``calibrate(model, corpus)`` was given: a `Corpus`, a
    UTF-8 text file (tokenised with ``model``'s tokenizer), or None (the model's default
    Shakespeare corpus); MethodError for anything else."""
    if corpus is None:
        return default_corpus(model)
    if isinstance(corpus, (str, Path)):
        return text_file_corpus(corpus, model.tokenizer)
    if not isinstance(corpus, Corpus):
        raise MethodError(f"corpus={corpus!r} is neither a popjax.calibration.Corpus nor a text file path")
    return corpus


def block_rows(cfg: ModelConfig) -> tuple[int, int]:
    """(block slots per layer, rows) of a per-block table of calibrated data: (0, L) on a dense
    model, (slots, L · slots) on a MoE model (a row per (layer, block slot): `models.moe.table_row`)."""
    L = cfg.num_hidden_layers
    blocks = 0 if cfg.moe is None else cfg.moe.slots(L)
    return blocks, L * max(blocks, 1)


def gate_up_blocks(model) -> list[np.ndarray]:
    """Every FFN block's gate/up weights [2, f, d] of a loaded (unrolled) model, an int8 model's
    dequantized, gathered to the host from every process, in the row order of a per-block data
    table (`block_rows`): per layer, or per (layer, block slot) on a MoE model (a slot without a
    block is zeros)."""
    cfg = model.config
    pure = dequantize_tree(distributed.to_host(nnx.to_pure_dict(model.params)))
    layers = {int(i): layer for i, layer in pure["layers"].items()}
    if cfg.moe is not None:
        return [g for l in range(cfg.num_hidden_layers) for g in slot_array(cfg, l, layers[l]["mlp"], "gate_up")]
    return [layers[l]["mlp"]["gate_up"] for l in range(cfg.num_hidden_layers)]


def check_choice(name: str, value, choices: tuple) -> None:
    """MethodError naming ``value`` unless it is one of ``choices``."""
    if value not in choices:
        raise MethodError(f"{name}={value!r} is not one of {choices}")


def check_aggregate(aggregate: str) -> None:
    check_choice("aggregate", aggregate, AGGREGATES)


def check_global_ratio(ratio: float) -> None:
    """The model-free part of the ratio check (the FFN feasibility check needs the config)."""
    if isinstance(ratio, bool) or not (isinstance(ratio, (int, float)) and 0.0 <= ratio < 1.0):
        raise MethodError(f"ratio={ratio!r} is outside [0, 1): it is the global fraction of decoder parameters removed")


def check_gamma(gamma: float) -> None:
    if not (isinstance(gamma, (int, float)) and 0.0 <= gamma <= 1.0):
        raise MethodError(f"gamma={gamma!r} is outside [0, 1]: it is the candidate band width as a fraction of f")


# ---------------------------------------------------------------- shared MLP math


def prefill_importance(h: jax.Array, valid: jax.Array, down_norm: jax.Array) -> jax.Array:
    """I_j = ‖H[valid, j]‖₂ · ‖W_d[:, j]‖₂ over batch and valid tokens: h [B, T, f] -> [f] fp32.
    ``valid`` may instead be fp32 token weights [B, T] (prompt_tokens.scoring_tokens'
    "balanced"): then I_j = √(Σ_t valid_t · H_tj²) · ‖W_d[:, j]‖₂."""
    if valid.dtype != jnp.bool_:
        hf = h.astype(jnp.float32)
        return jnp.sqrt(jnp.sum(valid[..., None] * hf * hf, axis=(0, 1))) * down_norm
    hf = jnp.where(valid[..., None], h.astype(jnp.float32), 0.0)
    return jnp.sqrt(jnp.sum(hf * hf, axis=(0, 1))) * down_norm


def step_importance(h: jax.Array, valid: jax.Array, down_norm: jax.Array) -> jax.Array:
    """Decode-step scores ‖H_t[valid, j]‖₂ · ‖W_d[:, j]‖₂ over the batch's valid rows:
    h [B, 1, n], valid [B, 1] -> [n] fp32."""
    return prefill_importance(h, valid, down_norm)


def rank_channels(importance: jax.Array) -> jax.Array:
    """Channel ids by decreasing importance (ties: lower id first): [f] -> [f] int32."""
    return jax.lax.top_k(importance, importance.shape[-1])[1]


def take_channels(w: jax.Array, idx: jax.Array, axis: int) -> jax.Array:
    """Gathers channels ``idx`` of an array along ``axis`` (columns of down: axis 1)."""
    return take(w, idx, axis, mode=TAKE_MODE)


def take_gate_up(gate_up: jax.Array, idx: jax.Array) -> jax.Array:
    """Compact gate/up rows of channels ``idx`` [n]: [2, f, d] -> [2, n, d]."""
    return take_channels(gate_up, idx, axis=1)


def copy_channels(w: jax.Array, idx: jax.Array, axis: int) -> jax.Array:
    """Prefill's compact copy of channels ``idx`` [k] along ``axis``: a block every decode step
    then reads whole. On a mesh it is split over the ``model`` axis like ``w`` (`take_split`:
    no weight is gathered, each device keeps 1/n); padded with zero channels (they add exactly 0:
    silu(0)·0 = 0) to k' = a multiple of n, and of 8 on a TPU (`sharding.pad_ids`)."""
    return take_split(w, pad_ids(idx), axis)


def copy_gate_up(gate_up: jax.Array, idx: jax.Array) -> jax.Array:
    """`copy_channels` of gate/up rows: [2, f, d] -> [2, k', d]."""
    return copy_channels(gate_up, idx, axis=1)


def copy_candidates(w: jax.Array, idx: jax.Array, axis: int) -> jax.Array:
    """Prefill's copy of candidate channels ``idx`` [n] along ``axis``, which every step gathers
    a few of: held whole by every device on a mesh (`take_replicated`: local gathers and one
    all-reduce of the copy, never a gathered weight); ``take_channels`` without one."""
    return take_replicated(w, idx, axis)


def copy_rows(w: jax.Array, ids: jax.Array) -> jax.Array:
    """`copy_channels` of a block mixing parts of ``w`` [P, f, d] (e.g. gate rows of one channel
    set and up rows of another): ids ``p·f + c`` [k] (negative: a zero row) -> [k', d], split
    over ``model`` on a mesh and padded with zero rows to k' (a multiple of the split)."""
    return take_split_rows(w, pad_ids(ids))


def masked_down(h: jax.Array, keep_idx: jax.Array, down: jax.Array) -> jax.Array:
    """W_d applied to the channels ``keep_idx`` only: h [B, T, f] -> [B, T, d]."""
    keep = jnp.zeros(h.shape[-1], h.dtype).at[keep_idx].set(1, mode=IN_BOUNDS)
    return down_proj(h * keep, down)


def score_prompt(w: FFNWeights, x: jax.Array, valid: jax.Array, n_keep: int, with_h: bool = False):
    """The common prefill of prompt-scored methods (docs/methods.md §2, "Prefill"): H on all f channels,
    importance over valid tokens, the ranking, and the layer output under the pruning structure
    (W_d applied to the top ``n_keep`` channels).

    x [B, T, d], valid [B, T] -> (y [B, T, d], order [f], importance [f]) (+ H [B, T, f] with ``with_h``)."""
    h = activations(w.gate_up, x, gate_activation(w))
    importance = prefill_importance(h, valid, w.down_norm)
    order = rank_channels(importance)
    out = (masked_down(h, order[:n_keep], w.down), order, importance)
    return (*out, h) if with_h else out


def dense_mlp(w: FFNWeights, x: jax.Array) -> jax.Array:
    """The full MLP: x [..., d] -> [..., d] (a pruned checkpoint's down bias is the layer's to add)."""
    return down_proj(activations(w.gate_up, x, gate_activation(w)), w.down)


@dataclasses.dataclass(frozen=True)
class DensePlan(Plan):
    name: ClassVar[str] = "dense"

    def prefill(self, w, x, valid):
        """x [B, T, d] -> (y [B, T, d], no state, no aux)."""
        return dense_mlp(w, x), None, {}

    def decode(self, w, state, x, step, valid):
        return dense_mlp(w, x), state, {}

    def ffn_flops_per_token(self, d: int) -> int:
        return 6 * d * self.f

    def ffn_weights_read(self, d: int) -> int:
        return 3 * d * self.f


@dataclasses.dataclass(frozen=True)
class AggregatedPlan(Plan):
    """A plan written for the shared mode (statistics over the whole batch) in ``_prefill`` and
    ``_decode``; ``aggregate="per_sequence"`` runs the same code per sequence through vmap."""

    aggregate: str = "shared"
    # Whether the state holds gathered weight blocks (then per-sequence mode holds one per row).
    compact_weights: ClassVar[bool] = True

    def ffn_weights_read_per_step(self, d: int, batch: int) -> int:
        copies = batch if self.aggregate == "per_sequence" and self.compact_weights else 1
        return copies * self.ffn_weights_read(d)

    def prefill(self, w, x, valid):
        if self.aggregate == "per_sequence":
            return prefill_per_sequence(self._prefill, w, x, valid)
        return self._prefill(w, x, valid)

    def decode(self, w, state, x, step, valid):
        if self.aggregate == "per_sequence":
            return decode_per_sequence(self._decode, w, state, x, step, valid)
        return self._decode(w, state, x, step, valid)

    def _prefill(self, w, x, valid):  # pragma: no cover - interface
        raise NotImplementedError

    def _decode(self, w, state, x, step, valid):  # pragma: no cover - interface
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Method:
    """Base of user-facing methods: hyper-parameters only; ``bind`` resolves the plan.

    A method declares its traits, which every caller (evaluation, lm-eval, sweeps, sharding)
    asks instead of probing field names: ``needs_calibration`` (``prepare`` fits data offline;
    the class declares it as ``calibrates``),
    ``layer_level`` (it acts on whole layers and composes with an FFN method through ``+``),
    ``aggregates`` (the values its ``aggregate`` takes), ``takes_ratio``, ``ffn_method`` (the
    method acting in each FFN), ``batch_independent`` and ``reported`` (what records show)."""

    name: ClassVar[str] = "method"
    calibrates: ClassVar[bool] = False
    layer_level: ClassVar[bool] = False
    aggregates: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def hyper_parameters(cls) -> tuple[str, ...]:
        """The names of the method's hyper-parameters (its dataclass fields)."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def takes_ratio(cls) -> bool:
        """Whether the method prunes a global ``ratio`` of decoder parameters."""
        return "ratio" in cls.hyper_parameters()

    @property
    def needs_calibration(self) -> bool:
        """Whether ``prepare`` fits data offline (once per model, cached) for this method."""
        return self.calibrates

    @property
    def ffn_method(self) -> "Method":
        """The method that runs in every layer's FFN: the method itself, or a layer-level
        method's inner FFN method."""
        return self

    @property
    def batch_independent(self) -> bool:
        """Whether one sequence's output cannot depend on the other rows of its batch (a
        per-row aggregate). Unknown is False: callers then batch only what may share."""
        return "aggregate" in self.hyper_parameters() and self.aggregate in ROW_AGGREGATES

    def reported(self) -> dict[str, Any]:
        """The hyper-parameters every evaluation record reports, of the FFN method: ``ratio``
        (0.0 when it takes none), ``gamma`` and ``aggregate`` (None when it has none)."""
        inner = self.ffn_method
        fields = {name: getattr(inner, name) for name in inner.hyper_parameters()}
        return {"ratio": fields.get("ratio") or 0.0, "gamma": fields.get("gamma"), "aggregate": fields.get("aggregate")}

    def bind(self, cfg: ModelConfig) -> Plan:  # pragma: no cover - interface
        raise NotImplementedError

    def prepare(self, model) -> "Method":
        """The method ready for ``model``: offline methods calibrate here (once, cached on
        disk); online methods are ready as they are."""
        return self

    def data(self, model) -> dict | None:
        """The prepared method's calibrated data for ``model``: a pytree of arrays that the
        engine passes into its compiled programs as a traced argument (a new calibration then
        compiles nothing); None when the method has none."""
        return None


@dataclasses.dataclass(frozen=True)
class RatioMethod(Method):
    """A method pruning a global ``ratio`` of decoder parameters from the FFN (docs/methods.md §1), in the
    per-sequence (default) or shared aggregate mode. Subclasses name their plan class and may add sizes
    in ``plan_sizes``; a ratio that keeps every channel binds to the dense plan."""

    plan_class: ClassVar[type] = AggregatedPlan
    aggregates: ClassVar[tuple[str, ...]] = AGGREGATES  # the values ``aggregate`` takes
    ratio: float = 0.2
    _: dataclasses.KW_ONLY
    # per sequence by default: a prompt's output never depends on what it is batched with (the
    # papers prune one request at a time); "shared" (one selection per batch) is the documented
    # batch-serving option, with one compact copy per batch instead of one per sequence
    aggregate: str = "per_sequence"

    def __post_init__(self):
        check_global_ratio(self.ratio)
        check_aggregate(self.aggregate)

    def plan_sizes(self, f: int, n_keep: int) -> dict[str, int]:
        return {}

    def bind(self, cfg: ModelConfig) -> Plan:
        f, n_keep = cfg.intermediate_size, kept_channels(cfg, self.ratio)
        if n_keep == f:
            return DensePlan(f=f, n_keep=f)
        return self.plan_class(f=f, n_keep=n_keep, aggregate=self.aggregate, **self.plan_sizes(f, n_keep))
