"""Scanned decoder layers: the L layers' parameters stacked once on a leading [L] axis and run
by one ``jax.lax.scan`` step, so a program holds one layer's code instead of L copies.

XLA compiles a Python loop over layers as L inlined copies of the layer; compile time grows
with depth (docs/performance.md, "Scanned layers", measures it). ``ScannedTransformer`` runs
the same math as ``Transformer`` (same embedding, final norm, LM head and layer code:
``DecoderLayer.feed_forward`` and the attention projections) over stacked parameters:

* parameters ``layer_stack.*`` [L, ...] are stacked ONCE, when the model is built
  (``scan_layers(model)`` or ``popjax.load(..., scan_layers=True)``), never inside a jitted
  call, which would copy every weight per call;
* the KV cache is one ``KVCache`` k, v [L, B, S, n_kv, h] and the method states one pytree with
  a leading [L] axis. In a decode step each layer reads its earlier slots block by block straight
  from the stacked buffer, at (layer, block) (slicing a layer out first would copy it), and
  attends to its fresh keys/values directly; the scan emits only those fresh slots
  [L, B, T, n_kv, h], written after it with one ``dynamic_update_slice`` at (0, write_index).
  The cache is thus updated in place, never copied per step (``_write_slots`` says why the
  write is not inside the scan);
* the layer index reaches the method as ``weights["layer"]``, a traced int32: methods that pick
  per-layer calibrated constants by it work unchanged;
* mixed layer types (Gemma 3: sliding-window and full layers): the caches are `KindCaches`, one
  stack per kind — full layers [L_f, B, S, ...], sliding layers' ring buffers [L_s, B, R, ...] —
  and each layer reads its own with a ``lax.cond`` on its kind (its position in its kind's stack
  and its window are scanned over with the parameters); its rotary angles are its kind's.

Scope: identical layers. Per-layer FFN widths (structurally pruned checkpoints), MoE models mixing
dense and expert layers, layers with extra parameters, per-layer schedules (layers that skip or
only project K/V) and virtual layer gates raise a ValueError that names the
value and points to the unrolled model, which the calibration/analysis code (walking
``model.layers[i]``) keeps using.

Shapes: L layers, B batch, T tokens fed, S cache slots, d hidden, V vocabulary.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from typing import NamedTuple

from .attention import (KV_BLOCK, MASKED, NO_WINDOW, attention_scores, finish_softmax, group_queries, init_softmax_carry,
                        online_softmax_update, ring_attention, ring_from_prompt, ring_slots, ring_write)
from .config import ModelConfig
from .decoder import DecoderLayer, MLPFn, Transformer
from .layers import KVCache, RMSNorm, TokenEmbeddings, linear
from .rope import check_rope_type, layer_rope

UNROLLED = "use the unrolled model (popjax.load(..., scan_layers=False), models.Transformer)"


def check_scannable(cfg: ModelConfig) -> None:
    """Raises ValueError unless every layer of ``cfg`` has the same parameter structure."""
    if cfg.intermediate_sizes is not None:
        raise ValueError(
            f"intermediate_sizes={list(cfg.intermediate_sizes)}: a scanned model needs one FFN width for every "
            f"layer (this checkpoint was pruned to per-layer widths, popjax.pruned); {UNROLLED}"
        )
    moe = cfg.moe
    if moe is not None and tuple(moe.sparse_layers) not in ((), tuple(range(cfg.num_hidden_layers))):
        raise ValueError(
            f"moe.sparse_layers={list(moe.sparse_layers)} of {cfg.num_hidden_layers} layers: a scanned model needs "
            f"every layer alike, but this MoE model mixes dense and expert layers; {UNROLLED}"
        )


class KindCaches(NamedTuple):
    """A scanned model's caches when it has sliding-window layers: the full layers' k, v
    [L_f, B, S, n_kv, h] and the sliding layers' rings [L_s, B, R, n_kv, h] (in layer order)."""

    full: KVCache
    sliding: KVCache


class _Kinds(NamedTuple):
    """Per-layer scan inputs of a model with sliding layers (static: numpy)."""

    sliding: np.ndarray  # [L] bool
    ordinal: np.ndarray  # [L] int32: the layer's position in its kind's cache stack
    window: np.ndarray  # [L] int32: its window (NO_WINDOW for a full layer)


