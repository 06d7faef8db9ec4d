"""Attention of one layer of a scanned model over the stacked caches of all layers
(models/scan.py): the layer reads its earlier slots block by block straight from the stack, at
(layer, block) — slicing a layer out first would copy it — and attends to its fresh keys/values
directly; `write_slots` then writes every layer's fresh slots after the scan, in one update.

Shapes: L layers (L_f full, L_s sliding), B batch, T tokens fed, S cache slots, R ring slots,
n_q / n_kv query / key-value heads, h head dim, d hidden.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .attention import (KV_BLOCK, MASKED, attend_blocks, attention_scores, finish_softmax, group_queries, init_softmax_carry,
                        online_softmax_update, ring_attention, ring_write)
from .config import ModelConfig
from .decoder import DecoderLayer
from .layers import KVCache, linear


class KindCaches(NamedTuple):
    """A scanned model's caches when it has sliding-window layers: the full layers' k, v
    [L_f, B, S, n_kv, h] and the sliding layers' rings [L_s, B, R, n_kv, h] (in layer order)."""

    full: KVCache
    sliding: KVCache



def stacked_cache_attention(layer: DecoderLayer, x, cos, sin, key_valid, caches, index, write_index, kind):
    """``Attention.__call__``'s cached path for layer ``index`` of stacked caches (read only):
    x [B, T, d] -> (out [B, T, d] after the layer's post-attention norm, if any; this layer's
    fresh KVCache [B, T, n_kv, h] for ``write_slots``). With layer kinds (``kind``), a
    ``lax.cond`` reads the layer's own stack: the full layers' cache or the sliding layers' rings."""
    attn = layer.attn
    q, k, v = attn.rotated_qkv(x, cos, sin)
    dtype = (caches.k if isinstance(caches, KVCache) else caches.sliding.k).dtype
    k, v = k.astype(dtype), v.astype(dtype)
    if kind is None:
        out = layer_cached_attention(q, k, v, caches, index, key_valid, write_index, attn.scale)
    else:
        full = lambda: layer_cached_attention(q, k, v, caches.full, kind.ordinal, key_valid, write_index, attn.scale)
        ring = lambda: layer_ring_attention(q, k, v, caches.sliding, kind, key_valid, write_index, attn.scale)
        out = jax.lax.cond(kind.sliding, ring, full) if layer.cfg.full_layers else ring()
    out = linear(out.reshape(*x.shape[:2], attn.cfg.q_dim), attn.weight("o"))
    if layer.cfg.sandwich_norms:
        out = layer.attn_post_norm(out)
    return out, KVCache(k, v)


def layer_ring_attention(q, k, v, rings: KVCache, kind, key_valid, write_index, scale) -> jax.Array:
    """`models.attention.ring_attention` for the sliding layer at ``kind.ordinal`` of stacked rings
    k, v [L_s, B, R, n_kv, h], read block by block straight from the stack."""
    B, R = rings.k.shape[1], rings.k.shape[2]
    zero = jnp.int32(0)

    def read(start, size):
        at = (kind.ordinal, zero, jnp.asarray(start, jnp.int32), zero, zero)
        shape = (1, B, size, *rings.k.shape[3:])
        return jax.lax.dynamic_slice(rings.k, at, shape)[0], jax.lax.dynamic_slice(rings.v, at, shape)[0]

    return ring_attention(q, k, v, read, R, key_valid, write_index, kind.window, scale)


def write_slots(cfg: ModelConfig, caches, fresh: KVCache, write_index):
    """Writes every layer's fresh keys/values k, v [L, B, T, n_kv, h] into the stacked cache at
    slot ``write_index`` with one ``dynamic_update_slice`` per array (in place on a donated
    cache); with layer kinds, the full layers' rows at ``write_index`` and the sliding layers'
    into their rings at ``write_index mod R``. Writing inside the scan, into a cache the same
    layer reads, made XLA copy the whole stacked cache in every layer of every step (seen in the
    compiled HLO); read-only inside the scan and written once after it, the cache is never copied."""
    zero = jnp.int32(0)
    at = (zero, zero, jnp.asarray(write_index, jnp.int32), zero, zero)
    write = lambda c, f: KVCache(jax.lax.dynamic_update_slice(c.k, f.k, at), jax.lax.dynamic_update_slice(c.v, f.v, at))
    if isinstance(caches, KVCache):
        return write(caches, fresh)
    rows = lambda idx: KVCache(fresh.k[np.array(idx, np.int32)], fresh.v[np.array(idx, np.int32)])
    full = write(caches.full, rows(cfg.full_layers)) if cfg.full_layers else caches.full
    sliding = rows(cfg.sliding_layers)
    rings = KVCache(ring_write(caches.sliding.k, sliding.k, write_index, axis=2),
                    ring_write(caches.sliding.v, sliding.v, write_index, axis=2))
    return KindCaches(full, rings)


def layer_cached_attention(q, k, v, cache: KVCache, layer, key_valid, write_index, scale=None) -> jax.Array:
    """``models.attention.cached_attention`` for layer ``layer`` of a stacked cache k, v
    [L, B, S, n_kv, h]: q, k, v [B, T, ·, h] of the T tokens at slots ``write_index ..`` ->
    [B, T, n_q, h]. The earlier slots are read block by block straight from the stacked buffer,
    at (layer, block) (slicing the layer out first would copy it); the T fresh keys/values come
    from k, v, which are not in the cache yet (``write_slots``)."""
    B, T, n_q, h = q.shape
    S, n_kv = cache.k.shape[2], cache.k.shape[3]
    qg = group_queries(q, n_kv)
    bs = min(KV_BLOCK, S)
    if S % bs:
        raise ValueError(f"cache of {S} slots is not a multiple of the {bs}-slot block; size it with cache_slots()")
    layer = jnp.asarray(layer, jnp.int32)
    zero = jnp.int32(0)

    def key_block(j, carry):
        at = (layer, zero, (j * bs).astype(jnp.int32), zero, zero)
        k_j = jax.lax.dynamic_slice(cache.k, at, (1, B, bs, n_kv, h))[0]
        v_j = jax.lax.dynamic_slice(cache.v, at, (1, B, bs, n_kv, h))[0]
        valid_j = jax.lax.dynamic_slice_in_dim(key_valid, j * bs, bs, axis=1)
        mask = valid_j & (j * bs + jnp.arange(bs) < write_index)[None]  # [B, bs]: earlier slots only
        scores = jnp.where(mask[:, None, None, None], attention_scores(qg, k_j, scale), MASKED)
        return online_softmax_update(carry, scores, v_j)

    carry = attend_blocks(key_block, init_softmax_carry(B, n_kv, n_q // n_kv, T, h), (write_index + bs - 1) // bs, S // bs)
    fresh_valid = jax.lax.dynamic_slice_in_dim(key_valid, write_index, T, axis=1)  # [B, T]
    causal = jnp.arange(T)[None, :] <= jnp.arange(T)[:, None]  # [T query, T key]
    mask = fresh_valid[:, None, :] & causal[None]  # [B, T, T]
    scores = jnp.where(mask[:, None, None], attention_scores(qg, k, scale), MASKED)
    carry = online_softmax_update(carry, scores, v)
    return finish_softmax(carry, cache.v.dtype).reshape(B, T, n_q, h)
