"""Teacher forcing through a method's *decode* path: prefill a prompt, then feed given tokens
one at a time (the online setting POP is built for) and score each next token.

One compile per (prompt bucket, number of targets, batch size, method plan).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .. import engine
from ..generation import _left_pad
from ..loading import LoadedModel
from ..methods import Method


@functools.partial(jax.jit, static_argnames=("graphdef", "plan", "with_logprobs"))
def _teacher_forced(graphdef, params, plan, tokens, mask, targets, with_logprobs=False):
    """tokens, mask [B, T] (left-padded prompt); targets [B, N] ->
    nll [B, N] of each target given the prompt and the previous targets, and, if asked,
    log-probabilities [B, N, V] of every position."""
    model = nnx.merge(graphdef, params)
    B, T = tokens.shape
    N = targets.shape[1]
    logits, caches, states, _ = engine.prefill(graphdef, params, tokens, mask, plan)
    caches = engine.grow_caches(caches, N)
    key_valid = engine.decode_key_valid(mask, N)
    position = jnp.sum(mask, axis=1).astype(jnp.int32)

    def step(carry, i):
        logits, caches, states = carry
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        target = targets[:, i]
        nll = -jnp.take_along_axis(logp, target[:, None], axis=-1)[:, 0]
        logits, caches, states, _ = engine._step(
            model, plan, target, position + i, T + i, key_valid, caches, states, i
        )
        return (logits, caches, states), (nll, logp if with_logprobs else jnp.zeros((B, 0)))

    _, (nll, logp) = jax.lax.scan(step, (logits, caches, states), jnp.arange(N))
    return nll.T, jnp.swapaxes(logp, 0, 1)


def teacher_forced(
    model: LoadedModel,
    method: Method,
    prompts: list[list[int]],
    targets: np.ndarray,
    with_logprobs: bool = False,
) -> tuple[np.ndarray, np.ndarray | None]:
    """NLL (nats) [B, N] of ``targets`` [B, N] fed through ``method``'s decode path after each
    prompt's prefill; optionally the log-probabilities [B, N, V]."""
    targets = np.asarray(targets, np.int32)
    if targets.ndim != 2 or targets.shape[0] != len(prompts):
        raise ValueError(f"targets must be [B={len(prompts)}, N]; got {targets.shape}")
    length = engine.bucket_for(max(map(len, prompts)), engine.PROMPT_BUCKETS, "a prompt length")
    tokens, mask = _left_pad(prompts, length, 0)
    plan = method.bind(model.config)
    nll, logp = _teacher_forced(
        model.graphdef, model.params, plan, jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(targets), with_logprobs
    )
    return np.asarray(nll), (np.asarray(logp) if with_logprobs else None)