def _kinds(cfg: ModelConfig) -> _Kinds | None:
    if not cfg.sliding_layers:
        return None
    sliding = np.array([cfg.window(i) is not None for i in range(cfg.num_hidden_layers)])
    ordinal = np.zeros(cfg.num_hidden_layers, np.int32)
    ordinal[sliding] = np.arange(sliding.sum())
    ordinal[~sliding] = np.arange((~sliding).sum())
    window = np.array([cfg.window(i) or NO_WINDOW for i in range(cfg.num_hidden_layers)], np.int32)
    return _Kinds(sliding, ordinal, window)


def _stack_template(cfg: ModelConfig, dtype: jnp.dtype) -> DecoderLayer:
    """A DecoderLayer whose every parameter has a leading [L] axis (zeros)."""
    graphdef, state = nnx.split(DecoderLayer(cfg, dtype, 0))
    L = cfg.num_hidden_layers
    return nnx.merge(graphdef, jax.tree_util.tree_map(lambda a: jnp.zeros((L, *a.shape), a.dtype), state))


class ScannedTransformer(nnx.Module, TokenEmbeddings):
    """Token embedding, L decoder layers stacked in ``layer_stack`` (run by ``lax.scan``), final
    norm and LM head. Same call signature and results as ``Transformer``; caches and method
    states are stacked over layers instead of tuples of L."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype = jnp.float32):
        check_rope_type(cfg)
        check_scannable(cfg)
        self.cfg = cfg
        self._embedding_params(cfg, dtype)
        self.layer_stack = _stack_template(cfg, dtype)
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    logits = Transformer.logits  # h [B, T, d] -> fp32 logits [B, T, V], the very same code

    def finalize(self) -> None:
        """Derived constants (‖W_d[:, j]‖₂ ...) of every layer: each layer's own ``finalize``
        mapped over the stacked axis."""
        graphdef, state = nnx.split(self.layer_stack)

        def one(layer_state):
            layer = nnx.merge(graphdef, layer_state)
            layer.mlp.finalize()
            return nnx.split(layer)[1]

        nnx.update(self.layer_stack, jax.vmap(one)(state))

    def init_caches(self, prompt: KVCache, prompt_slots: int, slots: int) -> KVCache | KindCaches:
        """The decode caches from the prefill's stacked fresh keys/values k, v [L, B, T, n_kv, h]:
        one stack [L, B, S, ...] (the prompt at slots 0..T−1), or with sliding layers
        `KindCaches` (their rings of `ring_slots` slots)."""
        grow = lambda a: jnp.zeros((*a.shape[:2], slots, *a.shape[3:]), a.dtype).at[:, :, :prompt_slots].set(a)
        cfg = self.cfg
        if not cfg.sliding_layers:
            return KVCache(grow(prompt.k), grow(prompt.v))
        full, sliding = np.array(cfg.full_layers, np.int32), np.array(cfg.sliding_layers, np.int32)
        ring = ring_slots(cfg.sliding_window, slots)
        to_ring = jax.vmap(lambda a: ring_from_prompt(a, prompt_slots, ring))
        return KindCaches(KVCache(grow(prompt.k[full]), grow(prompt.v[full])),
                          KVCache(to_ring(prompt.k[sliding]), to_ring(prompt.v[sliding])))

    def map_layers(self, fn: Callable, *stacked: Any) -> Any:
        """fn on each layer's entry of trees stacked over layers (the engine's caches and method
        states) -> the results stacked again (``jax.vmap`` over the [L] axis)."""
        if not jax.tree_util.tree_leaves(stacked):  # e.g. the (None) states of a stateless method
            return fn(*stacked)
        return jax.vmap(fn)(*stacked)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        key_valid: jax.Array,
        mlp_fn: MLPFn,
        mlp_states: Any,
        caches: KVCache | None = None,
        write_index: jax.Array | int = 0,
        last_only: bool = False,
        gates: jax.Array | None = None,
        schedule: Any = None,
        kv_weights: Any = None,
        prefix_end: jax.Array | int = 0,
    ) -> tuple[jax.Array, KVCache, Any, Any]:
        """tokens, positions [B, T]; key_valid [B, S] -> (logits [B, T or 1, V], caches, states, aux).

        ``mlp_states``: None (prefill; a sequence of Nones is accepted too) or the states stacked
        over layers. ``caches``: None (prefill: the returned caches are the fresh keys/values
        k, v [L, B, T, n_kv, h]) or one KVCache [L, B, S, n_kv, h], written at ``write_index``
        and returned. States and aux come back stacked over layers ([L, ...] leaves).
        ``gates``, a ``schedule`` and ``kv_weights`` (per-layer steering, see Transformer) are
        refused: they need the unrolled model."""
        fn = _single_mlp_fn(mlp_fn)
        _check_uniform(gates, schedule, kv_weights)
        if isinstance(mlp_states, (list, tuple)) and all(s is None for s in mlp_states):
            mlp_states = None  # the unrolled model's "no state for any layer"
        cfg = self.cfg
        x = self.embed_tokens(tokens)
        rope = layer_rope(cfg, positions)
        kinds = _kinds(cfg)
        graphdef, params = nnx.split(self.layer_stack)
        per_layer = None if kinds is None else jax.tree_util.tree_map(jnp.asarray, kinds)
        xs = (jnp.arange(cfg.num_hidden_layers, dtype=jnp.int32), params, mlp_states, per_layer)

        def angles(kind):  # this layer's rotary angles (a sliding layer may have its own base)
            if kind is None or len(rope) == 1:
                return next(iter(rope.values()))
            pick = lambda a, b: jnp.where(kind.sliding, a, b)
            (cs, ss), (cf, sf) = rope["sliding_attention"], rope["full_attention"]
            return pick(cs, cf), pick(ss, sf)

        if caches is None:  # prefill: each layer's fresh keys/values leave the scan as outputs

            def prefill_layer(x, layer_xs):
                index, layer_params, state, kind = layer_xs
                layer = nnx.merge(graphdef, layer_params)
                cos, sin = angles(kind)
                window = None if kind is None else kind.window
                x, cache, state, aux = layer(x, cos, sin, key_valid, None, 0, fn, state, None, index, window=window)
                return x, (cache, state, aux)

            x, (caches, states, aux) = jax.lax.scan(prefill_layer, x, xs)
        else:  # decode: layers read the stacked cache(s); their new slots are written after the scan

            def decode_layer(x, layer_xs):
                index, layer_params, state, kind = layer_xs
                layer = nnx.merge(graphdef, layer_params)
                cos, sin = angles(kind)
                attn_out, fresh = _stacked_cache_attention(
                    layer, layer.attn_norm(x), cos, sin, key_valid, caches, index, write_index, kind
                )
                x = x + attn_out
                y, state, aux = layer.feed_forward(x, fn, state, index)
                return x + y, (fresh, state, aux)

            x, (fresh, states, aux) = jax.lax.scan(decode_layer, x, xs)
            caches = _write_slots(cfg, caches, fresh, write_index)
        if last_only:
            x = x[:, -1:]
        return self.logits(x), caches, states, aux


def _single_mlp_fn(mlp_fn):
    """One MLP function for all layers (a sequence of one per layer is accepted when its entries
    are the same function: a scan runs one layer body)."""
    if not isinstance(mlp_fn, (list, tuple)):
        return mlp_fn
    if any(f is not mlp_fn[0] for f in mlp_fn):
        raise ValueError(
            f"mlp_fn holds {len(set(map(id, mlp_fn)))} different per-layer functions: a scanned model runs one "
            f"MLP function in every layer; {UNROLLED}"
        )
    return mlp_fn[0]


def _check_uniform(gates, schedule, kv_weights) -> None:
    if schedule is not None and (set(schedule.modes) != {"full"} or schedule.prefix_masked):
        raise ValueError(
            f"schedule={schedule}: per-layer schedules (layers that skip or only project K/V, per-layer "
            f"attention masks) are not supported by a scanned model; {UNROLLED}"
        )
    if kv_weights:
        raise ValueError(f"kv_weights for layers {sorted(kv_weights)} are not supported by a scanned model; {UNROLLED}")
    if gates is not None:
        raise ValueError(
            f"gates of shape {tuple(gates.shape)}: virtual layer gates (per-layer importance) are not "
            f"supported by a scanned model; {UNROLLED}"
        )


def _stacked_cache_attention(layer: DecoderLayer, x, cos, sin, key_valid, caches, index, write_index, kind):
    """``Attention.__call__``'s cached path for layer ``index`` of stacked caches (read only):
    x [B, T, d] -> (out [B, T, d] after the layer's post-attention norm, if any; this layer's
    fresh KVCache [B, T, n_kv, h] for ``_write_slots``). With layer kinds (``kind``), a
    ``lax.cond`` reads the layer's own stack: the full layers' cache or the sliding layers' rings."""
    attn = layer.attn
    q, k, v = attn.rotated_qkv(x, cos, sin)
    dtype = (caches.k if isinstance(caches, KVCache) else caches.sliding.k).dtype
    k, v = k.astype(dtype), v.astype(dtype)
    if kind is None:
        out = _layer_cached_attention(q, k, v, caches, index, key_valid, write_index, attn.scale)
    else:
        full = lambda: _layer_cached_attention(q, k, v, caches.full, kind.ordinal, key_valid, write_index, attn.scale)
        ring = lambda: _layer_ring_attention(q, k, v, caches.sliding, kind, key_valid, write_index, attn.scale)
        out = jax.lax.cond(kind.sliding, ring, full) if layer.cfg.full_layers else ring()
    out = linear(out.reshape(*x.shape[:2], attn.cfg.q_dim), attn.weight("o"))
    if layer.cfg.sandwich_norms:
        out = layer.attn_post_norm(out)
    return out, KVCache(k, v)


