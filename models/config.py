"""Model configuration read from a HF ``config.json`` (allow-listed fields only).

One frozen, hashable dataclass describes LLaMA, Qwen2 and Qwen3 decoders; it is a
static argument of every jitted engine function, so two equal configs share compiles.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from .quant import WEIGHT_FORMATS

# HF `architectures` / `model_type` values we accept, and the switches they imply.
_ARCH_FLAGS = {
    "llama": dict(qkv_bias=False, qk_norm=False),
    "qwen2": dict(qkv_bias=True, qk_norm=False),
    "qwen3": dict(qkv_bias=False, qk_norm=True),
    # mixture-of-experts families (models/moe.py)
    "qwen2_moe": dict(qkv_bias=True, qk_norm=False),
    "qwen3_moe": dict(qkv_bias=False, qk_norm=True),
    "mixtral": dict(qkv_bias=False, qk_norm=False),
    # Gemma 3 (text): q/k norms, pre- and post-norms around attention and FFN ("sandwich"), GeGLU,
    # embeddings scaled by √d, sliding-window and global layers (`layer_types`)
    "gemma3_text": dict(qkv_bias=False, qk_norm=True, sandwich_norms=True, embed_scale=True),
}
# The FFN gate activations popjax runs (HF ``hidden_act`` / ``hidden_activation`` names): the
# gated MLP is act(x W_gᵀ) ⊙ x W_uᵀ; every method reads ``ModelConfig.hidden_act``.
FFN_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# HF names that mean the same function as one of FFN_ACTIVATIONS
_ACTIVATION_ALIASES = {"swish": "silu", "gelu_tanh": "gelu_pytorch_tanh", "gelu_new": "gelu_pytorch_tanh"}
# Attention kinds of HF ``layer_types``: a full (causal) layer, a sliding-window layer
LAYER_TYPES = ("full_attention", "sliding_attention")


class ConfigError(ValueError):
    """A config.json that popjax cannot run (unsupported architecture, bad field)."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """HF ``rope_scaling`` / ``rope_parameters`` block; ``rope_type`` keys the rope registry."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder hyper-parameters. Shapes below use d=hidden, f=intermediate, h=head_dim."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: RopeScaling = RopeScaling()
    qkv_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # A structurally pruned checkpoint (popjax.pruned): per-layer FFN widths (then
    # intermediate_size is their mean) and a bias on the down projection (a pruned FFN's
    # compensation for the channels it lost). Not HF fields: they live in popjax's own config.json.
    intermediate_sizes: tuple[int, ...] | None = None
    down_proj_bias: bool = False
    # A mixture-of-experts model (models.moe.MoEConfig); then intermediate_size is the expert
    # width f_e, the channel-block width every FFN of the model is pruned in (docs/moe.md).
    moe: MoEConfig | None = None
    # How linear-layer weights are stored (models/quant.py): "float" (the compute dtype) or "int8"
    # (int8 values, an fp32 scale per output channel). Not an HF field: written as
    # ``popjax_weights`` in popjax's own config.json when not "float".
    weights: str = "float"
    # How an int8 model's dots read their activations (models/quant.py `dot`): "float"
    # (weight-only) or "int8" (per-token dynamic int8, an int8 × int8 dot). A run-time choice
    # of `popjax.load`, never stored: a converted store serves both.
    activations: str = "float"
    # The gate activation of the gated FFN (FFN_ACTIVATIONS): "silu" (SwiGLU: LLaMA, Qwen) or
    # "gelu_pytorch_tanh" (GeGLU: Gemma).
    hidden_act: str = "silu"
    # Per-layer attention kind (LAYER_TYPES), None = every layer full. A "sliding_attention"
    # layer attends to the last ``sliding_window`` positions (itself included) and keeps a
    # ring-buffer cache of that many slots (models/attention.py).
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    # RoPE base of the sliding-window layers (Gemma 3's ``rope_local_base_freq``; default rope,
    # no scaling); None: they use the global ``rope_theta`` and ``rope_scaling``.
    rope_local_theta: float | None = None
    # Gemma: a norm after attention and after the FFN (before each residual add) besides the
    # pre-norms; embeddings multiplied by √d.
    sandwich_norms: bool = False
    embed_scale: bool = False
    # Attention scores are scaled by query_pre_attn_scalar^-½ (Gemma) instead of head_dim^-½.
    query_pre_attn_scalar: float | None = None
    # logits = c·tanh(logits / c) when set (Gemma's final_logit_softcapping).
    final_logit_softcapping: float | None = None

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        """The factor on q·k: query_pre_attn_scalar^-½, else head_dim^-½."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_type(self, layer: int) -> str:
        """"full_attention" or "sliding_attention" (LAYER_TYPES) for layer ``layer``."""
        return "full_attention" if self.layer_types is None else self.layer_types[layer]

    def window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (positions it attends to), None for a full layer."""
        return self.sliding_window if self.layer_type(layer) == "sliding_attention" else None

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.window(i) is not None)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.window(i) is None)

    def without_windows(self) -> "ModelConfig":
        """The same model with every layer's cache and attention full (e.g. to size the KV cache
        a model would need without sliding windows)."""
        return dataclasses.replace(self, layer_types=None, sliding_window=None, rope_local_theta=None) if self.layer_types else self

    def attention_params_per_layer(self) -> int:
        """Parameters of one attention block (q, k, v, o and their biases)."""
        d = self.hidden_size
        n = d * self.q_dim + 2 * d * self.kv_dim + self.q_dim * d
        if self.qkv_bias:
            n += self.q_dim + 2 * self.kv_dim
        return n

    def mlp_params_per_layer(self) -> float:
        """3·d·f; for a MoE model the FFN parameters one token activates (top-k experts + shared
        expert), averaged over layers (a global pruning ratio counts activated parameters, docs/moe.md)."""
        if self.moe is not None:
            return self.moe.activated_mlp_params(self.hidden_size, self.num_hidden_layers) / self.num_hidden_layers
        return 3 * self.hidden_size * self.intermediate_size

    def ffn_width(self, layer: int | None = None) -> int:
        """FFN width f of layer ``layer`` (the uniform width when None or without per-layer widths)."""
        if self.intermediate_sizes is None or layer is None:
            return self.intermediate_size
        return self.intermediate_sizes[layer]

    def to_hf_dict(self) -> dict[str, Any]:
        """The allow-listed fields as a HF-style dict (round-trips through `from_hf_dict`)."""
        out = dataclasses.asdict(self)
        out["rope_scaling"] = dataclasses.asdict(self.rope_scaling)
        out["eos_token_id"] = list(out.pop("eos_token_ids"))
        # pruning fields are omitted when unset: unpruned configs (and keys hashed from them) stay as they were
        if self.intermediate_sizes is None:
            del out["intermediate_sizes"]
        else:
            out["intermediate_sizes"] = list(self.intermediate_sizes)
        if not self.down_proj_bias:
            del out["down_proj_bias"]
        del out["activations"]  # a run-time choice (popjax.load), not part of the checkpoint
        weights = out.pop("weights")
        if weights != "float":
            out["popjax_weights"] = weights
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for key in _OMITTED_AT_DEFAULT:  # unset: configs (and keys hashed from them) stay as they were
            if out[key] == defaults[key]:
                del out[key]
        if self.layer_types is not None:
            out["layer_types"] = list(self.layer_types)
        if self.rope_local_theta is not None:
            out["rope_local_base_freq"] = out.pop("rope_local_theta")
        del out["moe"]  # MoE configs write HF's own fields instead (dense configs are unchanged)
        if self.moe is not None:
            out.update(self.moe.hf_fields(self.model_type, self.num_hidden_layers))
        return out

    @classmethod
    def from_hf_dict(cls, raw: Mapping[str, Any]) -> "ModelConfig":
        model_type = str(raw.get("model_type", "")).lower()
        if model_type not in _ARCH_FLAGS:
            raise ConfigError(
                f"unsupported architecture model_type={model_type!r} "
                f"(architectures={raw.get('architectures')}); supported: {sorted(_ARCH_FLAGS)}"
            )
        flags = dict(_ARCH_FLAGS[model_type])
        if model_type == "llama" and raw.get("attention_bias"):
            flags["qkv_bias"] = True  # some LLaMA derivatives carry q/k/v biases
        if model_type == "llama" and raw.get("mlp_bias"):
            raise ConfigError("mlp_bias=True is not supported (pruning assumes a bias-free gated MLP)")
        if raw.get("attn_logit_softcapping") is not None:
            raise ConfigError(
                f"attn_logit_softcapping={raw['attn_logit_softcapping']!r} is not supported (Gemma 2's attention "
                "soft-capping); popjax runs Gemma 3, which has none"
            )
        if raw.get("use_bidirectional_attention"):
            raise ConfigError("use_bidirectional_attention=True (an encoder) is not supported: popjax runs causal decoders")
        moe = None
        if model_type in MOE_MODEL_TYPES:
            try:
                moe = moe_from_hf(raw, model_type, int(raw["num_hidden_layers"]))
            except KeyError as err:
                raise ConfigError(f"config.json lacks the required field {err.args[0]!r}") from None
        try:
            d = int(raw["hidden_size"])
            n_heads = int(raw["num_attention_heads"])
            cfg = cls(
                model_type=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=d,
                intermediate_size=int(raw["intermediate_size"]) if moe is None else moe.expert_size,
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=n_heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or n_heads),
                head_dim=int(raw.get("head_dim") or d // n_heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(_rope_theta(raw)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                rope_scaling=_rope_scaling(raw),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=_as_tuple(raw.get("eos_token_id")),
                intermediate_sizes=_layer_widths(raw.get("intermediate_sizes"), int(raw["num_hidden_layers"])),
                down_proj_bias=bool(raw.get("down_proj_bias", False)),
                moe=moe,
                weights=_weight_format(raw.get("popjax_weights", "float")),
                hidden_act=_activation(raw, model_type),
                layer_types=_layer_types(_raw_layer_types(raw), int(raw["num_hidden_layers"])),
                sliding_window=_sliding_window(raw),
                rope_local_theta=_local_rope_theta(raw),
                query_pre_attn_scalar=_float_or_none(raw.get("query_pre_attn_scalar")),
                final_logit_softcapping=_float_or_none(raw.get("final_logit_softcapping")),
                **flags,
            )
        except KeyError as err:
            raise ConfigError(f"config.json lacks the required field {err.args[0]!r}") from None
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={cfg.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={cfg.num_key_value_heads}"
            )
        return cfg

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no config.json at {path}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path} is not valid JSON: {err}") from None
        return cls.from_hf_dict(raw)


