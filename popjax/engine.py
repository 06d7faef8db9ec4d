"""The compiled generation engine: one decode state, one step, bucketed shapes.

* ``DecodeState`` holds everything a decode step needs (positions, the shared cache write index,
  the step count, key validity, which rows are live, the KV caches and the method states). It is
  built by ``_prefill`` and advanced by ``_advance``; the decode loop, streaming and
  teacher-forced evaluation all run that same step.
* Shapes are bucketed so compiles are few: batch (``BATCH_BUCKETS``, padded with dead rows),
  prompt length (``PROMPT_BUCKETS``, left padding, positions ``cumsum(mask) − 1``) and capacity
  (``CAPACITY_BUCKETS``). Compiled programs exist per (batch, prompt, capacity bucket, plan).
* Prefill allocates the cache at its full size (prompt bucket + capacity; a sliding-window
  layer's ring of its window, ``model.init_caches``) inside the same program and writes the
  prompt's keys/values into it: no copy after prefill. The decode loop
  and the streaming step donate the state they consume.
* Decode attention reads the cache only up to the last written slot (``kernels.attention``), so
  capacity costs memory, not time.
* ``max_new_tokens`` and the sampling parameters are traced values: no recompiles.

* The model is a ``Transformer`` (caches and method states are tuples over its L layers) or a
  ``models.scan.ScannedTransformer`` (one KVCache and one state pytree stacked on a leading [L]
  axis); the engine asks the model to map a per-layer function over them (``map_layers``).

Shapes: B batch bucket, T prompt bucket, S cache slots, V vocabulary, L layers.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from . import sharding
from .ffn import Plan
from .kernels.attention import cache_slots
from .models.interface import CacheView, FFNHook, FFNWeights, LayerControl, ModelInputs
from .models.layers import KVCache, PlacedEmbeddings
from .models.scan import KindCaches
from .sampling import SamplingParams, sample

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
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


def stack_aux(per_layer: list[Any] | Any) -> Any:
    """Per-layer aux -> one pytree stacked over layers; layers that produced none (skipped in
    prefill) get zeros shaped like the others'. A scanned model's aux (not a list: the scan
    already stacked it over layers) passes through.

    Layers of different FFN kinds (a MoE model's dense layers: no routed experts, another
    number of blocks; docs/moe.md) are padded with zeros to the union of their dict entries,
    each at its largest extent per axis, so e.g. ``["experts"]`` is [L, E, ...] for every layer."""
    if not isinstance(per_layer, list):
        return per_layer
    full = [a for a in per_layer if jax.tree_util.tree_leaves(a)]
    if not full:
        return {}
    shapes = lambda t: (jax.tree_util.tree_structure(t), [(a.shape, a.dtype) for a in jax.tree_util.tree_leaves(t)])
    if any(shapes(a) != shapes(full[0]) for a in full):
        like = _union_like(full, "aux")
        return stack_layers([_pad_like(a, like) for a in per_layer])
    zeros = jax.tree_util.tree_map(jnp.zeros_like, full[0])
    return stack_layers([a if jax.tree_util.tree_leaves(a) else zeros for a in per_layer])


def _union_like(trees: list[Any], path: str) -> Any:
    """The smallest layout all ``trees`` fit in: dicts -> the union of their (non-empty) entries;
    arrays -> jax.ShapeDtypeStruct with the largest extent per axis."""
    if all(isinstance(t, dict) for t in trees):
        keys = dict.fromkeys(k for t in trees for k in t if jax.tree_util.tree_leaves(t[k]))
        return {k: _union_like([t[k] for t in trees if k in t and jax.tree_util.tree_leaves(t[k])], f"{path}[{k!r}]") for k in keys}
    if all(hasattr(t, "shape") for t in trees) and len({t.ndim for t in trees}) == 1:
        return jax.ShapeDtypeStruct(tuple(max(n) for n in zip(*(t.shape for t in trees))), trees[0].dtype)
    raise ValueError(f"per-layer {path} differ in structure or rank and cannot be stacked over layers: {[jax.tree_util.tree_structure(t) for t in trees]}")


def _pad_like(tree: Any, like: Any) -> Any:
    """``tree`` zero-padded to the layout ``like`` (`_union_like`); missing entries are zeros."""
    if isinstance(like, dict):
        tree = tree if isinstance(tree, dict) else {}
        return {k: _pad_like(tree.get(k), v) for k, v in like.items()}
    if tree is None or not jax.tree_util.tree_leaves(tree):
        return jnp.zeros(like.shape, like.dtype)
    return jnp.pad(tree.astype(like.dtype), [(0, n - m) for n, m in zip(like.shape, tree.shape)])


def stacked_method_states(state: "DecodeState") -> Any:
    """The method states stacked over layers ({} for a stateless plan): an unrolled model's
    tuple of L states is stacked; a scanned model's (its caches are one stacked KVCache) are."""
    if isinstance(state.caches, (KVCache, KindCaches)):  # no leaves (a stateless plan): {} as stack_aux gives
        return state.method_states if jax.tree_util.tree_leaves(state.method_states) else {}
    return {} if state.method_states[0] is None else stack_aux(list(state.method_states))  # MoE: layer kinds differ


