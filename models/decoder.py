"""The decoder shared by LLaMA, Qwen2 and Qwen3 (switches live in `ModelConfig`).

The MLP of every layer is evaluated by a caller-supplied pure function
``mlp_fn(weights, state, x) -> (y, state, aux)`` (the dense MLP or anything that replaces it),
and a per-layer ``LayerSchedule`` says what each layer does in one call. The model knows no
pruning: it has no branch for any particular use of these two arguments.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from .config import ModelConfig
from .attention import ring_from_prompt, ring_slots
from .layers import Attention, KVCache, MLPWeights, PlacedEmbeddings, RMSNorm, TokenEmbeddings
from .moe import MoEWeights, moe_mlp
from .quant import dot
from .rope import check_rope_type, layer_rope

MLPFn = Callable[[dict[str, jax.Array], Any, jax.Array], tuple[jax.Array, Any, Any]]
LAYER_MODES = ("full", "kv", "none")


@dataclasses.dataclass(frozen=True)
class LayerSchedule:
    """What each layer does in one call of the model (static, hashable: part of a jit key).

    ``modes[i]``: "full" (the layer runs), "kv" (it only writes keys/values projected from its
    input; the residual stream passes through) or "none" (it passes the stream through and writes
    zero keys/values). ``prefix_masked``: layers whose attention ignores the cache slots before
    ``prefix_end`` in later calls (the slots a "none" layer never wrote)."""

    modes: tuple[str, ...]
    prefix_masked: frozenset[int] = frozenset()

    def __post_init__(self):
        bad = sorted({m for m in self.modes if m not in LAYER_MODES})
        if bad:
            raise ValueError(f"layer modes {bad} are not among {LAYER_MODES}")


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

    def __call__(self, x, cos, sin, key_valid, cache, write_index, mlp_fn: MLPFn, mlp_state, gate=None, index=0,
                 window: Any = "layer"):
        """x [B, T, d] -> (x [B, T, d], KVCache, mlp_state, aux). cos/sin [B, T, h] are the angles of
        this layer's kind (`rope.rope_cos_sin(cfg, positions, cfg.layer_type(index))`).

        ``gate`` [B, T] (optional) scales both residual branches, ``x + g·Attn(x)`` and
        ``y + g·FFN(y)`` (a virtual layer gate: its gradient measures the layer's importance). ``index`` (the layer's
        position) reaches the MLP function as ``weights["layer"]``, so methods with per-layer
        calibrated constants can index them. ``window``: the sliding window, by default the one
        ``cfg`` gives layer ``index`` (a scanned model, whose index is traced, passes its own)."""
        window = self.cfg.window(index) if isinstance(window, str) else window
        attn_out, cache = self.attn(self.attn_norm(x), cos, sin, key_valid, cache, write_index, window)
        if self.cfg.sandwich_norms:
            attn_out = self.attn_post_norm(attn_out)
        if gate is not None:
            attn_out = attn_out * gate[..., None].astype(attn_out.dtype)
        x = x + attn_out
        y, mlp_state, aux = self.feed_forward(x, mlp_fn, mlp_state, index)
        if gate is not None:
            y = y * gate[..., None].astype(y.dtype)
        return x + y, cache, mlp_state, aux

    def feed_forward(self, x, mlp_fn: MLPFn, mlp_state, index=0):
        """The FFN branch on the residual stream x [B, T, d] -> (y [B, T, d] in x's dtype, mlp_state,
        aux); the caller adds y to x (shared with models.scan's layer body)."""
        h = self.mlp_norm(x)
        if isinstance(self.mlp, MoEWeights):
            y, mlp_state, aux = moe_mlp(self.mlp, mlp_fn, mlp_state, h, jnp.asarray(index, jnp.int32))
        else:
            weights = {**self.mlp.as_dict(), "layer": jnp.asarray(index, jnp.int32)}
            y, mlp_state, aux = mlp_fn(weights, mlp_state, h)
        if self.cfg.sandwich_norms:
            y = self.mlp_post_norm(y.astype(x.dtype))
        return y.astype(x.dtype), mlp_state, aux


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

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        key_valid: jax.Array,
        mlp_fn: MLPFn,
        mlp_states: Sequence[Any] | None,
        caches: Sequence[KVCache] | None = None,
        write_index: jax.Array | int = 0,
        last_only: bool = False,
        gates: jax.Array | None = None,
        schedule: LayerSchedule | None = None,
        kv_weights: Mapping[int, tuple[jax.Array, jax.Array | None]] | None = None,
        prefix_end: jax.Array | int = 0,
        placed: PlacedEmbeddings | None = None,
    ) -> tuple[jax.Array, tuple[KVCache, ...], tuple[Any, ...], list[Any]]:
        """tokens, positions [B, T]; key_valid [B, S] -> logits [B, T or 1, V], caches, states (tuples
        over layers), aux (a list over layers). ``mlp_states`` None: no layer has a state yet.

        With ``caches=None`` the T tokens attend to each other (prefill); the returned caches are
        their fresh keys/values [B, T, n_kv, h]. Otherwise they are written at ``write_index``.
        ``mlp_fn`` is one function for every layer or a sequence of one per layer.
        ``gates`` [L, B, T] (optional) scale both residual branches of each layer (see DecoderLayer).

        ``schedule`` (static, `LayerSchedule`) says what each layer does in this call: "full"
        (default), "kv" (the layer only writes keys/values projected from its input and passes
        the residual stream through) or "none" (passes it through and writes zero keys/values);
        its ``prefix_masked`` layers ignore cache slots before ``prefix_end``. ``kv_weights``
        (traced, optional) maps a "kv" layer to the projection it uses instead of its own k/v
        rows: (w [n_kv, 2, h, d], bias [n_kv, 2, h] or None), in qkv's grouped layout.
        ``placed`` (optional) puts embeddings at some token slots (a VLM's image features);
        ``positions`` may then be M-RoPE's [3, B, T] (models/mrope.py).
        """
        x = self.embed_inputs(tokens, placed)
        rope = layer_rope(self.cfg, positions)
        new_caches, new_states, auxes = [], [], []
        for i, layer in enumerate(self.layers):
            cache = None if caches is None else caches[i]
            cos, sin = rope[self.cfg.layer_type(i)]
            mode = "full" if schedule is None else schedule.modes[i]
            if mode != "full":
                override = None if kv_weights is None else kv_weights.get(i)
                new_caches.append(_bypass_cache(layer, x, cos, sin, mode, override, self.cfg.window(i)))
                new_states.append(None)
                auxes.append({})
                continue
            layer_valid = key_valid
            if schedule is not None and i in schedule.prefix_masked:
                layer_valid = key_valid & (jnp.arange(key_valid.shape[1]) >= prefix_end)[None]
            fn = mlp_fn[i] if isinstance(mlp_fn, (list, tuple)) else mlp_fn
            x, cache, state, aux = layer(
                x, cos, sin, layer_valid, cache, write_index, fn, None if mlp_states is None else mlp_states[i],
                None if gates is None else gates[i], i,
            )
            new_caches.append(cache)
            new_states.append(state)
            auxes.append(aux)
        if last_only:
            x = x[:, -1:]
        return self.logits(x), tuple(new_caches), tuple(new_states), auxes


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
    raise ValueError(f"layer mode {mode!r} is not one of {LAYER_MODES}")


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