# fields added with Gemma 3, written by `to_hf_dict` only when they differ from their defaults
_OMITTED_AT_DEFAULT = ("hidden_act", "layer_types", "sliding_window", "rope_local_theta", "sandwich_norms", "embed_scale",
                       "query_pre_attn_scalar", "final_logit_softcapping")


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def _activation(raw: Mapping[str, Any], model_type: str) -> str:
    """``hidden_act`` (or Gemma's ``hidden_activation``) -> one of FFN_ACTIVATIONS."""
    default = "gelu_pytorch_tanh" if model_type == "gemma3_text" else "silu"
    value = raw.get("hidden_activation") or raw.get("hidden_act") or default
    act = _ACTIVATION_ALIASES.get(value, value)
    if act not in FFN_ACTIVATIONS:
        raise ConfigError(f"hidden_act={value!r} is not an FFN activation popjax runs; supported: {list(FFN_ACTIVATIONS)}")
    return act


def _layer_types(value: Any, n_layers: int) -> tuple[str, ...] | None:
    """``layer_types``: None, or one of LAYER_TYPES per layer (None when every layer is full)."""
    if value is None:
        return None
    kinds = tuple(value) if isinstance(value, (list, tuple)) else None
    if kinds is None or len(kinds) != n_layers:
        raise ConfigError(
            f"layer_types={value!r} is invalid: give one entry per layer ({n_layers} layers), each one of {list(LAYER_TYPES)}"
        )
    unknown = sorted({str(k) for k in kinds if k not in LAYER_TYPES})
    if unknown:
        raise ConfigError(f"layer_types holds {unknown}, not attention kinds popjax runs; each entry is one of {list(LAYER_TYPES)}")
    return None if set(kinds) == {"full_attention"} else kinds