def _layer_ring_attention(q, k, v, rings: KVCache, kind, key_valid, write_index, scale) -> jax.Array:
    """`models.attention.ring_attention` for the sliding layer at ``kind.ordinal`` of stacked rings
    k, v [L_s, B, R, n_kv, h], read block by block straight from the stack."""
    B, R = rings.k.shape[1], rings.k.shape[2]
    zero = jnp.int32(0)

    def read(start, size):
        at = (kind.ordinal, zero, jnp.asarray(start, jnp.int32), zero, zero)
        shape = (1, B, size, *rings.k.shape[3:])
        return jax.lax.dynamic_slice(rings.k, at, shape)[0], jax.lax.dynamic_slice(rings.v, at, shape)[0]

    return ring_attention(q, k, v, read, R, key_valid, write_index, kind.window, scale)


def _write_slots(cfg: ModelConfig, caches, fresh: KVCache, write_index):
    """Writes every layer's fresh keys/values k, v [L, B, T, n_kv, h] into the stacked cache at
    slot ``write_index`` with one ``dynamic_update_slice`` per array (in place on a donated
    cache); with layer kinds, the full layers' rows at ``write_index`` and the sliding layers'
    into their rings at ``write_index mod R``. Writing inside the scan, into a cache the same
    layer reads, made XLA copy the whole stacked cache in every layer of every step (seen in the
    compiled HLO); read-only inside the scan and written once after it, the cache is never copied."""
    zero = jnp.int32(0)
    at = (zero, zero, jnp.asarray(write_index, jnp.int32), zero, zero)
    write = lambda c, f: KVCache(jax.lax.dynamic_update_slice(c.k, f.k, at), jax.lax.dynamic_update_slice(c.v, f.v, at))
    if isinstance(caches, KVCache):
        return write(caches, fresh)
    rows = lambda idx: KVCache(fresh.k[np.array(idx, np.int32)], fresh.v[np.array(idx, np.int32)])
    full = write(caches.full, rows(cfg.full_layers)) if cfg.full_layers else caches.full
    sliding = rows(cfg.sliding_layers)
    rings = KVCache(ring_write(caches.sliding.k, sliding.k, write_index, axis=2),
                    ring_write(caches.sliding.v, sliding.v, write_index, axis=2))
    return KindCaches(full, rings)


