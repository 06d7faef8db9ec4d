"""Building blocks of the decoder: RMSNorm, grouped-query attention with a KV cache, MLP weights.

Weights are stored in ``x @ W`` layout ([in, out]); a FFN channel j is column j of
``gate``/``up`` ([d, f]) and row j of ``down`` ([f, d]), so pruning gathers contiguous rows
of ``down``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from .config import ModelConfig
from .rope import apply_rope

_MASKED = -1e30  # finite, so a fully masked (padding) query row gives a uniform row, not NaN


class Derived(nnx.Variable):
    """A per-model constant computed from the weights (never saved in the checkpoint cache)."""


def _param(shape: tuple[int, ...], dtype: jnp.dtype) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype))


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
        self.q = _param((d, cfg.q_dim), dtype)
        self.k = _param((d, cfg.kv_dim), dtype)
        self.v = _param((d, cfg.kv_dim), dtype)
        self.o = _param((cfg.q_dim, d), dtype)
        if cfg.qkv_bias:
            self.q_bias = _param((cfg.q_dim,), dtype)
            self.k_bias = _param((cfg.kv_dim,), dtype)
            self.v_bias = _param((cfg.kv_dim,), dtype)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)

    def _project(self, x: jax.Array, name: str, heads: int) -> jax.Array:
        y = x @ getattr(self, name)[...]
        if self.cfg.qkv_bias:
            y = y + getattr(self, f"{name}_bias")[...]
        return y.reshape(*x.shape[:2], heads, self.cfg.head_dim)

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
        queries attend to every valid slot up to their own.
        """
        cfg = self.cfg
        q = self._project(x, "q", cfg.num_attention_heads)
        k = self._project(x, "k", cfg.num_key_value_heads)
        v = self._project(x, "v", cfg.num_key_value_heads)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        T = x.shape[1]
        if cache is None:
            keys, values, new_cache = k, v, KVCache(k, v)
            query_slot = jnp.arange(T)
        else:
            keys = jax.lax.dynamic_update_slice_in_dim(cache.k, k, write_index, axis=1)
            values = jax.lax.dynamic_update_slice_in_dim(cache.v, v, write_index, axis=1)
            new_cache = KVCache(keys, values)
            query_slot = write_index + jnp.arange(T)
        key_slot = jnp.arange(keys.shape[1])
        mask = key_valid[:, None, :] & (key_slot[None, None, :] <= query_slot[None, :, None])
        out = _grouped_attention(q, keys, values, mask, cfg.num_key_value_heads)
        return out.reshape(*x.shape[:2], cfg.q_dim) @ self.o[...], new_cache


def _grouped_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, n_kv: int
) -> jax.Array:
    """q [B, T, n_q, h]; k, v [B, S, n_kv, h]; mask [B, T, S] -> [B, T, n_q, h]."""
    B, T, n_q, h = q.shape
    qg = q.reshape(B, T, n_kv, n_q // n_kv, h)
    scores = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (h**-0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v)
    return out.reshape(B, T, n_q, h)


class MLPWeights(nnx.Module):
    """Weights of the gated MLP. The computation lives in the pruning method, a pure function
    of ``(weights, partition_state, x)``; see ``popjax.methods``."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate = _param((d, f), dtype)
        self.up = _param((d, f), dtype)
        self.down = _param((f, d), dtype)
        # ‖W_d[:, j]‖₂ per channel (SPEC §2): a per-model constant, filled in by `finalize`.
        self.down_norm = Derived(jnp.zeros((f,), jnp.float32))

    def finalize(self) -> None:
        down = self.down[...].astype(jnp.float32)
        self.down_norm[...] = jnp.sqrt(jnp.sum(down * down, axis=1))

    def as_dict(self) -> dict[str, jax.Array]:
        """gate, up [d, f]; down [f, d]; down_norm [f] fp32."""
        return {
            "gate": self.gate[...],
            "up": self.up[...],
            "down": self.down[...],
            "down_norm": self.down_norm[...],
        }
