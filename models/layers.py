"""Building blocks of the decoder: RMSNorm, grouped-query attention with a KV cache, MLP weights.

Weights keep the HF/PyTorch ``[out, in]`` layout and are applied as ``einsum("...i,oi->...o")``:
on CPU, XLA's dot-product-form GEMV streams contiguous rows and measured 1.3–1.7× the
bandwidth of the ``[in, out]`` form for this model's matrix sizes (see docs/performance.md).
q/k/v and gate/up are fused into one array each, so a decode step runs fewer, larger dots.

q/k/v are grouped by KV head: ``qkv`` is [n_kv, g + 2, h, d] (g = n_q / n_kv query heads, then the
group's key head, then its value head), so splitting n_kv over a mesh gives every device the
query, key and value heads of the same KV groups and attention needs no communication. Without a
mesh it is read as the [n_kv·(g+2)·h, d] matrix it is in memory: one dot, as before.

A FFN channel j is ``gate_up[0, j]`` (gate) and ``gate_up[1, j]`` (up) of ``gate_up`` ([2, f, d]:
gate and up stacked on a leading axis, so splitting f over a mesh gives every device matching gate
and up rows) and column j of ``down`` ([d, f]).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .config import ModelConfig
from .interface import FFNWeights
from ..kernels.attention import causal_attention
from ..kernels.int8 import Int8Weight, dequantized, dot, two_pass
from .rope import apply_rope


class Derived(nnx.Variable):
    """A per-model constant computed from the weights, not trained: at load by ``finalize()``
    (down_norm, never in the checkpoint cache) or at conversion (a MoE's channel_order)."""


def _param(shape: tuple[int, ...], dtype: jnp.dtype, axes: tuple[str | None, ...]) -> nnx.Param:
    """A parameter of zeros that declares the logical axes of its dimensions (``axes`` metadata:
    names such as "embed" or "mlp" that `popjax.sharding`'s one rules table maps to a mesh; the
    one place a parameter's axes are stated)."""
    return nnx.Param(jnp.zeros(shape, dtype), axes=axes)


def linear(x: jax.Array, w: jax.Array | Int8Weight) -> jax.Array:
    """x [..., in] with w [out, in] (float or int8, popjax/kernels/int8.py) -> [..., out]."""
    return dot("...i,oi->...o", x, w)


class LinearWeights:
    """Linear-layer weights in the model's weight format (``ModelConfig.weights``): a float
    ``nnx.Param``, or for "int8" an int8 ``name`` with its fp32 ``name_scale`` ([..., 1]: one
    scale per output channel, popjax/kernels/int8.py). `weight` reads either as what `linear` takes."""

    def _linear_param(self, name: str, shape: tuple[int, ...], dtype: jnp.dtype, weights: str, activations: str,
                      axes: tuple[str | None, ...]) -> None:
        self.compute_dtype = jnp.dtype(dtype)
        self.int8_activations = activations  # how `dot` reads x against an int8 weight (popjax/kernels/int8.py)
        if weights == "int8":
            setattr(self, name, _param(shape, jnp.int8, axes))
            # one scale per output channel: the weight's axes, none on its (size-1) input axis
            setattr(self, f"{name}_scale", nnx.Param(jnp.ones((*shape[:-1], 1), jnp.float32), axes=(*axes[:-1], None)))
        else:
            setattr(self, name, _param(shape, dtype, axes))

    def weight(self, name: str) -> jax.Array | Int8Weight:
        """The weight ``name``: an array, or an `Int8Weight` in an int8 model."""
        scale = getattr(self, f"{name}_scale", None)
        value = getattr(self, name)[...]
        return value if scale is None else Int8Weight(value, scale[...], self.compute_dtype, self.int8_activations)


class PlacedEmbeddings(NamedTuple):
    """Embeddings that replace some prompt tokens' own (a VLM's image features at its image
    placeholders): ``features`` [N, d] in the compute dtype, ``slots`` [B, T] int32, the row of
    ``features`` each token takes, −1 for a token that keeps its embedding. ``deepstack``
    (Qwen3-VL, else None) [n_deep, N, d]: set j is added at the same slots after decoder layer j
    (models/deepstack.py)."""

    features: jax.Array
    slots: jax.Array
    deepstack: jax.Array | None = None


class TokenEmbeddings(LinearWeights):
    """The token embedding ``embed`` [V, d] and the LM head (``embed`` when tied, else
    ``lm_head`` [V, d]) in the model's weight format: an int8 model stores them as int8 rows
    with one scale per token row, so an embedding lookup reads int8 rows and the LM head, the
    largest matrix a small model's decode step reads, reads one byte per weight."""

    def _embedding_params(self, cfg: ModelConfig, dtype: jnp.dtype) -> None:
        self._linear_param("embed", (cfg.vocab_size, cfg.hidden_size), dtype, cfg.weights, cfg.activations, ("vocab", "embed"))
        if not cfg.tie_word_embeddings:
            self._linear_param("lm_head", (cfg.vocab_size, cfg.hidden_size), dtype, cfg.weights, cfg.activations, ("vocab", "embed"))

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, T] -> x [B, T, d] in the compute dtype (times √d in a Gemma model, the
        factor rounded to the compute dtype as transformers does)."""
        table = self.weight("embed")
        if isinstance(table, Int8Weight):
            rows = (table.values[tokens].astype(jnp.float32) * table.scale[tokens]).astype(table.dtype)
        else:
            rows = table[tokens]
        if self.cfg.embed_scale:
            rows = rows * jnp.asarray(self.cfg.hidden_size**0.5, rows.dtype)
        return rows

    def embed_inputs(self, tokens: jax.Array, placed: PlacedEmbeddings | None = None) -> jax.Array:
        """tokens [B, T] -> x [B, T, d]: `embed_tokens`, with ``placed`` features (if any) at
        their slots."""
        x = self.embed_tokens(tokens)
        if placed is None:
            return x
        rows = placed.features.astype(x.dtype)[jnp.maximum(placed.slots, 0)]
        return jnp.where((placed.slots >= 0)[..., None], rows, x)

    def lm_head_weight(self) -> jax.Array | Int8Weight:
        """The LM head [V, d]. In a model with int8 activations it reads them in two int8 passes
        (`kernels.int8.two_pass`): one pass there costs the default model 0.013 nats of held-out
        NLL, over a third of int8's loss (docs/performance.md, "int8 weights")."""
        return two_pass(self.weight("embed" if self.cfg.tie_word_embeddings else "lm_head"))