def _raw_layer_types(raw: Mapping[str, Any]) -> Any:
    """``layer_types``, or for a Gemma 3 config that predates it, the pattern HF derives from
    ``sliding_window_pattern`` (every n-th layer full, the others sliding)."""
    if raw.get("layer_types") is not None or raw.get("model_type") != "gemma3_text":
        return raw.get("layer_types")
    n, period = int(raw["num_hidden_layers"]), int(raw.get("sliding_window_pattern", 6))
    return ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(n)]


def _sliding_window(raw: Mapping[str, Any]) -> int | None:
    """``sliding_window`` (an int ≥ 1) when some layer slides, else None (the field is then unused)."""
    kinds = _raw_layer_types(raw)
    if not (isinstance(kinds, (list, tuple)) and "sliding_attention" in kinds):
        return None
    value = raw.get("sliding_window")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"sliding_window={value!r} is invalid: sliding-window layers need a window of at least 1 position")
    return value


def _weight_format(value: Any) -> str:
    if value not in WEIGHT_FORMATS:
        raise ConfigError(f"popjax_weights={value!r} is not a weight format popjax reads: {list(WEIGHT_FORMATS)}")
    return value


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _layer_widths(value: Any, n_layers: int) -> tuple[int, ...] | None:
    """``intermediate_sizes``: None, or one positive int per layer."""
    if value is None:
        return None
    widths = tuple(value) if isinstance(value, (list, tuple)) else ()
    if len(widths) != n_layers or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in widths):
        raise ConfigError(
            f"intermediate_sizes={value!r} is invalid: give one integer ≥ 1 per layer ({n_layers} layers)"
        )
    return widths