class DecodeState(NamedTuple):
    """The state one decode step advances (a pytree; B batch bucket, S cache slots)."""

    position: jax.Array  # [B] int32: RoPE position of the next token fed
    index: jax.Array  # [] int32: cache slot that token is written to (shared: left padding)
    step: jax.Array  # [] int32: decode-path calls so far (the methods' ``step``)
    key_valid: jax.Array  # [B, S] bool: the prompt mask, then True for every decode slot
    live: jax.Array  # [B] bool: a real row that has not stopped (the methods' ``valid``)
    prefix_end: jax.Array  # [] int32: first slot not written by prefill (see models.interface.LayerControl.prefix_masked)
    # L × k, v [B, S, n_kv, h] (a sliding layer: its ring [B, R, n_kv, h]); scanned model: k, v
    # [L, B, S, n_kv, h], or with sliding layers models.scan.KindCaches (one stack per kind)
    caches: tuple[KVCache, ...] | KVCache | KindCaches
    method_states: tuple[Any, ...] | Any  # L × the plan's state; scanned model: one state stacked [L, ...]


class ImagePrompt(NamedTuple):
    """What images add to a VLM's prefill (built on the host by ``generation``'s image path, the
    features by the vision tower): ``placed`` the image features and the placeholder slot each
    takes ([N, d], [B, T]); ``positions`` [3, B, T] M-RoPE's positions (``models.mrope``);
    ``next_position`` [B] the rope position of each row's first new token (after an image a
    row's positions run behind its length; decode continues on all three axes from here)."""

    placed: PlacedEmbeddings
    positions: jax.Array
    next_position: jax.Array


class Sampler(NamedTuple):
    """The generation carry: the decode state, the last sampled token (fed next) and the key."""

    state: DecodeState
    token: jax.Array  # [B] int32
    key: jax.Array


def _prefill(model, plan: Plan, tokens, mask, capacity: int, all_logits=False, gates=None, data=None, images=None):
    """tokens, mask [B, T] -> (logits [B, V] for the next token or [B, T, V], DecodeState with
    S = cache_slots(T, capacity), per-layer aux). ``images`` (an `ImagePrompt`, optional) places
    a VLM's image features and gives the prompt's M-RoPE positions.

    A plan with a ``boundary`` prefills all but each row's last prompt token (the last column,
    since rows are left-padded) and runs that token through the full model as a decode-path
    step; ``all_logits`` (``forward``) prefills every position instead. ``data`` is the method's
    calibrated data (`Method.data`, traced), given to the plan's FFN functions and to its
    `Plan.layer_control`; ``gates`` [L, B, T] (optional) virtual layer gates."""
    B, T = tokens.shape
    L = model.cfg.num_hidden_layers
    check_data(plan, data)
    boundary = plan.boundary and not all_logits
    prefill_mask = mask.at[:, -1].set(0) if boundary else mask
    valid = prefill_mask.astype(bool)
    image_tokens = None if images is None else images.placed.slots >= 0  # [B, T]: what a plan's statistics may tell apart
    # a boundary token is the last prompt token: text, so its three M-RoPE axes are equal
    positions = positions_from_mask(prefill_mask) if images is None else images.positions
    next_position = jnp.sum(mask, axis=1).astype(jnp.int32) if images is None else images.next_position.astype(jnp.int32)
    control = plan.layer_control(L, data)
    if gates is not None:
        control = (control or LayerControl()).replace(gates=gates)
    first = lambda w, _state, x, rows: plan.prefill(with_data(w, data, image_tokens), x, rows)
    logits, caches, states, aux = model(
        ModelInputs(tokens, positions, None if images is None else images.placed),
        cache=CacheView(None, valid),
        ffn=FFNHook(first, None, valid),  # no method state yet
        layers=control,
        last_only=not all_logits,
    )
    S = cache_slots(T, capacity)
    # the model lays out its decode caches (a sliding-window layer keeps a ring of its window)
    caches = model.init_caches(caches, T, S)
    state = DecodeState(
        position=next_position - int(boundary),
        index=jnp.int32(T - int(boundary)),
        step=jnp.int32(0),
        key_valid=jnp.concatenate([mask.astype(bool), jnp.ones((B, S - T), bool)], axis=1),
        live=jnp.any(mask.astype(bool), axis=1),
        prefix_end=jnp.int32(T - int(boundary)),
        # sharding hints (batch over "data", KV heads over "model"); no-ops without a mesh
        caches=jax.tree_util.tree_map(lambda c: KVCache(*sharding.constrain_cache(c.k, c.v)), caches,
                                      is_leaf=lambda c: isinstance(c, KVCache)),
        method_states=model.map_layers(lambda s: sharding.constrain_method_state(plan, s), states),
    )
    if not boundary:
        return (logits if all_logits else logits[:, -1]), state, aux
    logits, state, boundary_aux = _advance(model, plan, state, tokens[:, -1], boundary=True, data=data)
    # layers that skipped prefill built their method state (and prefill aux) from the boundary
    aux = [a if state_i is not None else b for a, b, state_i in zip(aux, boundary_aux, states)]
    return logits, state._replace(step=jnp.int32(0)), aux


