"""Attention kernels in pure JAX whose cost follows the sequence, not the buffer.

* ``causal_attention`` (prefill): the T prompt tokens attend to each other causally. Up to
  ``PREFILL_BLOCK`` tokens it is one einsum; beyond, a flash-style loop over query blocks × key
  blocks with an online softmax, so no ``[T, T]`` score tensor exists and key blocks above the
  diagonal are skipped (``lax.cond``: half the work of the full product). It stays
  reverse-differentiable (scan + cond, no dynamic trip count), which the layer-importance
  analysis needs.
* ``cached_attention`` (decode, teacher forcing): a few new queries attend to the KV cache, read
  in blocks of ``KV_BLOCK`` slots only up to the last written slot (a ``fori_loop`` with a
  dynamic trip count), so a cache sized for 4096 new tokens costs what the current length needs.

GQA everywhere: q is reshaped to ``(kv_heads, group)``; K/V are never repeated. Scores and the
softmax run in fp32. Masked scores are a finite ``MASKED`` so a fully masked (padding) row gives
a finite, unused output instead of NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASKED = -1e30
PREFILL_BLOCK = 512  # query/key block of the flash prefill (prompt buckets are powers of two)
KV_BLOCK = 256  # cache slots read per decode-attention block


def cache_slots(prompt_slots: int, capacity: int) -> int:
    """Cache length for a prompt bucket plus ``capacity`` new tokens: rounded up to a multiple
    of ``KV_BLOCK`` once it exceeds one block, so decode blocks tile the cache exactly."""
    slots = prompt_slots + capacity
    return slots if slots <= KV_BLOCK else -(-slots // KV_BLOCK) * KV_BLOCK


def group_queries(q: jax.Array, n_kv: int) -> jax.Array:
    """q [B, T, n_q, h] -> [B, T, n_kv, group, h]."""
    B, T, n_q, h = q.shape
    return q.reshape(B, T, n_kv, n_q // n_kv, h)


def attention_scores(qg: jax.Array, k: jax.Array) -> jax.Array:
    """qg [B, T, kv, g, h], k [B, S, kv, h] -> fp32 scaled scores [B, kv, g, T, S]."""
    s = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32)
    return s * (qg.shape[-1] ** -0.5)


def online_softmax_update(carry, scores, v):
    """One block of the online softmax: carry (m, l [B,kv,g,T], acc [B,kv,g,T,h] fp32),
    masked scores [B,kv,g,T,s], v [B,s,kv,h]."""
    m, l, acc = carry
    m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
    p = jnp.exp(scores - m_new[..., None])
    correction = jnp.exp(m - m_new)
    l = l * correction + jnp.sum(p, axis=-1)
    pv = jnp.einsum("bkgts,bskh->bkgth", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m_new, l, acc * correction[..., None] + pv


def init_softmax_carry(B, n_kv, g, T, h):
    return (
        jnp.full((B, n_kv, g, T), MASKED, jnp.float32),
        jnp.zeros((B, n_kv, g, T), jnp.float32),
        jnp.zeros((B, n_kv, g, T, h), jnp.float32),
    )


def finish_softmax(carry, dtype) -> jax.Array:
    """-> [B, T, kv, g, h] in ``dtype``."""
    _, l, acc = carry
    return jnp.transpose(acc / l[..., None], (0, 3, 1, 2, 4)).astype(dtype)


def _direct(qg, k, v, mask) -> jax.Array:
    """Full softmax: mask [B, T, S] -> [B, T, kv, g, h]."""
    scores = jnp.where(mask[:, None, None], attention_scores(qg, k), MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bskh->btkgh", probs, v)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, key_valid: jax.Array) -> jax.Array:
    """Prefill attention. q [B, T, n_q, h]; k, v [B, T, n_kv, h]; key_valid [B, T] ->
    [B, T, n_q, h]. Query t attends to valid keys s ≤ t."""
    B, T, n_q, h = q.shape
    n_kv = k.shape[2]
    qg = group_queries(q, n_kv)
    slot = jnp.arange(T)
    if T <= PREFILL_BLOCK or T % PREFILL_BLOCK:
        mask = key_valid[:, None, :] & (slot[None, None, :] <= slot[None, :, None])
        return _direct(qg, k, v, mask).reshape(B, T, n_q, h)
    bs, nb = PREFILL_BLOCK, T // PREFILL_BLOCK
    g = n_q // n_kv

    def query_block(i):
        q_i = jax.lax.dynamic_slice_in_dim(qg, i * bs, bs, axis=1)
        q_slot = i * bs + jnp.arange(bs)

        def key_block(carry, j):
            def attend(carry):
                k_j = jax.lax.dynamic_slice_in_dim(k, j * bs, bs, axis=1)
                v_j = jax.lax.dynamic_slice_in_dim(v, j * bs, bs, axis=1)
                valid_j = jax.lax.dynamic_slice_in_dim(key_valid, j * bs, bs, axis=1)
                k_slot = j * bs + jnp.arange(bs)
                mask = valid_j[:, None, :] & (k_slot[None, None, :] <= q_slot[None, :, None])
                scores = jnp.where(mask[:, None, None], attention_scores(q_i, k_j), MASKED)
                return online_softmax_update(carry, scores, v_j)

            # blocks above the diagonal are all masked: skip their work entirely
            return jax.lax.cond(j <= i, attend, lambda c: c, carry), None

        carry, _ = jax.lax.scan(key_block, init_softmax_carry(B, n_kv, g, bs, h), jnp.arange(nb))
        return finish_softmax(carry, v.dtype)

    blocks = jax.lax.map(query_block, jnp.arange(nb))  # [nb, B, bs, kv, g, h]
    return jnp.moveaxis(blocks, 0, 1).reshape(B, T, n_q, h)


def cached_attention(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, key_valid: jax.Array, write_index: jax.Array
) -> jax.Array:
    """Decode attention over a cache. q [B, T, n_q, h] for the tokens just written at slots
    ``write_index .. write_index + T − 1``; k_cache, v_cache [B, S, n_kv, h]; key_valid [B, S]
    -> [B, T, n_q, h]. Only the ``ceil((write_index + T) / block)`` blocks holding written
    slots are read."""
    B, T, n_q, h = q.shape
    S, n_kv = k_cache.shape[1], k_cache.shape[2]
    qg = group_queries(q, n_kv)
    bs = min(KV_BLOCK, S)
    if S % bs:
        raise ValueError(f"cache of {S} slots is not a multiple of the {bs}-slot block; size it with cache_slots()")
    q_slot = write_index + jnp.arange(T)

    def key_block(j, carry):
        k_j = jax.lax.dynamic_slice_in_dim(k_cache, j * bs, bs, axis=1)
        v_j = jax.lax.dynamic_slice_in_dim(v_cache, j * bs, bs, axis=1)
        valid_j = jax.lax.dynamic_slice_in_dim(key_valid, j * bs, bs, axis=1)
        k_slot = j * bs + jnp.arange(bs)
        mask = valid_j[:, None, :] & (k_slot[None, None, :] <= q_slot[None, :, None])
        scores = jnp.where(mask[:, None, None], attention_scores(qg, k_j), MASKED)
        return online_softmax_update(carry, scores, v_j)

    n_blocks = (write_index + T + bs - 1) // bs
    carry = jax.lax.fori_loop(0, n_blocks, key_block, init_softmax_carry(B, n_kv, n_q // n_kv, T, h))
    return finish_softmax(carry, v_cache.dtype).reshape(B, T, n_q, h)
