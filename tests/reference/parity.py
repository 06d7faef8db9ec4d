"""popjax against transformers (PyTorch CPU, fp32) on one model: the prefill logits of a
left-padded batch and the log-probabilities of teacher-forced decode steps through the KV cache
(tests/models/test_parity.py, the Gemma GGUF tests, tools/gemma3_parity.py)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

import popjax
from popjax import engine
from popjax.eval.teacher import teacher_forced
from popjax.requests import pad_batch
from tests.conftest import random_prompts

LENGTHS = (5, 9, 13)
DECODE_STEPS = 8


def hf_logits(model, ids: list[int]) -> np.ndarray:
    """transformers' logits of one unpadded row: ids [T] -> [T, V]."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def parity_errors(model, hf_model) -> tuple[float, float]:
    """Max |popjax − transformers| of (the prefill logits of a left-padded batch of three prompts
    of LENGTHS tokens, the log-probabilities of DECODE_STEPS continuation tokens fed one at a time
    through the decode path and the KV cache). Used by the Gemma GGUF tests and
    tools/gemma3_parity.py too."""
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    prompts = random_prompts(rng, LENGTHS, vocab)
    continuations = random_prompts(rng, [DECODE_STEPS] * len(prompts), vocab)
    expected = [hf_logits(hf_model, p + c) for p, c in zip(prompts, continuations)]
    tokens, mask = pad_batch(prompts, pad_id=0)
    T = tokens.shape[1]
    plan = popjax.Dense().bind(model.config)
    logits, _, _, _ = engine.prefill(
        model.graphdef, model.params, jnp.asarray(tokens), jnp.asarray(mask), plan, all_logits=True
    )
    logits = np.asarray(logits)
    prefill = max(np.abs(logits[row, T - len(p):] - expected[row][: len(p)]).max() for row, p in enumerate(prompts))
    _, logp = teacher_forced(model, popjax.Dense(), prompts, np.asarray(continuations), with_logprobs=True)
    decode = max(
        np.abs(logp[row] - torch.log_softmax(torch.tensor(expected[row][len(p) - 1 : len(p) - 1 + DECODE_STEPS]), -1).numpy()).max()
        for row, p in enumerate(prompts)
    )
    return float(prefill), float(decode)
