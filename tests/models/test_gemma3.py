"""Gemma 3 on the engine: greedy generation past the window equals transformers', scanned layers
with mixed layer types equal the unrolled model, a sliding layer's cache is its window whatever
the capacity (the compiled program's memory), and bad configs fail in one line.

Logit parity (left-padded prefill + 8 decode steps) runs with every architecture in
tests/models/test_parity.py; GGUF sources in tests/models/test_gemma3_gguf.py; methods in
tests/methods/test_gemma3_methods.py."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import popjax
from popjax import engine
from popjax.cache import cache_root
from popjax.eval.teacher import teacher_forced
from popjax.kernels.attention import KV_BLOCK, ring_slots
from popjax.models.config import ConfigError, ModelConfig
from popjax.sampling import SamplingParams
from tests.conftest import random_prompts

NEW_TOKENS = 40


@pytest.mark.parametrize("name", ["gemma3-window", "gemma3-last-sliding"])
def test_greedy_generation_equals_transformers_past_the_window(name, tiny_checkpoints):
    """40 new tokens after prompts longer and shorter than the window (6 or 8): every sliding
    layer's ring buffer wraps several times."""
    directory, hf_model = tiny_checkpoints(name)
    model = popjax.load(directory, cache=False)
    prompts = random_prompts(np.random.default_rng(3), (11, 5), model.config.vocab_size)
    ours, _ = popjax.generate_ids(model, prompts, max_new_tokens=NEW_TOKENS, stop_ids=[])
    eos = model.config.eos_token_ids[0]
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
        want = out[0, len(prompt):].tolist()
        want = want[: want.index(eos)] if eos in want else want  # our stop set holds the config EOS
        assert got == want


@pytest.mark.parametrize("name", ["gemma3-window", pytest.param("gemma3-last-sliding", marks=pytest.mark.slow)])
def test_scanned_layers_equal_unrolled_with_mixed_layer_types(name, tiny_checkpoints):
    """One scan over sliding and full layers (a cache stack per kind, models.scan.KindCaches):
    the prefill's logits and 12 teacher-forced decode steps past the window equal the unrolled
    model's, and generation equals it token for token."""
    directory, _ = tiny_checkpoints(name)
    unrolled = popjax.load(directory, cache=False)
    scanned = popjax.load(directory, cache=False, scan_layers=True)
    rng = np.random.default_rng(4)
    prompts = random_prompts(rng, (13, 4, 9), unrolled.config.vocab_size)
    targets = np.asarray(random_prompts(rng, [12] * 3, unrolled.config.vocab_size))
    nll_u, logp_u = teacher_forced(unrolled, popjax.Dense(), prompts, targets, with_logprobs=True)
    nll_s, logp_s = teacher_forced(scanned, popjax.Dense(), prompts, targets, with_logprobs=True)
    np.testing.assert_allclose(logp_s, logp_u, atol=2e-5, rtol=0)
    np.testing.assert_allclose(nll_s, nll_u, atol=2e-5, rtol=0)
    ids_u, _ = popjax.generate_ids(unrolled, prompts, max_new_tokens=20, stop_ids=[])
    ids_s, _ = popjax.generate_ids(scanned, prompts, max_new_tokens=20, stop_ids=[])
    assert ids_s == ids_u


def test_streaming_equals_generation(tiny_checkpoints):
    directory, _ = tiny_checkpoints("gemma3-window")
    model = popjax.load(directory, cache=False)
    prompt = random_prompts(np.random.default_rng(5), (10,), model.config.vocab_size)[0]
    ids, _ = popjax.generate_ids(model, [prompt], max_new_tokens=15, ignore_eos=True)
    assert list(popjax.stream_ids(model, prompt, max_new_tokens=15, ignore_eos=True)) == ids[0]


def _sliding_only(tmp_path, window: int = 16):
    """A tiny Gemma 3 whose layers all slide (random weights; no reference needed)."""
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=window,
        layer_types=["sliding_attention"] * 2, max_position_embeddings=8192,
    )
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(config).save_pretrained(tmp_path)
    return popjax.load(tmp_path, cache=False)


def _start_outputs(model, capacity: int, batch: int = 1, prompt: int = 32):
    """The compiled `engine.start` for a capacity bucket: its output bytes and its caches."""
    plan = popjax.Dense().bind(model.config)
    tokens = jnp.ones((batch, prompt), jnp.int32)
    args = (model.graphdef, model.params, plan, tokens, tokens, jax.random.key(0), SamplingParams.create(),
            jnp.asarray([2], jnp.int32), 0)
    compiled = engine.start.lower(*args, capacity=capacity).compile()
    caches = jax.eval_shape(lambda: engine.start(*args, capacity=capacity))[0].state.caches
    return compiled.memory_analysis().output_size_in_bytes, caches


