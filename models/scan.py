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
  The cache is thus updated in place, never copied per step (``write_slots`` says why the
  write is not inside the scan);
* the layer index reaches the method as ``weights["layer"]``, a traced int32: methods that pick
  per-layer calibrated constants by it work unchanged;
* a decode step scans the method states' arrays per layer but holds their kernel rows
  (`kernels.held_rows`) whole: each layer gets them as its layer of the stack, which a Pallas
  kernel reads by offset (a slice would be copied out for the call in every layer);
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

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..kernels import held_rows
from ..kernels.attention import NO_WINDOW, ring_from_prompt, ring_slots, ring_write
from .config import ModelConfig
from .decoder import DecoderLayer, Transformer, cache_attention
from .deepstack import add_deepstack
from .interface import CacheView, FFNHook, LayerControl, ModelInputs, ModelOutput
from .layers import KVCache, RMSNorm, TokenEmbeddings
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



def stacked_cache_attention(cfg: ModelConfig, caches, index, kind, key_valid, write_index):
    """The attention of layer ``index`` over stacked caches (read only), as `Attention` calls it
    (`models.decoder.cache_attention`): the one decode kernel, reading its blocks straight from
    the stack at (layer, block). With layer kinds (``kind``), a ``lax.cond`` reads the layer's
    own stack: the full layers' cache or the sliding layers' rings."""
    if kind is None:
        return cache_attention(caches, key_valid, write_index, None, False, at=(index,), write=False)

    def attend(q, k, v, scale):
        ring = lambda: cache_attention(caches.sliding, key_valid, write_index, kind.window, True, at=(kind.ordinal,), write=False)(q, k, v, scale)
        if not cfg.full_layers:
            return ring()
        full = lambda: cache_attention(caches.full, key_valid, write_index, None, False, at=(kind.ordinal,), write=False)(q, k, v, scale)
        return jax.lax.cond(kind.sliding, ring, full)

    return attend


def write_slots(cfg: ModelConfig, caches, fresh: KVCache, write_index):
    """Writes every layer's fresh keys/values k, v [L, B, T, n_kv, h] into the stacked cache at
    slot ``write_index`` with one ``dynamic_update_slice`` per array (in place on a donated
    cache); with layer kinds, the full layers' rows at ``write_index`` and the sliding layers'
    into their rings at ``write_index mod R``. Writing inside the scan, into a cache the same
    layer reads, made XLA copy the whole stacked cache in every layer of every step (seen in the
    compiled HLO); read-only inside the scan and written once after it, the cache is never copied."""
    zero = jnp.int32(0)
    at = (zero, zero, jnp.asarray(write_index, jnp.int32), zero, zero)
    write = lambda c, f: KVCache(jax.lax.dynamic_update_slice(c.k, f.k.astype(c.k.dtype), at),
                                 jax.lax.dynamic_update_slice(c.v, f.v.astype(c.v.dtype), at))
    if isinstance(caches, KVCache):
        return write(caches, fresh)
    rows = lambda idx: KVCache(fresh.k[np.array(idx, np.int32)], fresh.v[np.array(idx, np.int32)])
    full = write(caches.full, rows(cfg.full_layers)) if cfg.full_layers else caches.full
    sliding = rows(cfg.sliding_layers)
    rings = KVCache(ring_write(caches.sliding.k, sliding.k, write_index, axis=2),
                    ring_write(caches.sliding.v, sliding.v, write_index, axis=2))
    return KindCaches(full, rings)


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


def _with_layer_axis(state: nnx.State) -> nnx.State:
    """``state`` (a layer's variables, each already stacked [L, ...]) with the logical axis
    "layers" declared in front of each variable's own axes."""
    for _, variable in nnx.to_flat_state(state):
        variable.set_metadata(axes=("layers", *variable.get_metadata()["axes"]))
    return state


def _stack_template(cfg: ModelConfig, dtype: jnp.dtype) -> DecoderLayer:
    """A DecoderLayer whose every parameter has a leading [L] axis (zeros), declared "layers"."""
    graphdef, state = nnx.split(DecoderLayer(cfg, dtype, 0))
    L = cfg.num_hidden_layers
    return nnx.merge(graphdef, _with_layer_axis(jax.tree_util.tree_map(lambda a: jnp.zeros((L, *a.shape), a.dtype), state)))


