"""Attention kernels in pure JAX whose cost follows the sequence, not the buffer; every layer
(unrolled or scanned, full or sliding) runs these, and only these.

* ``causal_attention`` (prefill): the T prompt tokens attend to each other causally. Up to
  ``PREFILL_BLOCK`` tokens it is one einsum; beyond, a flash-style loop over query blocks × key
  blocks with an online softmax, so no ``[T, T]`` score tensor exists and key blocks above the
  diagonal are skipped (``lax.cond``: half the work of the full product). It stays
  reverse-differentiable (scan + cond, no dynamic trip count), which the layer-importance
  analysis needs.
* ``cached_attention`` (decode, teacher forcing): a few new queries attend to a cache read
  block by block through a reader (`cache_reader`: a layer's own cache, or one layer of a
  scanned model's stacked caches, read in place), in blocks of ``KV_BLOCK`` slots only up to the
  last written slot (a ``fori_loop`` with a dynamic trip count), then to their own fresh
  keys/values; the caller writes those after. A cache sized for 4096 new tokens costs what the
  current length needs. The same kernel reads a sliding-window layer's ring buffer of
  ``ring_slots(window, S)`` slots — index c lives in slot c mod R — so its cache and its decode
  attention cost the window, whatever the context (`ring_write` then writes the fresh entries
  over the oldest ones; correct for any number of new tokens).

Sliding windows: a query at index i attends to keys c with i − window < c ≤ i (HF's
``sliding_window``, the query itself included). Prefill applies the same mask and its flash loop
skips key blocks the window excludes as well as those above the diagonal.

GQA everywhere: q is reshaped to ``(kv_heads, group)``; K/V are never repeated. Scores and the
softmax run in fp32. Masked scores are a finite ``MASKED`` so a fully masked (padding) row gives
a finite, unused output instead of NaN.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

MASKED = -1e30
PREFILL_BLOCK = 512  # query/key block of the flash prefill (prompt buckets are powers of two)
KV_BLOCK = 256  # cache slots read per decode-attention block


NO_WINDOW = 2**30  # a window no sequence reaches: a full layer's, where a window must be an array (scanned layers)


def ring_slots(window: int, slots: int) -> int:
    """Ring-buffer slots of a sliding-window layer in a cache of ``slots`` slots (`cache_slots`):
    the window, rounded up to a multiple of ``KV_BLOCK`` once it exceeds one block (decode reads
    whole blocks), and never more than the cache itself (a short sequence never wraps)."""
    ring = window if window <= KV_BLOCK else -(-window // KV_BLOCK) * KV_BLOCK
    return min(ring, slots)


def cache_slots(prompt_slots: int, capacity: int) -> int:
    """Cache length for a prompt bucket plus ``capacity`` new tokens: rounded up to a multiple
    of ``KV_BLOCK`` once it exceeds one block, so decode blocks tile the cache exactly."""
    slots = prompt_slots + capacity
    return slots if slots <= KV_BLOCK else -(-slots // KV_BLOCK) * KV_BLOCK


def group_queries(q: jax.Array, n_kv: int) -> jax.Array:
    """q [B, T, n_q, h] -> [B, T, n_kv, group, h]."""
    B, T, n_q, h = q.shape
    return q.reshape(B, T, n_kv, n_q // n_kv, h)


def attention_scores(qg: jax.Array, k: jax.Array, scale: float | None = None) -> jax.Array:
    """qg [B, T, kv, g, h], k [B, S, kv, h] -> fp32 scores [B, kv, g, T, S] scaled by ``scale``
    (default h^-½; `ModelConfig.attention_scale`)."""
    s = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32)
    return s * (qg.shape[-1] ** -0.5 if scale is None else scale)


def in_window(q_index: jax.Array, k_index: jax.Array, window) -> jax.Array:
    """Causal and within the window: k ≤ q and q − k < window (``window`` None: no window; an int
    or a traced int32). Broadcasts q_index against k_index."""
    causal = k_index <= q_index
    return causal if window is None else causal & (q_index - k_index < window)


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


def _direct(qg, k, v, mask, scale=None) -> jax.Array:
    """Full softmax: mask [B, T, S] -> [B, T, kv, g, h]."""
    scores = jnp.where(mask[:, None, None], attention_scores(qg, k, scale), MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bskh->btkgh", probs, v)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, key_valid: jax.Array, scale: float | None = None,
                     window=None) -> jax.Array:
    """Prefill attention. q [B, T, n_q, h]; k, v [B, T, n_kv, h]; key_valid [B, T] ->
    [B, T, n_q, h]. Query t attends to valid keys s ≤ t (and t − s < ``window`` when given)."""
    B, T, n_q, h = q.shape
    n_kv = k.shape[2]
    qg = group_queries(q, n_kv)
    slot = jnp.arange(T)
    if T <= PREFILL_BLOCK or T % PREFILL_BLOCK:
        mask = key_valid[:, None, :] & in_window(slot[None, :, None], slot[None, None, :], window)
        return _direct(qg, k, v, mask, scale).reshape(B, T, n_q, h)
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
                mask = valid_j[:, None, :] & in_window(q_slot[None, :, None], k_slot[None, None, :], window)
                scores = jnp.where(mask[:, None, None], attention_scores(q_i, k_j, scale), MASKED)
                return online_softmax_update(carry, scores, v_j)

            # blocks above the diagonal, and those wholly before the window of every query of
            # block i (their last key j·bs + bs − 1 ≤ i·bs − window), are all masked: skip their work
            needed = j <= i
            if window is not None:
                needed = needed & ((j + 1) * bs - 1 > i * bs - window)
            return jax.lax.cond(needed, attend, lambda c: c, carry), None

        carry, _ = jax.lax.scan(key_block, init_softmax_carry(B, n_kv, g, bs, h), jnp.arange(nb))
        return finish_softmax(carry, v.dtype)

    blocks = jax.lax.map(query_block, jnp.arange(nb))  # [nb, B, bs, kv, g, h]
    return jnp.moveaxis(blocks, 0, 1).reshape(B, T, n_q, h)


def attend_blocks(key_block, carry, reader: CacheReader, n_blocks, blocks: int):
    """``key_block(j, carry, reader)`` over the first ``n_blocks`` (traced) of a cache's
    ``blocks`` (static) key blocks -> (carry, reader). The reader rides in the loop's carry and
    comes back out, unchanged: a caller that then writes the cache writes the loop's own output,
    which XLA updates in place. Closing over the cache instead, and writing the cache the loop
    had read, made XLA copy the whole cache twice per layer and step (the decode step's bytes grew
    with the capacity; tests/engine/test_capacity.py reads the compiled HLO for it). A one-block
    cache runs its block without a loop, whose per-layer overhead is most of a short cache's
    attention; were that block not yet written, it is all masked, and the always-unmasked fresh
    tokens' block rescales it away."""
    if blocks == 1:
        return key_block(jnp.int32(0), carry, reader), reader
    body = lambda j, loop: (key_block(j, loop[0], loop[1]), loop[1])
    return jax.lax.fori_loop(0, n_blocks, body, (carry, reader))


