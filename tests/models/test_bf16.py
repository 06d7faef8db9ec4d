"""bfloat16 end to end: weights, activations and KV caches in bf16 (scores and softmax in fp32),
against transformers in bf16 on every tiny architecture, and the default dtype per backend.

Tolerance: popjax bf16 must be as close to transformers bf16 as transformers bf16 is to its own
fp32 (at most twice that error, plus 0.01): two bf16 implementations round at different points,
so neither can be closer to the other than to exact arithmetic."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import popjax
from popjax import engine, loading
from popjax.eval.teacher import teacher_forced
from popjax.requests import pad_batch
from tests.conftest import TINY_CONFIGS, random_prompts


def _hf(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_bf16_matches_transformers_bf16(name, tiny_checkpoints):
    directory, hf32 = tiny_checkpoints(name)
    hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
    model = popjax.load(directory, cache=False, dtype="bfloat16")
    rng = np.random.default_rng(0)
    (prompt,) = random_prompts(rng, (10,), model.config.vocab_size)
    (cont,) = random_prompts(rng, (4,), model.config.vocab_size)
    want32, want16 = _hf(hf32, prompt + cont), _hf(hf16, prompt + cont)
    tolerance = 2 * np.abs(want16 - want32).max() + 0.01
    got = np.asarray(popjax.forward(model, [prompt + cont]), np.float32)[0]
    assert np.abs(got - want16).max() <= tolerance
    # the decode path through the bf16 KV cache, teacher-forced
    _, logp = teacher_forced(model, popjax.Dense(), [prompt], np.asarray([cont]), with_logprobs=True)
    want = torch.log_softmax(torch.tensor(want16[len(prompt) - 1 : -1]), -1).numpy()
    assert np.abs(logp[0] - want).max() <= 2 * tolerance


def test_weights_activations_and_caches_are_bf16(tiny_checkpoints):
    directory, _ = tiny_checkpoints("llama-gqa")
    model = popjax.load(directory, cache=False, dtype="bfloat16")
    assert model.dtype == "bfloat16"
    dtypes = {leaf.dtype for leaf in jax.tree_util.tree_leaves(model.params)}
    assert jnp.dtype(jnp.bfloat16) in dtypes and dtypes <= {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)}
    tokens, mask = pad_batch([[5, 6, 7, 8]], 0)
    plan = popjax.POP(0.3).bind(model.config)
    logits, caches, _, _ = engine.prefill(model.graphdef, model.params, jnp.asarray(tokens), jnp.asarray(mask), plan)
    assert logits.dtype == jnp.float32  # logits (and the softmax over them) are fp32
    cache_dtypes = {leaf.dtype for leaf in jax.tree_util.tree_leaves(caches)}
    assert cache_dtypes == {jnp.dtype(jnp.bfloat16)}


def test_default_dtype_follows_the_backend(monkeypatch):
    assert loading.default_dtype() == "float32"  # the tests run on CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert loading.default_dtype() == "bfloat16"
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert loading.default_dtype() == "bfloat16"