class ScannedTransformer(nnx.Module, TokenEmbeddings):
    """Token embedding, L decoder layers stacked in ``layer_stack`` (run by ``lax.scan``), final
    norm and LM head. The call and results of ``Transformer``, and its layer body; caches and
    method states are stacked over layers instead of tuples of L."""

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

    def __call__(self, inputs: ModelInputs, *, cache: CacheView, ffn: FFNHook, layers: LayerControl | None = None,
                 last_only: bool = False) -> ModelOutput:
        """The call of `Transformer` (models/interface.py), over stacked layers: ``cache.caches``
        None (prefill: the returned caches are the fresh keys/values k, v [L, B, T, n_kv, h]) or
        one KVCache [L, B, S, n_kv, h] (or `KindCaches`), written at ``cache.write_index`` after
        the scan and returned; ``ffn.states`` None or stacked over layers; states and aux come
        back stacked over layers ([L, ...] leaves). A ``layers`` control that treats layers
        differently (skips, K/V projections, prefix masks, gates) is refused: it needs the
        unrolled model. Each scan step runs `DecoderLayer`, the unrolled model's layer body."""
        fn = _single_ffn_fn(ffn.fn)
        if layers is not None and not layers.uniform:
            raise ValueError(f"{layers.describe()}: a layer control that treats layers differently (skipped layers, K/V "
                             f"projections, prefix masks, virtual gates) is not supported by a scanned model; {UNROLLED}")
        states = ffn.states
        if isinstance(states, (list, tuple)) and all(s is None for s in states):
            states = None  # the unrolled model's "no state for any layer"
        cfg = self.cfg
        x = self.embed_inputs(inputs.tokens, inputs.placed)
        rope = layer_rope(cfg, inputs.positions)
        kinds = _kinds(cfg)
        graphdef, params = nnx.split(self.layer_stack)
        per_layer = None if kinds is None else jax.tree_util.tree_map(jnp.asarray, kinds)
        caches = cache.caches
        # a decode step holds the kernel rows of the states whole (`held_rows`: a Pallas call
        # would copy a slice of them out per layer); a MoE layer maps its states over experts
        held = held_rows.hold(states) if caches is not None and states is not None and cfg.moe is None else None
        xs = (jnp.arange(cfg.num_hidden_layers, dtype=jnp.int32), params, states if held is None else held.sliced, per_layer)

        def angles(kind):  # this layer's rotary angles (a sliding layer may have its own base)
            if kind is None or len(rope) == 1:
                return next(iter(rope.values()))
            pick = lambda a, b: jnp.where(kind.sliding, a, b)
            (cs, ss), (cf, sf) = rope["sliding_attention"], rope["full_attention"]
            return pick(cs, cf), pick(ss, sf)

        def layer_step(x, layer_xs):  # prefill: no cache; decode: read the stacked cache(s), in place
            index, layer_params, state, kind = layer_xs
            layer = nnx.merge(graphdef, layer_params)
            cos, sin = angles(kind)
            attend = None if caches is None else stacked_cache_attention(cfg, caches, index, kind, cache.key_valid,
                                                                         cache.write_index)
            window = None if kind is None else kind.window
            given = state if held is None else held_rows.layer_state(held, state, index)
            x, fresh, state, aux = layer(x, cos, sin, cache.key_valid, attend, fn, given, ffn.valid, index, window=window)
            x = add_deepstack(x, inputs.placed, index)  # a VLM's DeepStack features after its first layers
            return x, (fresh, state if held is None else held_rows.release(held, state, given), aux)

        x, (fresh, states, aux) = jax.lax.scan(layer_step, x, xs)
        states = states if held is None else held_rows.restore(held, states)
        # decode: every layer's fresh slots are written after the scan, in one update (`write_slots`)
        new_caches = fresh if caches is None else write_slots(cfg, caches, fresh, cache.write_index)
        if last_only:
            x = x[:, -1:]
        return ModelOutput(self.logits(x), new_caches, states, aux)


def _single_ffn_fn(fn):
    """One FFN function for all layers (a sequence of one per layer is accepted when its entries
    are the same function: a scan runs one layer body)."""
    if not isinstance(fn, (list, tuple)):
        return fn
    if any(f is not fn[0] for f in fn):
        raise ValueError(
            f"the FFN hook holds {len(set(map(id, fn)))} different per-layer functions: a scanned model runs one "
            f"FFN function in every layer; {UNROLLED}"
        )
    return fn[0]


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
    stacked = _with_layer_axis(jax.tree_util.tree_map(lambda *leaves: jnp.stack(leaves), *states))
    out = nnx.eval_shape(lambda: ScannedTransformer(model.cfg, model.compute_dtype))
    for name, variable in vars(model).items():  # the embedding and head parameters the weight format has
        if isinstance(variable, nnx.Variable):
            setattr(out, name, type(variable)(variable[...], axes=variable.get_metadata()["axes"]))
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
