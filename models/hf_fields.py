"""The fields of a HF ``config.json`` that `ModelConfig.from_hf_dict` reads, each parsed and
checked here (a bad value is one `ConfigError` naming it and what is valid), and the small
types they parse into (`RopeScaling`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from ..kernels.int8 import WEIGHT_FORMATS

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


def float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def activation(raw: Mapping[str, Any], model_type: str) -> str:
    """``hidden_act`` (or Gemma's ``hidden_activation``) -> one of FFN_ACTIVATIONS."""
    default = "gelu_pytorch_tanh" if model_type == "gemma3_text" else "silu"
    value = raw.get("hidden_activation") or raw.get("hidden_act") or default
    act = _ACTIVATION_ALIASES.get(value, value)
    if act not in FFN_ACTIVATIONS:
        raise ConfigError(f"hidden_act={value!r} is not an FFN activation popjax runs; supported: {list(FFN_ACTIVATIONS)}")
    return act


def layer_types(value: Any, n_layers: int) -> tuple[str, ...] | None:
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


def raw_layer_types(raw: Mapping[str, Any]) -> Any:
    """``layer_types``, or for a Gemma 3 config that predates it, the pattern HF derives from
    ``sliding_window_pattern`` (every n-th layer full, the others sliding)."""
    if raw.get("layer_types") is not None or raw.get("model_type") != "gemma3_text":
        return raw.get("layer_types")
    n, period = int(raw["num_hidden_layers"]), int(raw.get("sliding_window_pattern", 6))
    return ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(n)]


def sliding_window(raw: Mapping[str, Any]) -> int | None:
    """``sliding_window`` (an int ≥ 1) when some layer slides, else None (the field is then unused)."""
    kinds = raw_layer_types(raw)
    if not (isinstance(kinds, (list, tuple)) and "sliding_attention" in kinds):
        return None
    value = raw.get("sliding_window")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"sliding_window={value!r} is invalid: sliding-window layers need a window of at least 1 position")
    return value


def weight_format(value: Any) -> str:
    if value not in WEIGHT_FORMATS:
        raise ConfigError(f"popjax_weights={value!r} is not a weight format popjax reads: {list(WEIGHT_FORMATS)}")
    return value


def as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def layer_widths(value: Any, n_layers: int) -> tuple[int, ...] | None:
    """``intermediate_sizes``: None, or one positive int per layer."""
    if value is None:
        return None
    widths = tuple(value) if isinstance(value, (list, tuple)) else ()
    if len(widths) != n_layers or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in widths):
        raise ConfigError(
            f"intermediate_sizes={value!r} is invalid: give one integer ≥ 1 per layer ({n_layers} layers)"
        )
    return widths


def rope_block(raw: Mapping[str, Any], kind: str = "full_attention") -> Mapping[str, Any]:
    """The rope block of layers of ``kind``: `rope_scaling` (transformers 4.x) or
    `rope_parameters` (5.x), which may hold one block per layer type (Gemma 3)."""
    block = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if any(k in block for k in LAYER_TYPES):
        block = block.get(kind) or {}
    return block


def rope_theta(raw: Mapping[str, Any]) -> float:
    return raw.get("rope_theta") or rope_block(raw).get("rope_theta") or 10000.0


def local_rope_theta(raw: Mapping[str, Any]) -> float | None:
    """The sliding layers' RoPE base: Gemma 3's `rope_local_base_freq` (4.x) or the
    "sliding_attention" block of `rope_parameters` (5.x)."""
    value = raw.get("rope_local_base_freq")
    if value is None and raw.get("model_type") == "gemma3_text":
        value = rope_block(raw, "sliding_attention").get("rope_theta", 10000.0)
    return float_or_none(value)


def rope_scaling(raw: Mapping[str, Any]) -> RopeScaling:
    """Reads `rope_scaling` (transformers 4.x) or `rope_parameters` (5.x)."""
    block = rope_block(raw)
    rope_type = block.get("rope_type") or block.get("type") or "default"
    allowed = {f.name for f in dataclasses.fields(RopeScaling)}
    kwargs = {k: block[k] for k in allowed if k in block and k != "rope_type"}
    return RopeScaling(rope_type=str(rope_type), **kwargs)