class RMSNorm(nnx.Module):
    """RMSNorm as in transformers: normalise in fp32, cast back, then scale. ``weight`` is the
    multiplier itself: Gemma's (1 + w) convention is folded in when a checkpoint is converted
    (convert/names.py)."""

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype, axis: str = "norm"):
        self.weight = nnx.Param(jnp.ones((dim,), dtype), axes=(axis,))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * xf.astype(x.dtype)


class KVCache(NamedTuple):
    """One layer's cache: k, v [B, S, n_kv, h]."""

    k: jax.Array
    v: jax.Array


def fuse_qkv(q, k, v, cfg: ModelConfig):
    """HF q [q_dim, ...], k, v [kv_dim, ...] (numpy; weights or biases) -> [n_kv, g + 2, h, ...]."""
    n_kv, h = cfg.num_key_value_heads, cfg.head_dim
    rest = q.shape[1:]
    q = q.reshape(n_kv, cfg.num_attention_heads // n_kv, h, *rest)  # query head i·g + j uses KV head i
    return np.concatenate([q, k.reshape(n_kv, 1, h, *rest), v.reshape(n_kv, 1, h, *rest)], axis=1)


def split_qkv(qkv, cfg: ModelConfig):
    """The inverse of `fuse_qkv`: [n_kv, g + 2, h, ...] -> q [q_dim, ...], k, v [kv_dim, ...]."""
    g, rest = qkv.shape[1] - 2, qkv.shape[3:]
    return (qkv[:, :g].reshape(cfg.q_dim, *rest), qkv[:, g].reshape(cfg.kv_dim, *rest),
            qkv[:, g + 1].reshape(cfg.kv_dim, *rest))


def group_kv(kv_rows, cfg: ModelConfig):
    """k rows then v rows [2·kv_dim, ...] (a calibration's layout) -> [n_kv, 2, h, ...] (qkv's)."""
    n_kv, h = cfg.num_key_value_heads, cfg.head_dim
    grouped = kv_rows.reshape(2, n_kv, h, *kv_rows.shape[1:])
    return grouped.transpose(1, 0, *range(2, grouped.ndim))


class Attention(nnx.Module, LinearWeights):
    """Grouped-query attention; q is reshaped to (kv_heads, group) so K/V are never repeated."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype):
        d = cfg.hidden_size
        self.cfg = cfg
        n_kv, h = cfg.num_key_value_heads, cfg.head_dim
        self.scale = cfg.attention_scale  # on q·k: head_dim^-½, or Gemma's query_pre_attn_scalar^-½
        parts = cfg.num_attention_heads // n_kv + 2  # a KV group's query heads, its key, its value
        self._linear_param("qkv", (n_kv, parts, h, d), dtype, cfg.weights, cfg.activations, ("kv_heads", "qkv_part", "head_dim", "embed"))
        self._linear_param("o", (d, cfg.q_dim), dtype, cfg.weights, cfg.activations, ("embed", "heads"))
        if cfg.qkv_bias:
            self.qkv_bias = _param((n_kv, parts, h), dtype, ("kv_heads", "qkv_part", "head_dim"))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, "head_dim")
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, "head_dim")

    def _project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, T, d] -> q [B, T, n_q, h], k, v [B, T, n_kv, h]."""
        # two int8 passes (int8 activations): q/k/v's one-pass error costs most after the head's
        y = _grouped_linear(x, two_pass(self.weight("qkv")), self.qkv_bias[...] if self.cfg.qkv_bias else None)
        g = y.shape[3] - 2
        return y[:, :, :, :g].reshape(*x.shape[:2], -1, y.shape[-1]), y[:, :, :, g], y[:, :, :, g + 1]

    def kv_rows(self) -> tuple[jax.Array, jax.Array | None]:
        """The k rows then the v rows of ``qkv`` [2·kv_dim, d] and of ``qkv_bias`` [2·kv_dim] (None
        without a bias; float, also in an int8 model): the layout KV calibrations are fitted and stored in."""
        _, k, v = split_qkv(dequantized(self.weight("qkv")), self.cfg)
        if not self.cfg.qkv_bias:
            return jnp.concatenate([k, v]), None
        _, kb, vb = split_qkv(self.qkv_bias[...], self.cfg)
        return jnp.concatenate([k, v]), jnp.concatenate([kb, vb])

    def project_kv(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, weights: jax.Array | None = None, bias: jax.Array | None = None
    ) -> KVCache:
        """Keys and values alone (RoPE'd keys), x [B, T, d] -> KVCache [B, T, n_kv, h]: what a
        layer scheduled as "kv" writes (it skips the rest of its computation).

        ``weights`` [n_kv, 2, h, d] (each KV head's k and v, `group_kv`) replace the k/v parts of
        ``qkv`` and ``bias`` [n_kv, 2, h] those of ``qkv_bias`` (e.g. projections fitted to
        reproduce another layer stream's keys and values)."""
        cfg = self.cfg
        g = cfg.num_attention_heads // cfg.num_key_value_heads
        w = two_pass(self.weight("qkv"))[:, g:] if weights is None else weights
        if cfg.qkv_bias and bias is None:
            bias = self.qkv_bias[...][:, g:]
        kv = _grouped_linear(x, w, bias if cfg.qkv_bias else None)
        k, v = kv[:, :, :, 0], kv[:, :, :, 1]
        if cfg.qk_norm:
            k = self.k_norm(k)
        return KVCache(apply_rope(k, cos, sin), v)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, key_valid: jax.Array, attend_cache=None,
                 window: int | jax.Array | None = None) -> tuple[jax.Array, KVCache]:
        """x [B, T, d]; cos/sin [B, T, h]; key_valid [B, T] (prefill) -> (out [B, T, d], kv): the T
        tokens' fresh KVCache [B, T, n_kv, h], which the caller writes into its cache, or, with
        ``attend_cache``, the ``kv`` it returns (`models.decoder.cache_attention`: the layer's
        cache with them written, or the fresh entries).

        ``attend_cache`` None (prefill): the T tokens attend to each other causally (within
        ``window``, the layer's sliding window; None: full attention). Otherwise a function
        ``(q [B, T, n_q, h], k, v [B, T, n_kv, h], scale) -> ([B, T, n_q, h], kv)`` that attends
        them to the cache's earlier slots and to themselves (`models.decoder.cache_attention`, around the
        one decode kernel `kernels.attention.cached_attention`)."""
        q, k, v = self.rotated_qkv(x, cos, sin)
        if attend_cache is None:
            out, kv = causal_attention(q, k, v, key_valid, self.scale, window), KVCache(k, v)
        else:
            out, kv = attend_cache(q, k, v, self.scale)
        return linear(out.reshape(*x.shape[:2], self.cfg.q_dim), self.weight("o")), kv

    def rotated_qkv(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, T, d] -> q [B, T, n_q, h], k, v [B, T, n_kv, h]: projected, q/k-normed, RoPE'd."""
        q, k, v = self._project(x)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _grouped_linear(x: jax.Array, w: jax.Array | Int8Weight, bias: jax.Array | None) -> jax.Array:
    """x [B, T, d] with w [n_kv, p, h, d] (bias [n_kv, p, h]) -> [B, T, n_kv, p, h].

    One dot over w read as its [n_kv·p·h, d] matrix: the merged rows keep n_kv outermost, so on a
    mesh that splits n_kv each device's rows stay its own KV groups (no weight moves)."""
    n_kv, p, h, d = w.shape
    y = linear(x, w.reshape(n_kv * p * h, d)).reshape(*x.shape[:2], n_kv, p, h)
    return y if bias is None else y + bias