# ------------------------------------------------------------------ sliding-window ring buffers


def ring_from_prompt(fresh: jax.Array, prompt_slots: int, ring: int) -> jax.Array:
    """A sliding layer's prompt keys (or values) -> its ring buffer: fresh [B, n, kv, h] holds
    the last n of ``prompt_slots`` prompt indices (n ≤ prompt_slots: a layer may project only
    the last window of the prompt); index c lands in slot c mod ``ring`` -> [B, ring, kv, h]."""
    n = fresh.shape[1]
    keep = min(n, ring)  # older entries fall out of every later window
    index = np.arange(prompt_slots - keep, prompt_slots) % ring
    out = jnp.zeros((fresh.shape[0], ring, *fresh.shape[2:]), fresh.dtype)
    return out.at[:, index].set(fresh[:, n - keep:])


def ring_write(ring: jax.Array, fresh: jax.Array, write_index: jax.Array, axis: int = 1) -> jax.Array:
    """Writes fresh [B, T, kv, h] (indices write_index ..) into ring [B, R, kv, h] at slots
    index mod R (``axis``: the slot axis, 2 for a scanned model's [L, B, R, kv, h]). One token
    (decode): a dynamic_update_slice, in place on a donated cache."""
    R, T = ring.shape[axis], fresh.shape[axis]
    if T == 1:
        return jax.lax.dynamic_update_slice_in_dim(ring, fresh.astype(ring.dtype), write_index % R, axis=axis)
    keep = min(T, R)
    slots = (write_index + jnp.arange(T - keep, T)) % R
    lead = (slice(None),) * axis
    return ring.at[(*lead, slots)].set(fresh[(*lead, slice(T - keep, T))].astype(ring.dtype))


class CacheReader(NamedTuple):
    """A block reader over a cache k, v [..., B, S, n_kv, h]: ``read(start, size)`` -> (k, v)
    [B, size, n_kv, h]. ``at`` fixes the leading indices (a scanned model's stacked [L, B, S, ...]
    cache: ``at=(layer,)``, read straight from the stack: slicing a layer out first would copy it).
    A pytree, so `cached_attention` carries it through its block loop and hands it back."""

    k: jax.Array
    v: jax.Array
    at: tuple = ()

    def read(self, start, size):
        lead = len(self.at)
        zero = jnp.int32(0)
        index = (*(jnp.asarray(i, jnp.int32) for i in self.at), zero, jnp.asarray(start, jnp.int32), zero, zero)
        shape = (*(1,) * lead, self.k.shape[lead], size, *self.k.shape[lead + 2:])
        k = jax.lax.dynamic_slice(self.k, index, shape)
        v = jax.lax.dynamic_slice(self.v, index, shape)
        return k.reshape(k.shape[lead:]), v.reshape(v.shape[lead:])