def _rope_block(raw: Mapping[str, Any], kind: str = "full_attention") -> Mapping[str, Any]:
    """The rope block of layers of ``kind``: `rope_scaling` (transformers 4.x) or
    `rope_parameters` (5.x), which may hold one block per layer type (Gemma 3)."""
    block = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if any(k in block for k in LAYER_TYPES):
        block = block.get(kind) or {}
    return block


def _rope_theta(raw: Mapping[str, Any]) -> float:
    return raw.get("rope_theta") or _rope_block(raw).get("rope_theta") or 10000.0


def _local_rope_theta(raw: Mapping[str, Any]) -> float | None:
    """The sliding layers' RoPE base: Gemma 3's `rope_local_base_freq` (4.x) or the
    "sliding_attention" block of `rope_parameters` (5.x)."""
    value = raw.get("rope_local_base_freq")
    if value is None and raw.get("model_type") == "gemma3_text":
        value = _rope_block(raw, "sliding_attention").get("rope_theta", 10000.0)
    return _float_or_none(value)


def _rope_scaling(raw: Mapping[str, Any]) -> RopeScaling:
    """Reads `rope_scaling` (transformers 4.x) or `rope_parameters` (5.x)."""
    block = _rope_block(raw)
    rope_type = block.get("rope_type") or block.get("type") or "default"
    allowed = {f.name for f in dataclasses.fields(RopeScaling)}
    kwargs = {k: block[k] for k in allowed if k in block and k != "rope_type"}
    return RopeScaling(rope_type=str(rope_type), **kwargs)


# ---------------------------------------------------------------- mixture of experts

MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral")
EXPERT_ACTIVATIONS = ("silu",)  # gated SiLU experts, the only kind pruning is defined for
# HF router fields some MoE families carry; anything but these values changes the routing.
ROUTER_FIELDS = {"scoring_func": ("softmax",), "topk_method": ("greedy",)}


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """The MoE part of a ModelConfig (frozen, hashable: part of the jit static config)."""

    num_experts: int  # E routed experts per sparse layer
    top_k: int  # experts per token
    expert_size: int  # f_e
    dense_size: int  # FFN width of a layer without experts (HF intermediate_size)
    shared_size: int = 0  # f_s of the shared expert, 0 = none
    shared_gate: bool = False  # sigmoid(x · w_g) scales the shared expert (Qwen2-MoE)
    norm_topk_prob: bool = False  # renormalise the top-k probabilities to sum to 1
    sparse_layers: tuple[int, ...] = ()  # layers with routed experts

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers

    def always_width(self, layer: int) -> int:
        """Width of the always-active FFN of a layer: the shared expert or the dense FFN."""
        return self.shared_size if self.is_sparse(layer) else self.dense_size

    def blocks(self, width: int) -> int:
        return math.ceil(width / self.expert_size)

    def slots(self, n_layers: int) -> int:
        """Block slots per layer for per-block constants (calibration tables ``[L, slots, ...]``):
        routed expert e is slot e, always-active block b is slot ``num_experts + b``."""
        return self.num_experts + max(self.blocks(self.always_width(l)) for l in range(n_layers))

    def slot_mask(self, n_layers: int) -> np.ndarray:
        """[L, slots] bool: which slots hold a block in each layer (a dense layer has no experts;
        layers have different numbers of always-active blocks)."""
        mask = np.zeros((n_layers, self.slots(n_layers)), bool)
        for l in range(n_layers):
            mask[l, : self.num_experts] = self.is_sparse(l)
            mask[l, self.num_experts : self.num_experts + self.blocks(self.always_width(l))] = True
        return mask

    def activated_mlp_params(self, d: int, n_layers: int) -> int:
        """FFN parameters a token activates, summed over layers: top-k experts + shared expert
        in sparse layers, the dense FFN elsewhere (router and shared gate excluded)."""
        total = 0
        for layer in range(n_layers):
            width = self.top_k * self.expert_size + self.shared_size if self.is_sparse(layer) else self.dense_size
            total += 3 * d * width
        return total

    def hf_fields(self, model_type: str, n_layers: int) -> dict[str, Any]:
        """HF config.json fields that `moe_from_hf` reads back to this config."""
        out = {
            "num_experts_per_tok": self.top_k,
            "intermediate_size": self.expert_size if model_type == "mixtral" else self.dense_size,
        }
        if model_type == "mixtral":
            return {**out, "num_local_experts": self.num_experts}
        return {
            **out,
            "num_experts": self.num_experts,
            "moe_intermediate_size": self.expert_size,
            "shared_expert_intermediate_size": self.shared_size,
            "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(n_layers) if i not in self.sparse_layers],
        }


def moe_from_hf(raw: Mapping[str, Any], model_type: str, n_layers: int) -> MoEConfig:
    """The MoE fields of a HF config.json (Qwen2-MoE, Qwen3-MoE or Mixtral) -> MoEConfig."""
    act = raw.get("hidden_act", "silu")
    if act not in EXPERT_ACTIVATIONS:
        raise ConfigError(f"expert type hidden_act={act!r} is not supported; supported: {list(EXPERT_ACTIVATIONS)}")
    for key, allowed in ROUTER_FIELDS.items():
        if key in raw and raw[key] not in allowed:
            raise ConfigError(f"router type {key}={raw[key]!r} is not supported; supported: {list(allowed)}")
    n_experts = raw.get("num_local_experts") if model_type == "mixtral" else None
    n_experts = n_experts if n_experts is not None else raw.get("num_experts", raw.get("num_local_experts"))
    top_k = raw.get("num_experts_per_tok")
    for key, value in (("num_experts", n_experts), ("num_experts_per_tok", top_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key}={value!r} is invalid for {model_type}: give an integer ≥ 1")
    if top_k > n_experts:
        raise ConfigError(f"num_experts_per_tok={top_k} exceeds num_experts={n_experts}: a token cannot pick more experts than exist")
    dense = int(raw["intermediate_size"])
    if model_type == "mixtral":
        return MoEConfig(n_experts, top_k, dense, dense, norm_topk_prob=True, sparse_layers=tuple(range(n_layers)))
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    only = raw.get("mlp_only_layers") or []
    bad = [i for i in only if not (isinstance(i, int) and 0 <= i < n_layers)]
    if bad:
        raise ConfigError(f"mlp_only_layers={only!r} holds {bad}, not layer indices in [0, {n_layers})")
    sparse = tuple(i for i in range(n_layers) if i not in only and (i + 1) % step == 0)
    shared = int(raw.get("shared_expert_intermediate_size", 0) or 0) if model_type == "qwen2_moe" else 0
    return MoEConfig(
        num_experts=n_experts,
        top_k=top_k,
        expert_size=int(raw["moe_intermediate_size"]),
        dense_size=dense,
        shared_size=shared,
        shared_gate=shared > 0,
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        sparse_layers=sparse,
    )