class MLPWeights(nnx.Module, LinearWeights):
    """Weights of the gated MLP. The computation is the caller's FFN function (``FFNHook.fn``), a
    pure function of ``(FFNWeights, state, x, valid)`` (the dense MLP, or whatever the caller runs)."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, layer: int | None = None):
        """``layer`` picks this layer's width in a pruned model with per-layer widths."""
        d, f = cfg.hidden_size, cfg.ffn_width(layer)
        self.act = cfg.hidden_act  # the gate activation's name, static (popjax.ffn.gate_activation)
        # [gate; up] on a leading axis: split on f, every device holds the gate and up rows of its channels
        self._linear_param("gate_up", (2, f, d), dtype, cfg.weights, cfg.activations, ("mlp_pair", "mlp", "embed"))
        self._linear_param("down", (d, f), dtype, cfg.weights, cfg.activations, ("embed", "mlp"))
        if cfg.down_proj_bias:  # a structurally pruned checkpoint's bias (popjax.pruned)
            self.down_bias = _param((d,), dtype, ("embed",))
        # ‖W_d[:, j]‖₂ per channel (channel importance scores read it): a per-model constant, filled in by `finalize`.
        self.down_norm = Derived(jnp.zeros((f,), jnp.float32), axes=("mlp",))

    def finalize(self) -> None:
        down = dequantized(self.weight("down")).astype(jnp.float32)  # an int8 model's norms: of q · s
        self.down_norm[...] = jnp.sqrt(jnp.sum(down * down, axis=0))

    def ffn_weights(self, layer) -> FFNWeights:
        """The arrays a method's FFN function reads (`models.interface.FFNWeights`) for layer
        ``layer`` (an int32 scalar). ``down_bias`` is not among them: the layer adds it."""
        return FFNWeights(self.weight("gate_up"), self.weight("down"), self.down_norm[...], layer, act=self.act)