def test_sliding_cache_is_the_window_whatever_the_capacity(tmp_path):
    """A sliding-only model's caches are rings of `window` slots at capacity 64 and at 4096: the
    compiled program's output grows only by the key-validity mask ([B, S] bool), not by a cache
    slot, when the capacity grows 64x."""
    window = 16
    model = _sliding_only(tmp_path, window)
    small_bytes, small = _start_outputs(model, 64)
    large_bytes, large = _start_outputs(model, 4096)
    for caches in (small, large):
        assert all(c.k.shape[1] == window and c.v.shape[1] == window for c in caches)
    slots = lambda capacity: 32 + capacity if 32 + capacity <= KV_BLOCK else -(-(32 + capacity) // KV_BLOCK) * KV_BLOCK
    assert large_bytes - small_bytes == slots(4096) - slots(64)  # the [1, S] bool key mask, nothing else


def test_ring_slots_round_to_whole_blocks_and_never_exceed_the_cache():
    assert ring_slots(8, 96) == 8
    assert ring_slots(8, 4) == 4  # a short sequence never wraps
    assert ring_slots(512, 4352) == 512
    assert ring_slots(300, 4352) == 2 * KV_BLOCK  # decode reads whole blocks


def _gemma_dict(**overrides):
    raw = dict(model_type="gemma3_text", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
               num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=4,
               layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    raw.update(overrides)
    return raw


@pytest.mark.parametrize("overrides, message", [
    (dict(layer_types=["sliding_attention", "full_attention"]), "layer_types=.*one entry per layer \\(3 layers\\)"),
    (dict(layer_types=["sliding_attention", "chunked_attention", "full_attention"]), "layer_types holds \\['chunked_attention'\\]"),
    (dict(sliding_window=0), "sliding_window=0 is invalid"),
    (dict(sliding_window=-4), "sliding_window=-4 is invalid"),
    (dict(hidden_activation="relu"), "hidden_act='relu' is not an FFN activation"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0 is not supported"),
])
def test_bad_gemma3_configs_fail_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        ModelConfig.from_hf_dict(_gemma_dict(**overrides))
    assert "\n" not in str(err.value)


def test_config_round_trips_and_reads_the_older_pattern_field():
    cfg = ModelConfig.from_hf_dict(_gemma_dict(final_logit_softcapping=30.0, query_pre_attn_scalar=24))
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.rope_local_theta == 10000.0
    assert cfg.sliding_layers == (0, 1) and cfg.full_layers == (2,)
    # configs written before `layer_types` carry `sliding_window_pattern`: every n-th layer full
    old = _gemma_dict(num_hidden_layers=7, sliding_window_pattern=3)
    del old["layer_types"]
    assert ModelConfig.from_hf_dict(old).full_layers == (2, 5)
    # a LLaMA config is unchanged by the new fields (its converted-cache key too)
    llama = ModelConfig.from_hf_dict(dict(model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8,
                                          num_hidden_layers=1, num_attention_heads=1))
    assert not {"layer_types", "hidden_act", "sliding_window"} & set(llama.to_hf_dict())


def test_loading_a_bad_gemma3_checkpoint_leaves_nothing_in_the_cache(tiny_checkpoints, tmp_path):
    """A config whose layer_types has the wrong length: one line naming it, no cache entry."""
    import shutil

    source, _ = tiny_checkpoints("gemma3-window")
    directory = tmp_path / "bad"
    shutil.copytree(source, directory)
    raw = json.loads((directory / "config.json").read_text())
    raw["layer_types"] = ["sliding_attention"]
    (directory / "config.json").write_text(json.dumps(raw))
    entries = lambda: sorted(str(p) for p in cache_root().rglob("*"))
    before = entries()
    with pytest.raises(ConfigError, match="layer_types=\\['sliding_attention'\\] is invalid") as err:
        popjax.load(directory)
    assert "\n" not in str(err.value)
    assert entries() == before


@pytest.mark.parametrize("scan_layers", [False, True])
def test_memory_plan_knows_windowed_caches(scan_layers):
    """The plan's KV cache (from XLA's shardings of the decode carry) equals the windowed formula
    (full layers every slot, sliding layers their ring), and is smaller than without windows."""
    from popjax.analysis.memory_plan import memory_plan
    from popjax.sharding import make_mesh

    cfg = ModelConfig.from_hf_dict(_gemma_dict(num_hidden_layers=4, sliding_window=16, layer_types=[
        "sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]))
    plan = memory_plan(cfg, make_mesh((1, 1)), popjax.Dense(), 2, 1024, 512, "float32", scan_layers=scan_layers)
    slots = plan["cache_slots"]
    per_slot = 2 * 2 * cfg.kv_dim * 4  # k and v, batch 2, fp32
    assert plan["xla_per_device"]["kv_cache"] == plan["analytic_per_device"]["kv_cache"] == per_slot * (slots + 3 * 16)
    assert plan["analytic_per_device"]["kv_cache_without_windows"] == per_slot * 4 * slots


def _reference_attention(q, k, v, q_index, k_index, valid, window, scale):
    """NumPy softmax attention: q [T, n_q, h] at q_index [T]; k, v [S, n_kv, h] at k_index [S]
    (valid [S]); key s is seen by query t when valid, k ≤ q and q − k < window."""
    n_q, n_kv = q.shape[1], k.shape[1]
    kk, vv = np.repeat(k, n_q // n_kv, axis=1), np.repeat(v, n_q // n_kv, axis=1)
    scores = np.einsum("tnh,snh->nts", q, kk) * scale
    seen = valid[None, :] & (k_index[None, :] <= q_index[:, None]) & (q_index[:, None] - k_index[None, :] < window)
    scores = np.where(seen[None], scores, -1e30)  # finite: a padding query row stays finite (and unused)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("nts,snh->tnh", p, vv)


def test_windowed_flash_prefill_equals_reference():
    """A 1024-token prompt runs the blockwise prefill (two 512-blocks); with a window of 200 the
    first key block is outside every window of the second query block and is skipped."""
    from popjax.kernels.attention import PREFILL_BLOCK, causal_attention

    T, window, scale = 2 * PREFILL_BLOCK, 200, 0.3
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(1, T, n, 8)).astype(np.float32) for n in (4, 2, 2))
    valid = np.ones((1, T), bool)
    valid[0, :37] = False  # left padding
    got = np.asarray(causal_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(valid), scale, window))
    index = np.arange(T)
    want = _reference_attention(q[0], k[0], v[0], index, index, valid[0], window, scale)
    np.testing.assert_allclose(got[0, 37:], want[37:], atol=2e-5)


def test_ring_cache_attention_equals_reference_for_several_new_tokens():
    """Three fresh tokens at once after 21 cached ones, ring of 8 slots, window 8: the queries
    read the ring as it was plus the fresh keys; the fresh keys then overwrite the oldest slots."""
    from popjax.kernels.attention import cache_reader, cached_attention, ring_from_prompt, ring_write

    rng = np.random.default_rng(1)
    S, window, ring, past, T, scale = 32, 8, 8, 21, 3, 0.25
    k_all, v_all = (rng.normal(size=(1, S, 2, 8)).astype(np.float32) for _ in range(2))
    q = rng.normal(size=(1, T, 4, 8)).astype(np.float32)
    valid = np.ones((1, S), bool)
    valid[0, :5] = False  # left padding
    k_ring = ring_from_prompt(jnp.asarray(k_all[:, :past]), past, ring)
    v_ring = ring_from_prompt(jnp.asarray(v_all[:, :past]), past, ring)
    read = cache_reader(k_ring, v_ring)
    fresh_k, fresh_v = jnp.asarray(k_all[:, past:past + T]), jnp.asarray(v_all[:, past:past + T])
    got = np.asarray(cached_attention(jnp.asarray(q), fresh_k, fresh_v, read, ring, jnp.asarray(valid), jnp.int32(past), window, scale,
                                      ring=True)[0])
    index = np.arange(past + T)
    want = _reference_attention(q[0], k_all[0, :past + T], v_all[0, :past + T], past + np.arange(T), index,
                                valid[0, :past + T], window, scale)
    np.testing.assert_allclose(got[0], want, atol=2e-5)
    written = np.asarray(ring_write(k_ring, fresh_k, jnp.int32(past)))
    for c in range(past + T - ring, past + T):  # the ring now holds the last 8 indices, index c at slot c mod 8
        np.testing.assert_array_equal(written[0, c % ring], k_all[0, c])
