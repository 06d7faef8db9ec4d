"""Building blocks of the decoder: RMSNorm, grouped-query attention with a KV cache, MLP weights.

Weights keep the HF/PyTorch ``[out, in]`` layout and are applied as ``einsum("...i,oi->...o")``:
on CPU, XLA's dot-product-form GEMV streams contiguous rows and measured 1.3–1.7× the
bandwidth of the ``[in, out]`` form for this model's matrix sizes (see docs/performance.md).
q/k/v and gate/up are fused into one array each, so a decode step runs fewer, larger dots.

A FFN channel j is ``gate_up[0, j]`` (gate) and ``gate_up[1, j]`` (up) of ``gate_up`` ([2, f, d]:
gate and up stacked on a leading axis, so splitting f over a mesh gives every device matching gate
and up rows) and column j of ``down`` ([d, f]).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from .config import ModelConfig
from .attention import cached_attention, causal_attention
from .rope import apply_rope


class Derived(nnx.Variable):
    """A per-model constant computed from the weights (never saved in the checkpoint cache)."""


def _param(shape: tuple[int, ...], dtype: jnp.dtype) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype))


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] with w [out, in] -> [..., out]."""
    return jnp.einsum("...i,oi->...o", x, w)


class RMSNorm(nnx.Module):
    """RMSNorm as in transformers: normalise in fp32, cast back, then scale."""

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * xf.astype(x.dtype)


class KVCache(NamedTuple):
    """One layer's cache: k, v [B, S, n_kv, h]."""

    k: jax.Array
    v: jax.Array


class Attention(nnx.Module):
    """Grouped-query attention; q is reshaped to (kv_heads, group) so K/V are never repeated."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype):
        d = cfg.hidden_size
        self.cfg = cfg
        self.qkv = _param((cfg.q_dim + 2 * cfg.kv_dim, d), dtype)  # q, k, v rows stacked
        self.o = _param((d, cfg.q_dim), dtype)
        if cfg.qkv_bias:
            self.qkv_bias = _param((cfg.q_dim + 2 * cfg.kv_dim,), dtype)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)

    def _project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, T, d] -> q [B, T, n_q, h], k, v [B, T, n_kv, h]."""
        cfg = self.cfg
        qkv = linear(x, self.qkv[...])
        if cfg.qkv_bias:
            qkv = qkv + self.qkv_bias[...]
        q, k, v = jnp.split(qkv, [cfg.q_dim, cfg.q_dim + cfg.kv_dim], axis=-1)
        shape = (*x.shape[:2], -1, cfg.head_dim)
        return q.reshape(shape), k.reshape(shape), v.reshape(shape)

    def project_kv(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, weights: jax.Array | None = None, bias: jax.Array | None = None
    ) -> KVCache:
        """Keys and values alone (RoPE'd keys), x [B, T, d] -> KVCache [B, T, n_kv, h]: what a
        layer skipped in prefill still writes (Prefill-Only Pruning's independent KV projection).

        ``weights`` [2·kv_dim, d] (k rows, then v rows) replace the k/v rows of ``qkv`` and
        ``bias`` [2·kv_dim] those of ``qkv_bias`` (calibrated projections, popjax.kv_calibration)."""
        cfg = self.cfg
        w = self.qkv[...][cfg.q_dim :] if weights is None else weights
        kv = linear(x, w)
        if cfg.qkv_bias:
            kv = kv + (self.qkv_bias[...][cfg.q_dim :] if bias is None else bias)
        k, v = jnp.split(kv, 2, axis=-1)
        shape = (*x.shape[:2], -1, cfg.head_dim)
        k, v = k.reshape(shape), v.reshape(shape)
        if cfg.qk_norm:
            k = self.k_norm(k)
        return KVCache(apply_rope(k, cos, sin), v)

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        key_valid: jax.Array,
        cache: KVCache | None,
        write_index: jax.Array | int,
    ) -> tuple[jax.Array, KVCache]:
        """x [B, T, d]; cos/sin [B, T, h]; key_valid [B, S] (S = cache slots, or T without cache).

        Without a cache (prefill/forward) the T fresh keys are attended causally and returned as
        the new cache entries. With a cache, the fresh keys are written at ``write_index`` and the
        queries attend to every valid slot up to their own, reading only written blocks.
        """
        cfg = self.cfg
        q, k, v = self._project(x)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is None:
            out, new_cache = causal_attention(q, k, v, key_valid), KVCache(k, v)
        else:
            keys = jax.lax.dynamic_update_slice_in_dim(cache.k, k, write_index, axis=1)
            values = jax.lax.dynamic_update_slice_in_dim(cache.v, v, write_index, axis=1)
            new_cache = KVCache(keys, values)
            out = cached_attention(q, keys, values, key_valid, write_index)
        return linear(out.reshape(*x.shape[:2], cfg.q_dim), self.o[...]), new_cache


class MLPWeights(nnx.Module):
    """Weights of the gated MLP. The computation lives in the pruning method, a pure function
    of ``(weights, partition_state, x)``; see ``popjax.methods``."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, layer: int | None = None):
        """``layer`` picks this layer's width in a pruned model with per-layer widths."""
        d, f = cfg.hidden_size, cfg.ffn_width(layer)
        self.gate_up = _param((2, f, d), dtype)  # [gate; up] on a leading axis
        self.down = _param((d, f), dtype)
        if cfg.down_proj_bias:  # FLAP's bias compensation (popjax.pruned)
            self.down_bias = _param((d,), dtype)
        # ‖W_d[:, j]‖₂ per channel (SPEC §2): a per-model constant, filled in by `finalize`.
        self.down_norm = Derived(jnp.zeros((f,), jnp.float32))

    def finalize(self) -> None:
        down = self.down[...].astype(jnp.float32)
        self.down_norm[...] = jnp.sqrt(jnp.sum(down * down, axis=0))

    def as_dict(self) -> dict[str, jax.Array]:
        """gate_up [2, f, d]; down [d, f]; down_norm [f] fp32; down_bias [d] when the model has one."""
        out = {"gate_up": self.gate_up[...], "down": self.down[...], "down_norm": self.down_norm[...]}
        if hasattr(self, "down_bias"):
            out["down_bias"] = self.down_bias[...]
        return out