def check_data(plan: Plan, data) -> None:
    """A plan that reads its method's calibrated data refuses to trace without it (one clear line
    instead of a KeyError deep inside the plan)."""
    if plan.requires_data and data is None:
        raise ValueError(f"the {plan.name} plan reads its method's calibrated data, and none was given: pass "
                         "data=method.data(model) of the prepared method (popjax.generate and forward do)")


def with_data(w: FFNWeights, data, image_tokens=None) -> FFNWeights:
    """A layer's FFN weights plus the method's calibrated data (``w.data``, [L, ...] leaves the
    plan indexes with ``w.layer``) and, in a prefill with images, the prompt's image-token mask
    (``w.image_tokens`` [B, T]); unchanged for a method without data and a text prompt."""
    if data is None and image_tokens is None:
        return w
    return w.replace(data=data, image_tokens=image_tokens)


def _advance(model, plan: Plan, state: DecodeState, token, boundary: bool = False, data=None):
    """Feeds token [B] through the decode path -> (logits [B, V], next state, per-layer aux).
    In the ``boundary`` step, layers without a method state (they skipped prefill) run the
    method's prefill on this token instead, which builds their state."""
    check_data(plan, data)
    valid = state.live[:, None]
    decode = lambda w, s, x, rows: plan.decode(with_data(w, data), s, x, state.step, rows)
    fn = decode
    if boundary:
        first = lambda w, _s, x, rows: plan.prefill(with_data(w, data), x, rows)
        fn = [decode if s is not None else first for s in state.method_states]
    # decode runs every layer; the layers a prefill control masked keep their mask
    control = plan.layer_control(model.cfg.num_hidden_layers, data)
    logits, caches, states, aux = model(
        ModelInputs(token[:, None], state.position[:, None]),
        cache=CacheView(state.caches, state.key_valid, state.index),
        ffn=FFNHook(fn, state.method_states, valid),
        layers=None if control is None else control.decode_view(state.prefix_end),
    )
    state = state._replace(
        position=state.position + 1,
        index=state.index + 1,
        step=state.step + 1,
        caches=caches,
        method_states=states,
    )
    return logits[:, 0], state, aux


def _choose(state: DecodeState, logits, key, sampling, stop_ids, pad_id):
    """Samples the next token of every live row (dead rows get ``pad_id``) and retires rows
    that produced a stop id -> (token [B], state)."""
    token = jnp.where(state.live, sample(logits, key, sampling), pad_id)
    return token, state._replace(live=state.live & ~jnp.isin(token, stop_ids))


def _generation_step(model, plan, carry: Sampler, sampling, stop_ids, pad_id, data=None):
    """The one step shared by the decode loop and streaming -> (carry, per-layer aux)."""
    logits, state, aux = _advance(model, plan, carry.state, carry.token, data=data)
    key, sub = jax.random.split(carry.key)
    token, state = _choose(state, logits, sub, sampling, stop_ids, pad_id)
    return Sampler(state, token, key), aux


@functools.partial(jax.jit, static_argnames=("graphdef", "plan", "all_logits", "with_aux"))
def prefill(graphdef, params, tokens, mask, plan: Plan, all_logits=False, with_aux=False, gates=None, data=None, images=None):
    """tokens, mask [B, T] -> (logits [B, V] at the last slot, or [B, T, V] with ``all_logits``;
    the prompt caches (L × KVCache [B, S ≥ T, n_kv, h], or a scanned model's stacked KVCache);
    method states (L, or stacked); aux stacked over layers). ``gates`` [L, B, T] are optional
    virtual layer gates (docs/methods.md §9; differentiable); ``data`` the method's calibrated
    data (`Method.data`); ``images`` a VLM prompt's `ImagePrompt`."""
    model = nnx.merge(graphdef, params)
    logits, state, aux = _prefill(model, plan, tokens, mask, 0, all_logits, gates, data, images)
    return logits, state.caches, state.method_states, stack_aux(aux) if with_aux else {}


