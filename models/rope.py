"""Rotary position embeddings in the HF half-split convention, with a registry by ``rope_type``.

Inverse frequencies are computed once per config in NumPy float32 (as transformers does);
angles are formed in fp32 at HIGHEST precision so long positions stay exact.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .config import ConfigError, ModelConfig
from .mrope import mrope_cos_sin

InvFreqFn = Callable[[ModelConfig], np.ndarray]
_ROPE_REGISTRY: dict[str, InvFreqFn] = {}


def register_rope(name: str) -> Callable[[InvFreqFn], InvFreqFn]:
    """Registers an inverse-frequency function for HF ``rope_type == name``."""

    def wrap(fn: InvFreqFn) -> InvFreqFn:
        _ROPE_REGISTRY[name] = fn
        return fn

    return wrap


@register_rope("default")
def _default_inv_freq(cfg: ModelConfig) -> np.ndarray:
    dim = cfg.head_dim
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return (np.float32(1.0) / (np.float32(cfg.rope_theta) ** exponents)).astype(np.float32)


@register_rope("linear")
def _linear_inv_freq(cfg: ModelConfig) -> np.ndarray:
    return (_default_inv_freq(cfg) / np.float32(cfg.rope_scaling.factor)).astype(np.float32)


@register_rope("llama3")
def _llama3_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """LLaMA-3.1 frequency-dependent scaling (long wavelengths divided by `factor`)."""
    s = cfg.rope_scaling
    inv_freq = _default_inv_freq(cfg)
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / np.float32(s.factor), inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / np.float32(s.factor) + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def supported_rope_types() -> list[str]:
    return sorted(_ROPE_REGISTRY)


def check_rope_type(cfg: ModelConfig) -> None:
    if cfg.rope_scaling.rope_type not in _ROPE_REGISTRY:
        raise ConfigError(
            f"unsupported rope_type={cfg.rope_scaling.rope_type!r}; supported: {supported_rope_types()}"
        )


@functools.lru_cache(maxsize=None)
def inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    """[h/2] float32 inverse frequencies for this config."""
    check_rope_type(cfg)
    return _ROPE_REGISTRY[cfg.rope_scaling.rope_type](cfg)


@functools.lru_cache(maxsize=None)
def local_inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    """[h/2] float32 inverse frequencies of the sliding-window layers: the default rope with
    base ``rope_local_theta`` (Gemma 3's local base), or the global ones when it is unset."""
    if cfg.rope_local_theta is None:
        return inverse_frequencies(cfg)
    exponents = np.arange(0, cfg.head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(cfg.head_dim)
    return (np.float32(1.0) / (np.float32(cfg.rope_local_theta) ** exponents)).astype(np.float32)


def rope_cos_sin(cfg: ModelConfig, positions: jax.Array, layer_type: str = "full_attention") -> tuple[jax.Array, jax.Array]:
    """positions [B, T] int -> cos, sin [B, T, h] fp32 (half-split: the angles repeated twice)
    for layers of ``layer_type`` (``ModelConfig.layer_type(i)``: sliding layers may have their
    own base)."""
    freqs = local_inverse_frequencies(cfg) if layer_type == "sliding_attention" else inverse_frequencies(cfg)
    inv_freq = jnp.asarray(freqs)
    angles = jnp.einsum(
        "bt,k->btk", positions.astype(jnp.float32), inv_freq, precision=jax.lax.Precision.HIGHEST
    )
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def layer_rope(cfg: ModelConfig, positions: jax.Array) -> dict[str, tuple[jax.Array, jax.Array]]:
    """positions [B, T] (or M-RoPE's [3, B, T] in a VLM's prefill) -> cos, sin [B, T, h] for each
    attention kind the model has ({layer type: (cos, sin)})."""
    if positions.ndim == 3:
        if cfg.mrope_section is None:
            raise ConfigError(f"positions of shape {positions.shape} are M-RoPE's, and {cfg.model_type} has no mrope_section")
        return {"full_attention": mrope_cos_sin(inverse_frequencies(cfg), positions, cfg.mrope_section, cfg.mrope_interleaved)}
    kinds = sorted({cfg.layer_type(i) for i in range(cfg.num_hidden_layers)})
    return {kind: rope_cos_sin(cfg, positions, kind) for kind in kinds}


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, n, h]; cos/sin [B, T, h]. Rotation `x·cos + rotate_half(x)·sin` in fp32."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    out = xf * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)
