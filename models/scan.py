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

from .attention import NO_WINDOW, ring_from_prompt, ring_slots
from .config import ModelConfig
from .decoder import DecoderLayer, MLPFn, Transformer
from .layers import KVCache, PlacedEmbeddings, RMSNorm, TokenEmbeddings
from .rope import check_rope_type, layer_rope
from .stacked_attention import KindCaches, stacked_cache_attention, write_slots

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
        placed: PlacedEmbeddings | None = None,
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
        x = self.embed_inputs(tokens, placed)
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
                attn_out, fresh = stacked_cache_attention(
                    layer, layer.attn_norm(x), cos, sin, key_valid, caches, index, write_index, kind
                )
                x = x + attn_out
                y, state, aux = layer.feed_forward(x, fn, state, index)
                return x + y, (fresh, state, aux)

            x, (fresh, states, aux) = jax.lax.scan(decode_layer, x, xs)
            caches = write_slots(cfg, caches, fresh, write_index)
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