def cache_reader(k_cache: jax.Array, v_cache: jax.Array, at: tuple = ()) -> CacheReader:
    """A `CacheReader` over k, v [..., B, S, n_kv, h] at the leading indices ``at``."""
    return CacheReader(k_cache, v_cache, tuple(at))


def cached_attention(q, k, v, reader: CacheReader, slots: int, key_valid, write_index, window=None, scale=None,
                     ring: bool = False, written: bool = False) -> tuple[jax.Array, CacheReader]:
    """Decode attention over a cache, the one kernel every cached layer runs (unrolled or
    scanned, full or sliding). q [B, T, n_q, h], k, v [B, T, n_kv, h] for the T tokens at
    indices ``write_index ..`` (not yet in the cache, or already, with ``written``: then the
    blocks read them too and the fresh k, v are not read again); ``reader`` the cache's `CacheReader`
    (``read(start, size)`` -> (k, v) [B, size, n_kv, h] from slot ``start``); ``slots`` the
    cache's slots S (a sliding layer's ring: R); key_valid [B, S_total] over cache indices ->
    (out [B, T, n_q, h], the reader as the block loop hands it back: write the fresh entries into
    its arrays, not into the ones passed in, so the cache is updated in place).

    Slot s holds index ``held = last − ((last − s) mod slots)`` (last: the last index written,
    write_index − 1, or write_index + T − 1 when ``written``; negative: never written): for a full
    cache (``ring=False``, never wrapped) that is s itself for every written slot. Only the blocks
    holding written slots are read (``min(last + 1, slots)``), then the fresh keys unless they
    were written: a cache sized for 4096 new tokens costs what the current length needs.

    Why ``written`` exists: a layer that owns its cache (an unrolled model) writes the fresh
    entries first and then reads, so the block loop reads the cache the step returns; reading
    first and writing after made XLA copy the whole cache twice per layer and step (the step's
    bytes grew with the capacity; tests/engine/test_capacity.py). A ring can be written first
    only for one token (R ≥ window: the slot it overwrites left every window); more tokens would
    overwrite entries the earlier queries still need."""
    B, T, n_q, h = q.shape
    n_kv = k.shape[2]
    qg = group_queries(q, n_kv)
    bs = min(KV_BLOCK, slots)
    if slots % bs:
        raise ValueError(f"cache of {slots} slots is not a multiple of the {bs}-slot block; size it with cache_slots() or ring_slots()")
    if written and ring and T > 1:
        raise ValueError(f"a ring buffer is written before attention only one token at a time, not {T}: read it first (written=False)")
    end = write_index + (T if written else 0)  # the cache holds indices < end
    last = end - 1
    q_index = write_index + jnp.arange(T)

    def key_block(j, carry, reader):
        k_j, v_j = reader.read(j * bs, bs)
        slot = j * bs + jnp.arange(bs)
        if ring:  # the cache index each slot holds
            held = last - jnp.mod(last - slot, slots)
            valid = (held >= 0)[None] & jnp.take(key_valid, jnp.maximum(held, 0), axis=1)  # [B, bs]
        else:  # a full cache: slot = index, written below end
            held = slot
            valid = jax.lax.dynamic_slice_in_dim(key_valid, j * bs, bs, axis=1) & (slot < end)[None]
        mask = valid[:, None, :] & in_window(q_index[:, None], held[None, :], window)[None]  # [B, T, bs]
        scores = jnp.where(mask[:, None, None], attention_scores(qg, k_j, scale), MASKED)
        return online_softmax_update(carry, scores, v_j)

    n_blocks = (jnp.minimum(end, slots) + bs - 1) // bs
    carry, reader = attend_blocks(key_block, init_softmax_carry(B, n_kv, n_q // n_kv, T, h), reader, n_blocks, slots // bs)
    if written:
        return finish_softmax(carry, v.dtype).reshape(B, T, n_q, h), reader
    fresh_valid = jax.lax.dynamic_slice_in_dim(key_valid, write_index, T, axis=1)  # [B, T]
    t = jnp.arange(T)
    mask = fresh_valid[:, None, :] & in_window(t[:, None], t[None, :], window)[None]  # [B, T, T]
    scores = jnp.where(mask[:, None, None], attention_scores(qg, k, scale), MASKED)
    carry = online_softmax_update(carry, scores, v)
    return finish_softmax(carry, v.dtype).reshape(B, T, n_q, h), reader