@functools.partial(jax.jit, static_argnames=("graphdef", "plan", "capacity", "with_aux"))
def start(graphdef, params, plan: Plan, tokens, mask, key, sampling: SamplingParams, stop_ids, pad_id, capacity: int, with_aux=False,
          data=None, images=None):
    """Prefill + the first sampled token -> (Sampler, prefill aux stacked over layers)."""
    model = nnx.merge(graphdef, params)
    logits, state, aux = _prefill(model, plan, tokens, mask, capacity, data=data, images=images)
    key, sub = jax.random.split(key)
    token, state = _choose(state, logits, sub, sampling, stop_ids, pad_id)
    return Sampler(state, token, key), stack_aux(aux) if with_aux else {}


@functools.partial(jax.jit, static_argnames=("graphdef", "plan", "capacity", "trace"), donate_argnames=("carry",))
def decode_loop(graphdef, params, plan: Plan, carry: Sampler, max_new_tokens, sampling: SamplingParams, stop_ids, pad_id, capacity: int, trace: bool = False,
                data=None):
    """Generates until ``max_new_tokens`` (≤ capacity) tokens exist or no row is live.

    -> (tokens [B, capacity] (pad_id after a row stops; the first is ``carry.token``), number of
    tokens produced, trace, final carry) where ``trace`` maps each aux name to
    [capacity − 1, L, ...]. Returning the carry lets XLA alias the donated state to it: the
    loop then updates the caches in place instead of copying them in."""
    model = nnx.merge(graphdef, params)
    B = carry.token.shape[0]
    tokens = jnp.full((B, capacity), pad_id, jnp.int32).at[:, 0].set(carry.token)
    run = lambda c: _generation_step(model, plan, c, sampling, stop_ids, pad_id, data)
    if trace:
        aux_shape = jax.eval_shape(lambda c: stack_aux(run(c)[1]), carry)
        records = jax.tree_util.tree_map(lambda s: jnp.zeros((capacity - 1, *s.shape), s.dtype), aux_shape)
    else:
        records = {}

    def cond(loop):
        i, carry, _, _ = loop
        return (i < max_new_tokens) & jnp.any(carry.state.live)

    def body(loop):
        i, carry, tokens, records = loop
        carry, aux = run(carry)
        tokens = tokens.at[:, i].set(carry.token)
        if trace:
            records = jax.tree_util.tree_map(lambda buf, a: buf.at[i - 1].set(a), records, stack_aux(aux))
        return i + 1, carry, tokens, records

    steps, carry, tokens, records = jax.lax.while_loop(cond, body, (jnp.int32(1), carry, tokens, records))
    return tokens, steps, records, carry


@functools.partial(jax.jit, static_argnames=("graphdef", "plan"), donate_argnames=("carry",))
def stream_step(graphdef, params, plan: Plan, carry: Sampler, sampling: SamplingParams, stop_ids, pad_id, data=None):
    """One generation step alone (streaming): the decode loop's body, the carry donated ->
    (carry, the new token [B] as its own buffer, readable after the carry is donated again)."""
    model = nnx.merge(graphdef, params)
    carry = _generation_step(model, plan, carry, sampling, stop_ids, pad_id, data)[0]
    return carry, carry.token


@functools.partial(jax.jit, static_argnames=("graphdef", "plan", "with_logprobs", "record"))
def teacher_force(graphdef, params, plan: Plan, tokens, mask, targets, with_logprobs=False, record: tuple[str, ...] = (), data=None,
                  images=None):
    """Prefill a left-padded prompt, then feed ``targets`` [B, N] one at a time through the
    decode path -> (nll [B, N] of each target given everything before it, log-probabilities
    [B, N, V] if asked, else [B, N, 0], and the decode aux entries named in ``record``, each
    [N, L, ...] (the step that fed target i is entry i))."""
    model = nnx.merge(graphdef, params)
    B, N = targets.shape
    logits, state, _ = _prefill(model, plan, tokens, mask, N, data=data, images=images)

    def step(carry, target):
        logits, state = carry
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        nll = -jnp.take_along_axis(logp, target[:, None], axis=-1)[:, 0]
        logits, state, aux = _advance(model, plan, state, target, data=data)
        aux = stack_aux(aux) if record else {}
        kept = {name: aux[name] for name in record if name in aux}
        return (logits, state), (nll, logp if with_logprobs else jnp.zeros((B, 0)), kept)

    _, (nll, logp, records) = jax.lax.scan(step, (logits, state), targets.T)
    return nll.T, jnp.swapaxes(logp, 0, 1), records


def compile_counts() -> dict[str, int]:
    """How many executables each engine function holds (one per distinct static signature)."""
    functions = {"prefill": prefill, "start": start, "decode_loop": decode_loop, "stream_step": stream_step, "teacher_force": teacher_force}
    return {name: fn._cache_size() for name, fn in functions.items()}
