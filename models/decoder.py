"""The decoder shared by every family (LLaMA, Qwen2/3, their MoE variants, Gemma 3, Qwen2-VL's
text model): switches live in `ModelConfig`.

    model(inputs, *, cache, ffn, layers=None, last_only=False) -> ModelOutput   (models/interface.py)

Every layer's FFN runs the caller's function (``ffn.fn``: the dense MLP, or whatever a pruning
method runs instead) on `FFNWeights`; what a method does to whole layers arrives as one
`LayerControl`. The model knows no pruning: it has no branch for any particular method.
``DecoderLayer`` is the one layer body: this unrolled model runs it over its L layers, and the
scanned model (models/scan.py) runs the very same body in a ``lax.scan`` over stacked parameters.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from ..kernels.attention import cache_reader, cached_attention, ring_from_prompt, ring_slots, ring_write
from .config import ModelConfig
from .interface import CacheView, FFNFn, FFNHook, LayerControl, ModelInputs, ModelOutput
from .deepstack import add_deepstack
from .layers import Attention, KVCache, MLPWeights, RMSNorm, TokenEmbeddings
from .moe import MoEWeights, moe_mlp
from ..kernels.int8 import dot
from .rope import check_rope_type, layer_rope


def cache_attention(cache: KVCache, key_valid: jax.Array, write_index, window, ring: bool, at: tuple = (),
                    write: bool = True) -> Callable:
    """The attention of T fresh tokens over a cache k, v [..., B, S, n_kv, h] (``at``: the
    leading indices of a stacked cache) as `Attention` calls it: ``(q, k, v, scale) -> (out, kv)``,
    around the one decode kernel `kernels.attention.cached_attention`. ``write``: ``kv`` is the
    cache with the fresh entries written at ``write_index`` (into the arrays the kernel's block
    loop hands back: written before they are read, so XLA updates the cache in place, see
    `kernels.attention.cached_attention`); else ``kv`` is the fresh entries [B, T, n_kv, h] (a
    scanned model writes them after its scan)."""
    slots = cache.k.shape[len(at) + 1]

    def attend(q, k, v, scale):
        k, v = k.astype(cache.k.dtype), v.astype(cache.v.dtype)
        fresh = KVCache(k, v)
        if not write:
            return cached_attention(q, k, v, cache_reader(cache.k, cache.v, at), slots, key_valid, write_index, window, scale, ring)[0], fresh
        if ring and k.shape[1] > 1:  # a ring takes several tokens only after they were read (`cached_attention`)
            out, reader = cached_attention(q, k, v, cache_reader(cache.k, cache.v, at), slots, key_valid, write_index, window, scale, ring)
            return out, _write(KVCache(reader.k, reader.v), fresh, write_index, ring)
        written = _write(cache, fresh, write_index, ring)
        out, reader = cached_attention(q, k, v, cache_reader(written.k, written.v, at), slots, key_valid, write_index, window, scale, ring,
                                       written=True)
        return out, KVCache(reader.k, reader.v)

    return attend


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, index: int = 0):
        self.cfg = cfg
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attn = Attention(cfg, dtype)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if cfg.sandwich_norms:  # Gemma: norms on the attention and FFN outputs, before each residual add
            self.attn_post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
            self.mlp_post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        # a MoE model's FFN is a stack of expert blocks (models/moe.py), each run by mlp_fn
        self.mlp = MoEWeights(cfg, dtype, index) if cfg.moe is not None else MLPWeights(cfg, dtype)

    def __call__(self, x, cos, sin, key_valid, attend_cache, fn: FFNFn, state, valid, index=0, window: Any = "layer",
                 gate=None):
        """x [B, T, d] -> (x [B, T, d], kv, state, aux): ``kv`` the T tokens' fresh KVCache
        [B, T, n_kv, h], or what ``attend_cache`` returned for them (the layer's written cache).
        cos/sin [B, T, h] are the angles of this layer's kind; ``attend_cache`` None (prefill) or
        the attention over the cache (`cache_attention`); ``fn``/``state``/``valid`` the FFN
        hook's function, this layer's state and the valid tokens [B, T].

        ``index`` (the layer's position; traced in a scanned model) reaches the FFN function as
        ``FFNWeights.layer``. ``window``: the sliding window, by default the one ``cfg`` gives
        layer ``index`` (a scanned model, whose index is traced, passes its own). ``gate`` [B, T]
        (optional) scales both residual branches, ``x + g·Attn(x)`` and ``y + g·FFN(y)``."""
        window = self.cfg.window(index) if isinstance(window, str) else window
        attn_out, kv = self.attn(self.attn_norm(x), cos, sin, key_valid, attend_cache, window)
        if self.cfg.sandwich_norms:
            attn_out = self.attn_post_norm(attn_out)
        if gate is not None:
            attn_out = attn_out * gate[..., None].astype(attn_out.dtype)
        x = x + attn_out
        y, state, aux = self.feed_forward(x, fn, state, valid, index)
        if gate is not None:
            y = y * gate[..., None].astype(y.dtype)
        return x + y, kv, state, aux

    def feed_forward(self, x, fn: FFNFn, state, valid, index=0):
        """The FFN branch on the residual stream x [B, T, d] -> (y [B, T, d] in x's dtype, state,
        aux); the caller adds y to x. A structurally pruned checkpoint's ``down_bias`` is added
        here, whatever the method."""
        h = self.mlp_norm(x)
        layer = jnp.asarray(index, jnp.int32)
        if isinstance(self.mlp, MoEWeights):
            y, state, aux = moe_mlp(self.mlp, fn, state, h, valid, layer)
        else:
            y, state, aux = fn(self.mlp.ffn_weights(layer), state, h, valid)
            if hasattr(self.mlp, "down_bias"):
                y = y + self.mlp.down_bias[...]
        if self.cfg.sandwich_norms:
            y = self.mlp_post_norm(y.astype(x.dtype))
        return y.astype(x.dtype), state, aux


class Transformer(nnx.Module, TokenEmbeddings):
    """Token embedding, L decoder layers, final norm and LM head (tied or untied)."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype = jnp.float32):
        check_rope_type(cfg)
        self.cfg = cfg
        self._embedding_params(cfg, dtype)
        self.layers = nnx.List([DecoderLayer(cfg, dtype, i) for i in range(cfg.num_hidden_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def finalize(self) -> None:
        """Computes derived per-model constants after the weights are loaded."""
        for layer in self.layers:
            layer.mlp.finalize()

    def map_layers(self, fn: Callable, *per_layer: Sequence[Any]) -> tuple:
        """fn on each layer's entries of per-layer sequences (the engine's caches and method
        states) -> a tuple over layers (models.scan.ScannedTransformer maps its stacked axis)."""
        return tuple(fn(*entries) for entries in zip(*per_layer))

    def logits(self, h: jax.Array) -> jax.Array:
        """h [B, T, d] -> fp32 logits [B, T, V] (soft-capped, c·tanh(z / c), when the config says)."""
        h = self.final_norm(h)
        logits = dot("btd,vd->btv", h, self.lm_head_weight(), preferred_element_type=jnp.float32)  # head [V, d]
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else jnp.tanh(logits / cap) * cap

    def init_caches(self, prompt: Sequence[KVCache], prompt_slots: int, slots: int) -> tuple[KVCache, ...]:
        """The decode caches from a prefill's fresh keys/values (``prompt[i]`` [B, n ≤ T, n_kv, h]:
        the last n of the ``prompt_slots`` prompt indices): a full layer's cache has ``slots``
        slots with the prompt at 0..T−1; a sliding layer's is a ring of `ring_slots` slots."""
        out = []
        for i, cache in enumerate(prompt):
            window = self.cfg.window(i)
            if window is None:
                grow = lambda a: jnp.zeros((a.shape[0], slots, *a.shape[2:]), a.dtype).at[:, : a.shape[1]].set(a)
            else:
                grow = lambda a: ring_from_prompt(a, prompt_slots, ring_slots(window, slots))
            out.append(KVCache(grow(cache.k), grow(cache.v)))
        return tuple(out)

    def __call__(self, inputs: ModelInputs, *, cache: CacheView, ffn: FFNHook, layers: LayerControl | None = None,
                 last_only: bool = False) -> ModelOutput:
        """inputs: tokens, positions [B, T] -> `ModelOutput`: logits [B, T or 1, V], caches and
        FFN states (tuples over layers), aux (a list over layers).

        With ``cache.caches`` None the T tokens attend to each other (prefill) and the returned
        caches are their fresh keys/values [B, T, n_kv, h]; otherwise each layer's are written at
        ``cache.write_index`` (a sliding layer's ring at that index mod its slots). ``layers``
        (`LayerControl`) says what each layer does in this call: "full", "kv" (only project keys/
        values, with its own rows or the control's ``kv_weights``) or "none"; its
        ``prefix_masked`` layers ignore cache slots before ``prefix_end``; its ``gates`` scale
        both residual branches of each layer. ``inputs.placed`` (optional) puts embeddings at
        some token slots (a VLM's image features, and Qwen3-VL's DeepStack features, added after
        the first layers: models/deepstack.py); positions may then be M-RoPE's [3, B, T]."""
        control = LayerControl() if layers is None else layers
        x = self.embed_inputs(inputs.tokens, inputs.placed)
        rope = layer_rope(self.cfg, inputs.positions)
        new_caches, new_states, auxes = [], [], []
        for i, layer in enumerate(self.layers):
            cos, sin = rope[self.cfg.layer_type(i)]
            window = self.cfg.window(i)
            mode = control.mode(i)
            if mode != "full":
                override = None if control.kv_weights is None else control.kv_weights.get(i)
                new_caches.append(_bypass_cache(layer, x, cos, sin, mode, override, window))
                new_states.append(None)
                auxes.append({})
                x = add_deepstack(x, inputs.placed, i)  # a skipped layer's slot still gets its features
                continue
            key_valid = cache.key_valid
            if i in control.prefix_masked:
                key_valid = key_valid & (jnp.arange(key_valid.shape[1]) >= control.prefix_end)[None]
            own = None if cache.caches is None else cache.caches[i]
            attend = None if own is None else cache_attention(own, key_valid, cache.write_index, window, window is not None)
            x, kv, state, aux = layer(
                x, cos, sin, key_valid, attend, ffn.at(i), None if ffn.states is None else ffn.states[i], ffn.valid, i,
                gate=None if control.gates is None else control.gates[i],
            )
            x = add_deepstack(x, inputs.placed, i)  # a VLM's DeepStack features after its first layers
            new_caches.append(kv)  # prefill: the fresh entries; decode: the layer's cache, written
            new_states.append(state)
            auxes.append(aux)
        if last_only:
            x = x[:, -1:]
        return ModelOutput(self.logits(x), tuple(new_caches), tuple(new_states), auxes)


def _write(cache: KVCache, fresh: KVCache, write_index, ring: bool) -> KVCache:
    """A layer's cache with the fresh entries [B, T, n_kv, h] written at ``write_index`` (a ring:
    at that index mod its slots; in place on a donated cache)."""
    if ring:
        return KVCache(ring_write(cache.k, fresh.k, write_index), ring_write(cache.v, fresh.v, write_index))
    write = lambda a, f: jax.lax.dynamic_update_slice_in_dim(a, f.astype(a.dtype), write_index, axis=1)
    return KVCache(write(cache.k, fresh.k), write(cache.v, fresh.v))


def _bypass_cache(layer: DecoderLayer, x: jax.Array, cos, sin, mode: str, override=None, window=None) -> KVCache:
    """The cache entries [B, n, n_kv, h] of a layer that passes x through (see Transformer):
    "kv" projects them from x with the layer's own k/v rows or with ``override`` (w, bias).
    A sliding layer projects only the last ``window`` tokens (n = min(T, window)): no later
    query reaches an older one (`Transformer.init_caches` places the last n)."""
    if window is not None and x.shape[1] > window:
        x, cos, sin = x[:, -window:], cos[:, -window:], sin[:, -window:]
    if mode == "kv":
        if override is None:
            return layer.attn.project_kv(layer.attn_norm(x), cos, sin)
        weights, bias = override
        return layer.attn.project_kv(layer.attn_norm(x), cos, sin, weights=weights, bias=bias)
    if mode == "none":
        shape = (*x.shape[:2], layer.attn.cfg.num_key_value_heads, layer.attn.cfg.head_dim)
        return KVCache(jnp.zeros(shape, x.dtype), jnp.zeros(shape, x.dtype))
    raise ValueError(f"layer mode {mode!r} is not one of {('full', 'kv', 'none')}")


def abstract_model(cfg: ModelConfig, dtype: jnp.dtype = jnp.float32) -> Transformer:
    """A Transformer with shape-only arrays (no allocation), for conversion targets; each layer's
    MLP has its own width when the config has per-layer widths (a structurally pruned checkpoint)."""
    if cfg.intermediate_sizes is None:
        return nnx.eval_shape(lambda: Transformer(cfg, dtype))

    def build():
        model = Transformer(cfg, dtype)
        for i, layer in enumerate(model.layers):
            layer.mlp = MLPWeights(cfg, dtype, i)
        return model

    return nnx.eval_shape(build)
