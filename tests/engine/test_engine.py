"""The engine: blockwise attention equals the full softmax, batch buckets and capacity cost no
recompiles and change no result, dead rows stay out of statistics, streaming equals the loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import popjax
from popjax import engine
from popjax.eval.teacher import teacher_forced
from popjax.requests import pad_batch
from popjax.sampling import first_argmax
from popjax.kernels.attention import KV_BLOCK, PREFILL_BLOCK, cache_reader, cache_slots, cached_attention, causal_attention
from tests.conftest import random_prompts

ATOL = 1e-5


def reference_attention(q, k, v, mask):
    """Plain NumPy softmax attention: q [B,T,nq,h], k/v [B,S,nkv,h], mask [B,T,S] bool."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, T, nq, h = q.shape
    group = nq // k.shape[2]
    out = np.zeros_like(q)
    for b in range(B):
        for head in range(nq):
            kv = head // group
            scores = q[b, :, head] @ k[b, :, kv].T / np.sqrt(h)  # [T, S]
            scores = np.where(mask[b], scores, -np.inf)
            for t in range(T):
                if not mask[b, t].any():
                    continue  # a padding query: its output is never used
                p = np.exp(scores[t] - scores[t].max())
                out[b, t, head] = (p / p.sum()) @ v[b, :, kv]
    return out


def _random_qkv(rng, B, T, S, nq=4, nkv=2, h=16):
    q = rng.normal(size=(B, T, nq, h)).astype(np.float32)
    k = rng.normal(size=(B, S, nkv, h)).astype(np.float32)
    v = rng.normal(size=(B, S, nkv, h)).astype(np.float32)
    return q, k, v


def test_flash_prefill_equals_full_softmax_with_left_padding():
    rng = np.random.default_rng(0)
    T = 2 * PREFILL_BLOCK  # two query blocks × two key blocks: the blockwise path
    q, k, v = _random_qkv(rng, 2, T, T)
    key_valid = np.ones((2, T), bool)
    key_valid[1, :700] = False  # a left-padded row whose padding spans a whole block
    got = np.asarray(causal_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(key_valid)))
    causal = np.tril(np.ones((T, T), bool))
    mask = key_valid[:, None, :] & causal[None] & key_valid[:, :, None]
    want = reference_attention(q, k, v, mask)
    rows = key_valid[:, :, None, None] & np.ones_like(got, bool)
    np.testing.assert_allclose(got[rows], want[rows], atol=ATOL, rtol=0)


@pytest.mark.parametrize("write_index,S", [(5, 3 * KV_BLOCK), (KV_BLOCK - 1, 3 * KV_BLOCK), (KV_BLOCK + 37, 3 * KV_BLOCK),
                                           (3 * KV_BLOCK - 2, 3 * KV_BLOCK), (5, 96), (94, 96)])
def test_cached_attention_reads_only_written_blocks_and_equals_full_softmax(write_index, S):
    """Several blocks (a loop over the written ones) and one short block (no loop)."""
    rng = np.random.default_rng(write_index)
    T = 2
    q, k, v = _random_qkv(rng, 2, T, S)
    key_valid = np.ones((2, S), bool)
    key_valid[0, :3] = False  # left padding of the prompt
    # garbage in unwritten slots must not matter; the T fresh keys/values are passed, not read
    fresh_k, fresh_v = jnp.asarray(k[:, write_index : write_index + T]), jnp.asarray(v[:, write_index : write_index + T])
    k_cache, v_cache = k.copy(), v.copy()
    k_cache[:, write_index:] = 1e4
    read = cache_reader(jnp.asarray(k_cache), jnp.asarray(v_cache))
    got, _ = cached_attention(jnp.asarray(q), fresh_k, fresh_v, read, S, jnp.asarray(key_valid), jnp.int32(write_index))
    slots = np.arange(S)
    causal = slots[None, :] <= (write_index + np.arange(T))[:, None]  # [T, S]
    want = reference_attention(q, k, v, key_valid[:, None, :] & causal[None])
    np.testing.assert_allclose(np.asarray(got), want, atol=ATOL, rtol=0)


def test_cache_slots_tile_the_decode_blocks():
    assert cache_slots(32, 64) == 96  # one block: exact
    assert cache_slots(32, 4096) % KV_BLOCK == 0 and cache_slots(32, 4096) >= 4128
    assert cache_slots(2048, 0) == 2048


def test_prefill_at_8192_tokens_holds_no_t_by_t_buffer(tiny_model):
    T = 8192
    plan = popjax.Dense().bind(tiny_model.config)
    tokens = jax.ShapeDtypeStruct((1, T), jnp.int32)
    compiled = engine.prefill.lower(tiny_model.graphdef, tiny_model.params, tokens, tokens, plan).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    t_by_t = T * T * 4 * tiny_model.config.num_attention_heads  # the full fp32 score tensor
    assert temp < t_by_t / 20, (temp, t_by_t)