def _layer_cached_attention(q, k, v, cache: KVCache, layer, key_valid, write_index, scale=None) -> jax.Array:
    """``models.attention.cached_attention`` for layer ``layer`` of a stacked cache k, v
    [L, B, S, n_kv, h]: q, k, v [B, T, ·, h] of the T tokens at slots ``write_index ..`` ->
    [B, T, n_q, h]. The earlier slots are read block by block straight from the stacked buffer,
    at (layer, block) (slicing the layer out first would copy it); the T fresh keys/values come
    from k, v, which are not in the cache yet (``_write_slots``)."""
    B, T, n_q, h = q.shape
    S, n_kv = cache.k.shape[2], cache.k.shape[3]
    qg = group_queries(q, n_kv)
    bs = min(KV_BLOCK, S)
    if S % bs:
        raise ValueError(f"cache of {S} slots is not a multiple of the {bs}-slot block; size it with cache_slots()")
    layer = jnp.asarray(layer, jnp.int32)
    zero = jnp.int32(0)

    def key_block(j, carry):
        at = (layer, zero, (j * bs).astype(jnp.int32), zero, zero)
        k_j = jax.lax.dynamic_slice(cache.k, at, (1, B, bs, n_kv, h))[0]
        v_j = jax.lax.dynamic_slice(cache.v, at, (1, B, bs, n_kv, h))[0]
        valid_j = jax.lax.dynamic_slice_in_dim(key_valid, j * bs, bs, axis=1)
        mask = valid_j & (j * bs + jnp.arange(bs) < write_index)[None]  # [B, bs]: earlier slots only
        scores = jnp.where(mask[:, None, None, None], attention_scores(qg, k_j, scale), MASKED)
        return online_softmax_update(carry, scores, v_j)

    n_blocks = (write_index + bs - 1) // bs
    carry = jax.lax.fori_loop(0, n_blocks, key_block, init_softmax_carry(B, n_kv, n_q // n_kv, T, h))
    fresh_valid = jax.lax.dynamic_slice_in_dim(key_valid, write_index, T, axis=1)  # [B, T]
    causal = jnp.arange(T)[None, :] <= jnp.arange(T)[:, None]  # [T query, T key]
    mask = fresh_valid[:, None, :] & causal[None]  # [B, T, T]
    scores = jnp.where(mask[:, None, None], attention_scores(qg, k, scale), MASKED)
    carry = online_softmax_update(carry, scores, v)
    return finish_softmax(carry, cache.v.dtype).reshape(B, T, n_q, h)


# ------------------------------------------------------------------- building


def _signature(layer: DecoderLayer) -> dict[str, tuple]:
    """path -> (shape, dtype) of every array of a layer."""
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.split(layer)[1]))[0]
    return {".".join(str(getattr(k, "key", k)) for k in path): (tuple(a.shape), str(a.dtype)) for path, a in flat}


