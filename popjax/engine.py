"""The compiled generation engine: bucketed prefill, static-shaped KV cache, one decode loop.

* ``prefill`` is jitted per (prompt-length bucket, method plan); prompts are left-padded and
  positions are ``cumsum(mask) − 1``.
* ``decode_loop`` is one ``lax.while_loop`` that samples, runs a decode step through the KV cache
  and stops when ``max_new_tokens`` is reached or every sequence has emitted a stop id.
  ``max_new_tokens`` and the sampling parameters are traced, so they never recompile; the cache
  holds ``T_bucket + capacity`` slots with ``capacity`` from ``CAPACITY_BUCKETS``.
* ``decode_step`` is the same step jitted alone (streaming, teacher forcing), cache donated.

Shapes: B batch, T prompt bucket, S = T + capacity cache slots, V vocabulary, L layers.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .models.layers import KVCache
from .methods.base import Plan
from .sampling import SamplingParams, sample

PROMPT_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
CAPACITY_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096)


def bucket_for(n: int, buckets: tuple[int, ...], what: str) -> int:
    for size in buckets:
        if n <= size:
            return size
    raise ValueError(f"{what} of {n} exceeds the largest supported bucket {buckets[-1]}")


def positions_from_mask(mask: jax.Array) -> jax.Array:
    """Left- or right-padded mask [B, T] -> RoPE positions [B, T] (padding gets 0)."""
    return jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0).astype(jnp.int32)


def stack_layers(per_layer: list[Any]) -> Any:
    """A list of L identical pytrees -> one pytree with a leading [L] axis on every leaf."""
    return jax.tree_util.tree_map(lambda *leaves: jnp.stack(leaves), *per_layer)


@functools.partial(jax.jit, static_argnames=("graphdef", "plan", "all_logits", "with_aux"))
def prefill(graphdef, params, tokens, mask, plan: Plan, all_logits=False, with_aux=False, gates=None):
    """tokens, mask [B, T] -> (logits [B, V] at the last slot, or [B, T, V] with ``all_logits``;
    fresh caches (L × KVCache [B, T, n_kv, h]); method states (L); aux stacked over layers).
    ``gates`` [L, B, T] are optional virtual layer gates (SPEC §4; differentiable)."""
    model = nnx.merge(graphdef, params)
    valid = mask.astype(bool)
    states = [None] * len(model.layers)
    logits, caches, states, aux = model(
        tokens,
        positions_from_mask(mask),
        valid,
        lambda w, _state, x: plan.prefill(w, x, valid),
        states,
        last_only=not all_logits,
        gates=gates,
    )
    logits = logits if all_logits else logits[:, -1]
    return logits, caches, states, stack_layers(aux) if with_aux else {}


def _step(model, plan: Plan, token, position, write_index, key_valid, caches, states, step):
    """One decode step: token, position [B] -> logits [B, V], caches, states, aux (per layer)."""
    logits, caches, states, aux = model(
        token[:, None],
        position[:, None],
        key_valid,
        lambda w, state, x: plan.decode(w, state, x, step, jnp.ones((x.shape[0], 1), bool)),
        states,
        caches=caches,
        write_index=write_index,
    )
    return logits[:, 0], caches, states, aux


@functools.partial(
    jax.jit, static_argnames=("graphdef", "plan", "with_aux"), donate_argnames=("caches",)
)
def decode_step(graphdef, params, plan, token, position, write_index, key_valid, caches, states, step, with_aux=False):
    """The jitted single step (streaming, teacher-forced evaluation); ``caches`` is donated."""
    model = nnx.merge(graphdef, params)
    logits, caches, states, aux = _step(
        model, plan, token, position, write_index, key_valid, caches, states, step
    )
    return logits, caches, states, stack_layers(aux) if with_aux else {}


def grow_caches(prompt_caches: list[KVCache], capacity: int) -> list[KVCache]:
    """Prompt caches [B, T, ...] -> decode caches [B, T + capacity, ...] (zeros after T)."""
    pad = lambda a: jnp.pad(a, ((0, 0), (0, capacity), (0, 0), (0, 0)))
    return [KVCache(pad(c.k), pad(c.v)) for c in prompt_caches]


def decode_key_valid(mask: jax.Array, capacity: int) -> jax.Array:
    """Prompt mask [B, T] -> slot validity [B, T + capacity]; decode slots are valid once written
    (the causal slot test in attention excludes the future ones)."""
    return jnp.concatenate([mask.astype(bool), jnp.ones((mask.shape[0], capacity), bool)], axis=1)


@functools.partial(jax.jit, static_argnames=("graphdef", "plan", "capacity", "trace"))
def decode_loop(
    graphdef,
    params,
    plan: Plan,
    first_logits,
    prompt_caches,
    states,
    mask,
    max_new_tokens,
    sampling: SamplingParams,
    stop_ids,
    pad_id,
    key,
    capacity: int,
    trace: bool = False,
):
    """Generates up to ``max_new_tokens`` (≤ capacity) tokens after a prefill.

    first_logits [B, V]; mask [B, T]; stop_ids [n_stop] (-1 = unused slot) ->
    (tokens [B, capacity] (pad_id after a sequence stops), number of steps run, trace) where
    ``trace`` maps each aux name to [capacity − 1, L, ...] when requested.
    """
    model = nnx.merge(graphdef, params)
    B, T = mask.shape
    caches = grow_caches(prompt_caches, capacity)
    key_valid = decode_key_valid(mask, capacity)
    position = jnp.sum(mask, axis=1).astype(jnp.int32)  # the first generated token's position
    key, sub = jax.random.split(key)
    token = sample(first_logits, sub, sampling)
    done = jnp.isin(token, stop_ids)
    tokens = jnp.full((B, capacity), pad_id, jnp.int32).at[:, 0].set(token)

    def run_step(i, token, position, caches, states):
        return _step(model, plan, token, position, T + i - 1, key_valid, caches, states, i - 1)

    if trace:
        aux_shape = jax.eval_shape(run_step, 1, token, position, caches, states)[3]
        aux_shape = jax.eval_shape(stack_layers, aux_shape)
        records = jax.tree_util.tree_map(
            lambda s: jnp.zeros((capacity - 1, *s.shape), s.dtype), aux_shape
        )
    else:
        records = {}

    def cond(carry):
        i, _, _, _, _, done, _, _, _ = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        i, token, position, caches, states, done, tokens, key, records = carry
        logits, caches, states, aux = run_step(i, token, position, caches, states)
        key, sub = jax.random.split(key)
        token = jnp.where(done, pad_id, sample(logits, sub, sampling))
        tokens = tokens.at[:, i].set(token)
        done = done | jnp.isin(token, stop_ids)
        if trace:
            records = jax.tree_util.tree_map(
                lambda buf, a: buf.at[i - 1].set(a), records, stack_layers(aux)
            )
        return i + 1, token, position + 1, caches, states, done, tokens, key, records

    carry = (jnp.int32(1), token, position, caches, states, done, tokens, key, records)
    carry = jax.lax.while_loop(cond, body, carry)
    return carry[6], carry[0], carry[8]


def compile_counts() -> dict[str, int]:
    """How many executables each engine function holds (one per distinct static signature)."""
    return {
        "prefill": prefill._cache_size(),
        "decode_loop": decode_loop._cache_size(),
        "decode_step": decode_step._cache_size(),
    }