def test_batch_buckets_compile_once_and_do_not_change_results(tiny_model):
    prompts = random_prompts(np.random.default_rng(3), [4, 9, 12, 7], tiny_model.config.vocab_size)
    four, _ = popjax.generate_ids(tiny_model, prompts, max_new_tokens=6, stop_ids=[])
    before = engine.compile_counts()
    three, _ = popjax.generate_ids(tiny_model, prompts[:3], max_new_tokens=6, stop_ids=[])
    assert engine.compile_counts() == before  # batch 3 pads to the bucket of 4
    assert three == four[:3]


def test_capacity_does_not_change_tokens(tiny_model):
    prompt = random_prompts(np.random.default_rng(4), [10], tiny_model.config.vocab_size)
    short, _ = popjax.generate_ids(tiny_model, prompt, max_new_tokens=20, stop_ids=[])
    long, _ = popjax.generate_ids(tiny_model, prompt, max_new_tokens=200, stop_ids=[])  # 2 KV blocks
    assert long[0][:20] == short[0]


@pytest.mark.parametrize("method", [popjax.POP(ratio=0.3, gamma=0.3), popjax.Dynamic(ratio=0.3)], ids=lambda m: m.name)
def test_dead_rows_stay_out_of_shared_statistics(tiny_model, method):
    """Two prompts alone (bucket 2) and with two dead rows (bucket 4) give identical results."""
    rng = np.random.default_rng(5)
    prompts = random_prompts(rng, [6, 11], tiny_model.config.vocab_size)
    targets = np.asarray(random_prompts(rng, [8, 8], tiny_model.config.vocab_size), np.int32)
    plan = method.bind(tiny_model.config)
    tokens, mask = pad_batch(prompts, 0)
    wide = lambda a: jnp.asarray(np.concatenate([a, np.zeros_like(a)]))  # two dead rows (mask 0)
    small = engine.teacher_force(tiny_model.graphdef, tiny_model.params, plan, jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(targets))[0]
    big = engine.teacher_force(tiny_model.graphdef, tiny_model.params, plan, wide(tokens), wide(mask), wide(targets))[0]
    np.testing.assert_allclose(np.asarray(big)[:2], np.asarray(small), atol=1e-6, rtol=0)


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.9, top_p=0.9, seed=7)], ids=["greedy", "sampled"])
def test_stream_yields_the_loops_tokens_without_recompiling(tiny_model, sampling):
    prompt = random_prompts(np.random.default_rng(6), [9], tiny_model.config.vocab_size)[0]
    method = popjax.POP(ratio=0.3, gamma=0.2)
    want, _ = popjax.generate_ids(tiny_model, [prompt], max_new_tokens=16, method=method, stop_ids=[], **sampling)
    got = list(popjax.stream_ids(tiny_model, prompt, max_new_tokens=16, method=method, stop_ids=[], **sampling))
    assert got == want[0]
    before = engine.compile_counts()
    again = list(popjax.stream_ids(tiny_model, prompt[:5], max_new_tokens=30, method=method, stop_ids=[], **sampling))
    assert len(again) == 30 and engine.compile_counts() == before


def test_stream_stops_at_a_stop_id(tiny_model):
    prompt = random_prompts(np.random.default_rng(8), [9], tiny_model.config.vocab_size)[0]
    full, _ = popjax.generate_ids(tiny_model, [prompt], max_new_tokens=12, stop_ids=[])
    stop = full[0][4]
    got = list(popjax.stream_ids(tiny_model, prompt, max_new_tokens=12, stop_ids=[stop]))
    assert got == full[0][: full[0].index(stop)]


def test_teacher_forcing_pads_the_batch_bucket(tiny_model):
    rng = np.random.default_rng(9)
    prompts = random_prompts(rng, [5, 8, 3], tiny_model.config.vocab_size)
    targets = np.asarray(random_prompts(rng, [4, 4, 4], tiny_model.config.vocab_size))
    nll, _ = teacher_forced(tiny_model, popjax.Dense(), prompts, targets)
    assert nll.shape == (3, 4) and np.isfinite(nll).all()


def test_first_argmax_is_argmax_with_ties_infinities_and_nan():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 49152)).astype(np.float32)
    logits[1, [7, 300, 40000]] = 9.0  # ties: the first wins
    logits[2] = -np.inf
    logits[3, 123] = np.inf
    logits[4, [5, 77]] = np.nan  # the first NaN, as jnp.argmax
    logits[5] = 0.0
    np.testing.assert_array_equal(np.asarray(first_argmax(jnp.asarray(logits))), np.asarray(jnp.argmax(jnp.asarray(logits), axis=-1)))
