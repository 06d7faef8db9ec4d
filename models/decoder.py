"""The decoder shared by LLaMA, Qwen2 and Qwen3 (switches live in `ModelConfig`).

The MLP of every layer is evaluated by a caller-supplied pure function
``mlp_fn(weights, state, x) -> (y, state, aux)``: the pruning method. The model has no
method-specific branch; dense inference is just the dense method.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from .config import ModelConfig
from .layers import Attention, KVCache, MLPWeights, RMSNorm
from .moe import MoEWeights, moe_mlp
from .rope import check_rope_type, rope_cos_sin

MLPFn = Callable[[dict[str, jax.Array], Any, jax.Array], tuple[jax.Array, Any, Any]]


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, index: int = 0):
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attn = Attention(cfg, dtype)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        # a MoE model's FFN is a stack of expert blocks (models/moe.py), each run by mlp_fn
        self.mlp = MoEWeights(cfg, dtype, index) if cfg.moe is not None else MLPWeights(cfg, dtype)

    def __call__(self, x, cos, sin, key_valid, cache, write_index, mlp_fn: MLPFn, mlp_state, gate=None, index=0):
        """x [B, T, d] -> (x [B, T, d], KVCache, mlp_state, aux).

        ``gate`` [B, T] (optional) is Prefill-Only Pruning's virtual gate (SPEC §4): it scales
        both residual branches, ``x + g·Attn(x)`` and ``y + g·FFN(y)``. ``index`` (the layer's
        position) reaches the MLP function as ``weights["layer"]``, so methods with per-layer
        calibrated constants can index them."""
        attn_out, cache = self.attn(self.attn_norm(x), cos, sin, key_valid, cache, write_index)
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
        return y.astype(x.dtype), mlp_state, aux


class Transformer(nnx.Module):
    """Token embedding, L decoder layers, final norm and LM head (tied or untied)."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype = jnp.float32):
        check_rope_type(cfg)
        self.cfg = cfg
        self.embed = nnx.Param(jnp.zeros((cfg.vocab_size, cfg.hidden_size), dtype))
        self.layers = nnx.List([DecoderLayer(cfg, dtype, i) for i in range(cfg.num_hidden_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Param(jnp.zeros((cfg.vocab_size, cfg.hidden_size), dtype))

    def finalize(self) -> None:
        """Computes derived per-model constants after the weights are loaded."""
        for layer in self.layers:
            layer.mlp.finalize()

    def map_layers(self, fn: Callable, *per_layer: Sequence[Any]) -> tuple:
        """fn on each layer's entries of per-layer sequences (the engine's caches and method
        states) -> a tuple over layers (models.scan.ScannedTransformer maps its stacked axis)."""
        return tuple(fn(*entries) for entries in zip(*per_layer))

    def logits(self, h: jax.Array) -> jax.Array:
        """h [B, T, d] -> fp32 logits [B, T, V]."""
        h = self.final_norm(h)
        head = self.embed if self.cfg.tie_word_embeddings else self.lm_head  # [V, d]
        return jnp.einsum("btd,vd->btv", h, head[...], preferred_element_type=jnp.float32)

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
        layer_modes: Sequence[str] | None = None,
        prefix_masked_layers: frozenset[int] = frozenset(),
        prefix_end: jax.Array | int = 0,
    ) -> tuple[jax.Array, tuple[KVCache, ...], tuple[Any, ...], list[Any]]:
        """tokens, positions [B, T]; key_valid [B, S] -> logits [B, T or 1, V], caches, states (tuples
        over layers), aux (a list over layers). ``mlp_states`` None: no layer has a state yet.

        With ``caches=None`` the T tokens attend to each other (prefill); the returned caches are
        their fresh keys/values [B, T, n_kv, h]. Otherwise they are written at ``write_index``.
        ``mlp_fn`` is one function for every layer or a sequence of one per layer.
        ``gates`` [L, B, T] (optional) are the virtual layer gates of SPEC §4 (see DecoderLayer).

        Layer-level methods (SPEC §4, §6) steer the loop without the model naming them:
        ``layer_modes[i]`` is "full" (default), "kv" (the layer only writes keys/values projected
        from its input and passes the residual stream through), "kv_calibrated" (the same with the
        layer's calibrated projection ``attn.prefill_kv``, popjax.kv_calibration) or "none" (passes
        it through and writes zero keys/values); layers in ``prefix_masked_layers`` ignore cache
        slots before ``prefix_end`` (the slots such a "none" layer never wrote).
        """
        x = self.embed[...][tokens]
        cos, sin = rope_cos_sin(self.cfg, positions)
        new_caches, new_states, auxes = [], [], []
        for i, layer in enumerate(self.layers):
            cache = None if caches is None else caches[i]
            mode = "full" if layer_modes is None else layer_modes[i]
            if mode != "full":
                new_caches.append(_bypass_cache(layer, x, cos, sin, mode, i, layer_modes))
                new_states.append(None)
                auxes.append({})
                continue
            layer_valid = key_valid
            if i in prefix_masked_layers:
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


LAYER_MODES = ("full", "kv", "kv_calibrated", "none")


def _bypass_cache(layer: DecoderLayer, x: jax.Array, cos, sin, mode: str, index: int = 0, layer_modes=()) -> KVCache:
    """The cache entries [B, T, n_kv, h] of a layer that passes x through (see Transformer).

    "kv_calibrated" needs the layer's ``attn.prefill_kv`` [2·kv_dim, d] and checks that it was
    fitted for this very set of bypassed layers (``attn.prefill_kv_skip``, static): calibrated
    projections map the input of *this* skip set's stream, so another set's are wrong."""
    if mode == "kv":
        return layer.attn.project_kv(layer.attn_norm(x), cos, sin)
    if mode == "kv_calibrated":
        attn = layer.attn
        skipped = tuple(i for i, m in enumerate(layer_modes) if m != "full")
        if not hasattr(attn, "prefill_kv"):
            raise ValueError(
                f"layer {index} is skipped with kv='calibrated' but the model has no calibrated KV projection "
                "for it; use popjax.kv_calibration.with_prefill_kv(model, calibrate_kv(model, skip=...))"
            )
        if attn.prefill_kv_skip != skipped:
            raise ValueError(
                f"layer {index}'s calibrated KV projection was fitted for skipped layers {list(attn.prefill_kv_skip)}, "
                f"but this plan skips {list(skipped)}; calibrate for this skip set (calibrate_kv(model, skip=...))"
            )
        bias = attn.prefill_kv_bias[...] if hasattr(attn, "prefill_kv_bias") else None
        return attn.project_kv(layer.attn_norm(x), cos, sin, weights=attn.prefill_kv[...], bias=bias)
    if mode == "none":
        shape = (*x.shape[:2], layer.attn.cfg.num_key_value_heads, layer.attn.cfg.head_dim)
        return KVCache(jnp.zeros(shape, x.dtype), jnp.zeros(shape, x.dtype))
    raise ValueError(f"layer mode {mode!r} is not one of {LAYER_MODES}")


def abstract_model(cfg: ModelConfig, dtype: jnp.dtype = jnp.float32) -> Transformer:
    """A Transformer with shape-only arrays (no allocation), for conversion targets."""
    return nnx.eval_shape(lambda: Transformer(cfg, dtype))