def _check_identical_layers(model: Transformer) -> None:
    graphdef0, first = nnx.split(model.layers[0])[0], _signature(model.layers[0])
    for i, layer in enumerate(model.layers):
        signature = _signature(layer)
        for path in sorted(set(first) | set(signature)):
            if first.get(path) != signature.get(path):
                mine, theirs = signature.get(path, "absent"), first.get(path, "absent")
                raise ValueError(
                    f"layer {i}'s {path} is {mine} but layer 0's is {theirs}: a scanned model needs identical "
                    f"layers; {UNROLLED}"
                )
        if nnx.split(layer)[0] != graphdef0:
            raise ValueError(f"layer {i}'s structure differs from layer 0's: a scanned model needs identical layers; {UNROLLED}")


def _copy(module: nnx.Module) -> nnx.Module:
    return nnx.merge(*nnx.split(module))


def scan_layers(model: Transformer) -> ScannedTransformer:
    """The same model with its layers' parameters (and derived constants) stacked on a leading
    [L] axis: done once, eagerly, outside any jit. ValueError if the layers differ."""
    check_scannable(model.cfg)
    _check_identical_layers(model)
    graphdef = nnx.split(model.layers[0])[0]
    states = [nnx.split(layer)[1] for layer in model.layers]
    stacked = jax.tree_util.tree_map(lambda *leaves: jnp.stack(leaves), *states)
    out = nnx.eval_shape(lambda: ScannedTransformer(model.cfg, model.compute_dtype))
    for name in ("embed", "embed_scale", "lm_head", "lm_head_scale"):  # those the weight format has
        if hasattr(model, name):
            setattr(out, name, nnx.Param(getattr(model, name)[...]))
    out.layer_stack = nnx.merge(graphdef, stacked)
    out.final_norm = _copy(model.final_norm)
    return out


def abstract_scanned_model(cfg: ModelConfig, dtype: jnp.dtype = jnp.float32) -> ScannedTransformer:
    """A ScannedTransformer with shape-only arrays (no allocation), for loading into."""
    return nnx.eval_shape(lambda: ScannedTransformer(cfg, dtype))


def stack_layer_tree(tree: dict[str, Any], n_layers: int, stack: Callable[[str, list], Any] | None = None) -> dict[str, Any]:
    """A checkpoint tree in the module's layout (``layers.{i}.*``, str keys) -> the scanned
    layout: ``layer_stack.*`` holds each tensor of every layer stacked [L, ...]. ``stack(name,
    leaves)`` (name e.g. ``mlp.gate_up``) stacks one tensor kind; default: ``np.stack`` on the
    host. ``tree["layers"]`` is consumed (emptied), and each kind's per-layer arrays are dropped
    once stacked, so the peak is the weights plus one tensor kind, not twice the weights."""
    stack = stack or (lambda _name, leaves: np.stack([np.asarray(a) for a in leaves]))
    by_layer = tree["layers"]
    treedef = jax.tree_util.tree_structure(by_layer["0"])
    flat = [dict(jax.tree_util.tree_flatten_with_path(by_layer[str(i)])[0]) for i in range(n_layers)]
    by_layer.clear()
    stacked = []
    for path in list(flat[0]):
        stacked.append(stack(".".join(str(k.key) for k in path), [f.pop(path) for f in flat]))
    rest = {k: v for k, v in tree.items() if k != "layers"}
    return {**rest, "layer_stack": jax.tree_util.tree_unflatten(treedef, stacked)}
