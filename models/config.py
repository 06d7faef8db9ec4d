"""Model configuration read from a HF ``config.json`` (allow-listed fields only).

One frozen, hashable dataclass describes LLaMA, Qwen2/3, their mixture-of-experts variants
(`moe_config.MoEConfig`) and Gemma 3 decoders; it is a static argument of every jitted engine
function, so two equal configs share compiles. Each HF field is parsed and checked in
models/hf_fields.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

from . import hf_fields as hf
from .hf_fields import FFN_ACTIVATIONS, LAYER_TYPES, ConfigError, RopeScaling  # noqa: F401 (re-exported)
from .moe_config import MOE_MODEL_TYPES, MoEConfig, moe_from_hf  # noqa: F401 (re-exported)
from .vision_config import VisionConfig, vision_from_dict

# vision-language models: a Qwen2 (Qwen2-VL, Qwen2.5-VL) or Qwen3 (Qwen3-VL) decoder, their
# `text_config`, behind a vision tower (models/vision.py)
VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
# VLMs whose M-RoPE interleaves the three axes over the frequencies (models/mrope.py) and whose
# tower feeds DeepStack features into the first decoder layers (models/deepstack.py)
QWEN3_VL_TYPES = ("qwen3_vl", "qwen3_vl_moe")

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
    # Qwen2-VL / Qwen2.5-VL: the language model is Qwen2's, with M-RoPE (models/mrope.py)
    "qwen2_vl": dict(qkv_bias=True, qk_norm=False),
    "qwen2_5_vl": dict(qkv_bias=True, qk_norm=False),
    # Qwen3-VL: Qwen3's language model (q/k norms, no q/k/v bias), interleaved M-RoPE, DeepStack
    "qwen3_vl": dict(qkv_bias=False, qk_norm=True),
    # Qwen3-VL-MoE: the same, with Qwen3-MoE-style routed experts (models/moe.py)
    "qwen3_vl_moe": dict(qkv_bias=False, qk_norm=True),
}


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
    # How linear-layer weights are stored (popjax/kernels/int8.py): "float" (the compute dtype) or "int8"
    # (int8 values, an fp32 scale per output channel). Not an HF field: written as
    # ``popjax_weights`` in popjax's own config.json when not "float".
    weights: str = "float"
    # How an int8 model's dots read their activations (popjax/kernels/int8.py `dot`): "float"
    # (weight-only) or "int8" (per-token dynamic int8, an int8 × int8 dot). A run-time choice
    # of `popjax.load`, never stored: a converted store serves both.
    activations: str = "float"
    # The gate activation of the gated FFN (FFN_ACTIVATIONS): "silu" (SwiGLU: LLaMA, Qwen) or
    # "gelu_pytorch_tanh" (GeGLU: Gemma).
    hidden_act: str = "silu"
    # Per-layer attention kind (LAYER_TYPES), None = every layer full. A "sliding_attention"
    # layer attends to the last ``sliding_window`` positions (itself included) and keeps a
    # ring-buffer cache of that many slots (popjax/kernels/attention.py).
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
    # A vision-language model (VL_MODEL_TYPES): its vision tower, M-RoPE's split of the h/2 rotary
    # frequencies over the (temporal, height, width) position axes, and the token ids that mark
    # an image's placeholders in a prompt (one per merged patch) and its start.
    vision: VisionConfig | None = None
    mrope_section: tuple[int, ...] | None = None
    image_token_id: int | None = None
    vision_start_token_id: int | None = None

    @property
    def is_vision_language(self) -> bool:
        """Whether prompts may hold images (the model has a vision tower)."""
        return self.vision is not None

    @property
    def mrope_interleaved(self) -> bool:
        """Whether M-RoPE interleaves its axes over the frequencies (Qwen3-VL) or takes chunks."""
        return self.model_type in QWEN3_VL_TYPES

    @property
    def deepstack_layers(self) -> int:
        """How many first decoder layers get DeepStack features added after them (0: none)."""
        return 0 if self.vision is None else len(self.vision.deepstack_visual_indexes)

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
        if self.vision is not None:
            out["vision_config"] = self.vision.to_dict()
            out["mrope_section"] = list(self.mrope_section)
        out.pop("vision", None)
        del out["moe"]  # MoE configs write HF's own fields instead (dense configs are unchanged)
        if self.moe is not None:
            out.update(self.moe.hf_fields(self.model_type, self.num_hidden_layers))
        return out

    @classmethod
    def from_hf_dict(cls, raw: Mapping[str, Any]) -> "ModelConfig":
        model_type = str(raw.get("model_type", "")).lower()
        vl = {}
        if model_type in VL_MODEL_TYPES:
            raw, vl = vision_language_fields(raw, model_type)
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
                rope_theta=float(hf.rope_theta(raw)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                rope_scaling=hf.rope_scaling(raw),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=hf.as_tuple(raw.get("eos_token_id")),
                intermediate_sizes=hf.layer_widths(raw.get("intermediate_sizes"), int(raw["num_hidden_layers"])),
                down_proj_bias=bool(raw.get("down_proj_bias", False)),
                moe=moe,
                weights=hf.weight_format(raw.get("popjax_weights", "float")),
                hidden_act=hf.activation(raw, model_type),
                layer_types=hf.layer_types(hf.raw_layer_types(raw), int(raw["num_hidden_layers"])),
                sliding_window=hf.sliding_window(raw),
                rope_local_theta=hf.local_rope_theta(raw),
                query_pre_attn_scalar=hf.float_or_none(raw.get("query_pre_attn_scalar")),
                final_logit_softcapping=hf.float_or_none(raw.get("final_logit_softcapping")),
                **vl,
                **flags,
            )
        except KeyError as err:
            raise ConfigError(f"config.json lacks the required field {err.args[0]!r}") from None
        if cfg.mrope_section is not None:
            _check_mrope_section(cfg.mrope_section, cfg.head_dim, cfg.mrope_interleaved)
        if cfg.deepstack_layers > cfg.num_hidden_layers:
            raise ConfigError(f"vision_config has {cfg.deepstack_layers} deepstack_visual_indexes and the language model "
                              f"{cfg.num_hidden_layers} layers: DeepStack adds one feature set after each of the first layers")
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


def vision_language_fields(raw: Mapping[str, Any], model_type: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Qwen2-VL / Qwen2.5-VL / Qwen3-VL(-MoE) ``config.json`` (HF's, the language model's fields under
    ``text_config``; or popjax's own, flat) -> (the decoder's fields, flat, for `from_hf_dict`;
    the `ModelConfig` fields of its vision side)."""
    text = {**raw, **(raw.get("text_config") or {}), "model_type": model_type}
    if "tie_word_embeddings" in raw:  # HF keeps it at the top level of a VL config
        text["tie_word_embeddings"] = raw["tie_word_embeddings"]
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(text.get(key), Mapping) and text[key].get("rope_type", text[key].get("type")) == "mrope":
            text[key] = {**text[key], "rope_type": "default"}  # transformers 4.x's name for M-RoPE's plain frequencies
    block = hf.rope_block(text)
    section = text.get("mrope_section") or block.get("mrope_section")
    if section is None:
        raise ConfigError(f"a {model_type} config needs mrope_section (in rope_parameters/rope_scaling): M-RoPE's split of "
                          "the rotary frequencies over its three position axes")
    if "vision_config" not in raw:
        raise ConfigError(f"a {model_type} config needs vision_config (the vision tower's fields)")
    for key in ("image_token_id", "vision_start_token_id"):
        if not isinstance(raw.get(key), int) or isinstance(raw.get(key), bool):
            raise ConfigError(f"a {model_type} config needs an integer {key}, got {raw.get(key)!r}")
    tower = "qwen3_vl" if model_type in QWEN3_VL_TYPES else model_type  # the MoE variant has the dense one's tower
    fields = dict(vision=vision_from_dict(raw["vision_config"], tower), mrope_section=hf.as_tuple(section),
                  image_token_id=raw["image_token_id"], vision_start_token_id=raw["vision_start_token_id"])
    return text, fields


def _check_mrope_section(section: tuple[int, ...], head_dim: int, interleaved: bool) -> None:
    """HF does not check ``mrope_section``: a wrong one silently rotates by the wrong axes."""
    if not section or any(v < 1 for v in section) or sum(section) != head_dim // 2 or head_dim % 2:
        raise ConfigError(f"mrope_section={list(section)} is invalid: its values must be positive and sum to "
                          f"head_dim/2 = {head_dim / 2:g} (M-RoPE's split of the rotary frequencies over its position axes)")
    if interleaved and len(section) != 3:
        raise ConfigError(f"mrope_section={list(section)} is invalid: interleaved M-RoPE needs 3 values (temporal, height, width)")


# fields added with Gemma 3 and the VL models, written by `to_hf_dict` only when they differ from their defaults
_OMITTED_AT_DEFAULT = ("hidden_act", "layer_types", "sliding_window", "rope_local_theta", "sandwich_norms", "embed_scale",
                       "vision", "mrope_section", "image_token_id", "vision_start_token_id",
                       "query_pre_attn_scalar", "final_logit_softcapping")
