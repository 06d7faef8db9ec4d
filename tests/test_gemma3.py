"""Gemma 3 on the engine: greedy generation past the window equals transformers', scanned layers
with mixed layer types equal the unrolled model, a sliding layer's cache is its window whatever
the capacity (the compiled program's memory), and bad configs fail in one line.

Logit parity (left-padded prefill + 8 decode steps) runs with every architecture in
tests/test_parity.py; GGUF sources in tests/test_gemma3_gguf.py; methods in
tests/test_gemma3_methods.py."""

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
from popjax.models.attention import KV_BLOCK, ring_slots
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


@pytest.mark.parametrize("name", ["gemma3-window", "gemma3-last-sliding"])
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
