"""The Qwen2-VL / Qwen2.5-VL / Qwen3-VL vision towers' encoder (JAX); the host-side patch layout
is models/vision_layout.py.

A batch of images (or video clips) arrives as HF's processor writes it: ``pixel_values``
[n_patches, C·t·p·p] (one row per patch, every image's patches in merge-window order) and
``grid_thw`` [n_images, 3] (frames, patch rows, patch columns of each image). The tower runs
on a fixed number of patch rows, a *bucket* (`patch_bucket`), so images of new sizes within a
bucket reuse one compiled program:

1. `vision_layout` (NumPy) derives from ``grid_thw`` the per-patch arrays `encode_images` reads
   (`VisionArrays`: the patch order the blocks run in, the 2-D rotary positions, the frame and
   window each patch attends within), padded to the bucket;
2. `pad_patches` zero-pads ``pixel_values`` to the bucket;
3. `encode_images` (JAX; static: the config; traced: everything else) runs patch embedding, the
   blocks and the patch merger, and returns [bucket // merge², out_hidden_size] features. Only
   the first ``layout.n_tokens`` rows are real, in HF's order (Qwen2.5-VL: after undoing the
   window permutation), image after image (``layout.tokens_per_image`` each); padding rows are
   garbage that callers must ignore.

Qwen3-VL's tower (``VisionConfig.is_qwen3``) differs in four places, each read in transformers'
``modeling_qwen3_vl``: a bias on the patch embedding; a learned position table resampled
bilinearly to each image's grid (`vision_layout.position_taps`) and added before the blocks;
LayerNorms with biases and an ungated gelu-tanh MLP in the blocks (Qwen2-VL's block body, so
`_block` runs it); and **DeepStack**: the outputs of blocks ``deepstack_visual_indexes`` each go
through their own merger, whose norm acts on the merged [4·E] rows (`encode_images_deepstack`).

Attention is dense over the bucket under a mask (same frame; in Qwen2.5-VL's window blocks also
the same window; padding rows see only themselves, so no row is fully masked and nothing is NaN),
so a block holds [heads, bucket, bucket] fp32 scores: choose buckets with that in mind.
All compute is fp32 with HIGHEST-precision dots (HF parity within 1e-4).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .config import ConfigError
from .vision_config import (  # re-exported: __all__
    ARCHITECTURES,
    NORM_EPS,
    VISION_ACTIVATIONS,
    VisionConfig,
    vision_params_from_hf,
    vision_tensor_names,
)
from .vision_layout import VisionArrays, VisionLayout, _grid, pad_patches, patch_bucket, vision_layout  # re-exported: __all__

__all__ = [
    "ARCHITECTURES", "VISION_ACTIVATIONS", "VisionArrays", "VisionConfig", "VisionLayout", "encode_images", "encode_images_deepstack",
    "image_features", "pad_patches", "patch_bucket", "vision_layout", "vision_params_from_hf", "vision_tensor_names",
]

HIGHEST = jax.lax.Precision.HIGHEST


def _linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """x [..., in] with w [out, in] (HF layout) and bias [out] -> [..., out] in fp32."""
    y = jnp.einsum("...i,oi->...o", x, w.astype(jnp.float32), precision=HIGHEST)
    return y if b is None else y + b.astype(jnp.float32)


def _norm(cfg: VisionConfig, x: jax.Array, weight: jax.Array, bias: jax.Array | None) -> jax.Array:
    """Qwen2-VL: LayerNorm (biased variance); Qwen2.5-VL: RMSNorm. eps = 1e-6 in both."""
    if cfg.windowed:
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + NORM_EPS) * weight
    centred = x - jnp.mean(x, axis=-1, keepdims=True)
    variance = jnp.mean(centred * centred, axis=-1, keepdims=True)
    return centred * jax.lax.rsqrt(variance + NORM_EPS) * weight + bias


_ACTIVATIONS = {
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "silu": jax.nn.silu,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
}


def _inverse_frequencies(cfg: VisionConfig) -> np.ndarray:
    """[head_dim // 4] float32: HF's axial rope over half the head (rows and columns share them)."""
    spatial = cfg.head_dim // 2
    exponents = np.arange(0, spatial, 2, dtype=np.int64).astype(np.float32) / np.float32(spatial)
    return (np.float32(1.0) / (np.float32(cfg.rope_theta) ** exponents)).astype(np.float32)


def _rotary(cfg: VisionConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions [N, 2] -> cos, sin [N, head_dim]: angles (row freqs ‖ column freqs) twice."""
    angles = positions.astype(jnp.float32)[:, :, None] * jnp.asarray(_inverse_frequencies(cfg))
    angles = angles.reshape(positions.shape[0], -1)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [N, heads, D]; HF's apply_rotary_pos_emb_vision (half-split rotate_half)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def _mask(ids: jax.Array) -> jax.Array:
    """[N, N] bool: rows and columns of the same id ≥ 0; a padding row (-1) sees only itself."""
    same = (ids[:, None] == ids[None, :]) & (ids[:, None] >= 0)
    return same | jnp.eye(ids.shape[0], dtype=bool)


def _block(cfg: VisionConfig, x: jax.Array, p: dict, cos: jax.Array, sin: jax.Array, mask: jax.Array) -> jax.Array:
    n, heads, d = x.shape[0], cfg.num_heads, cfg.head_dim
    h = _norm(cfg, x, p["norm1_w"], p.get("norm1_b"))
    qkv = _linear(h, p["qkv_w"], p["qkv_b"]).reshape(n, 3, heads, d)
    q, k, v = _rotate(qkv[:, 0], cos, sin), _rotate(qkv[:, 1], cos, sin), qkv[:, 2]
    scores = jnp.einsum("qhd,khd->hqk", q, k, precision=HIGHEST) * (d**-0.5)
    scores = jnp.where(mask[None], scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1)
    attn = jnp.einsum("hqk,khd->qhd", weights, v, precision=HIGHEST).reshape(n, heads * d)
    x = x + _linear(attn, p["proj_w"], p["proj_b"])
    h = _norm(cfg, x, p["norm2_w"], p.get("norm2_b"))
    act = _ACTIVATIONS[cfg.hidden_act]
    if cfg.windowed:
        mlp = _linear(act(_linear(h, p["gate_w"], p["gate_b"])) * _linear(h, p["up_w"], p["up_b"]), p["down_w"], p["down_b"])
    else:
        mlp = _linear(act(_linear(h, p["fc1_w"], p["fc1_b"])), p["fc2_w"], p["fc2_b"])
    return x + mlp


def _layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array) -> jax.Array:
    centred = x - jnp.mean(x, axis=-1, keepdims=True)
    return centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + NORM_EPS) * weight + bias


def _merge(cfg: VisionConfig, x: jax.Array, m: dict, postshuffle: bool = False) -> jax.Array:
    """x [bucket, E] -> [bucket // merge², out_hidden_size]: norm, the merge² patches of each
    token side by side, linear, GELU (erf), linear. ``postshuffle`` (Qwen3-VL's DeepStack
    mergers): the LayerNorm acts on the merged [merge²·E] rows instead of each patch's [E]."""
    rows = x.shape[0] // cfg.merge_unit
    if postshuffle:
        h = _layer_norm(x.reshape(rows, cfg.merger_dim), m["ln_q_w"], m["ln_q_b"])
    else:
        h = _norm(cfg, x, m["ln_q_w"], m.get("ln_q_b")).reshape(rows, cfg.merger_dim)
    return _linear(jax.nn.gelu(_linear(h, m["mlp0_w"], m["mlp0_b"]), approximate=False), m["mlp2_w"], m["mlp2_b"])


def _check_inputs(cfg: VisionConfig, pixel_values: jax.Array, arrays: VisionArrays) -> None:
    bucket, unit = pixel_values.shape[0], cfg.merge_unit
    if pixel_values.ndim != 2 or pixel_values.shape[1] != cfg.patch_dim or bucket % unit:
        raise ConfigError(f"pixel_values shape {pixel_values.shape} is invalid: expected [bucket (a multiple of {unit}), {cfg.patch_dim}]")
    if arrays.order.shape != (bucket,) or arrays.unorder.shape != (bucket // unit,):
        raise ConfigError(f"the layout arrays are for bucket={arrays.order.shape[0]}, pixel_values for {bucket}")
    if cfg.is_qwen3 and (arrays.pos_index is None or arrays.pos_index.shape != (bucket, 4)):
        raise ConfigError("a Qwen3-VL tower needs the layout's position taps (vision_layout with its config)")


def encode_images_deepstack(params: dict, cfg: VisionConfig, pixel_values: jax.Array,
                            arrays: VisionArrays) -> tuple[jax.Array, jax.Array | None]:
    """pixel_values [bucket, patch_dim] (HF's rows, zero-padded: `pad_patches`) and the layout's
    `VisionArrays` -> (features [bucket // merge², out_hidden_size] fp32, DeepStack features
    [n_deep, bucket // merge², out_hidden_size] fp32, or None for a tower without DeepStack).

    Rows ``[:layout.n_tokens]`` are the images' features in HF's order (what HF's tower returns
    as ``pooler_output``; DeepStack's ``deepstack_features``, entry j the j-th of the DeepStack
    blocks in depth order, as HF collects them); the rest are padding, to be ignored. Jit with
    ``cfg`` static; images of any size in one bucket share a compile."""
    _check_inputs(cfg, pixel_values, arrays)
    x = _linear(pixel_values.astype(jnp.float32), params["patch_embed"], params.get("patch_bias"))
    if cfg.is_qwen3:  # each patch: its four table rows, weighted (an exact gather, one fp32 sum)
        rows = jnp.take(params["pos_embed"].astype(jnp.float32), arrays.pos_index, axis=0)  # [bucket, 4, E]
        x = x + jnp.einsum("nk,nke->ne", arrays.pos_weight, rows, precision=HIGHEST)
    x = jnp.take(x, arrays.order, axis=0)
    cos, sin = _rotary(cfg, arrays.positions)
    frame_mask = _mask(arrays.segment)
    window_mask = _mask(arrays.window) if cfg.windowed else frame_mask
    full = jnp.asarray([cfg.full_attention(i) for i in range(cfg.depth)])

    def step(x: jax.Array, layer: tuple[dict, jax.Array]) -> tuple[jax.Array, None]:
        p, is_full = layer
        mask = jnp.where(is_full, frame_mask, window_mask) if cfg.windowed else frame_mask
        return _block(cfg, x, p, cos, sin, mask), None

    # the blocks run as scans over runs of blocks that end at a DeepStack block (static cuts),
    # so no block's output is kept but those DeepStack reads
    deep = sorted(cfg.deepstack_visual_indexes)
    features, start = [], 0
    for end in sorted({b + 1 for b in deep} | {cfg.depth}):
        part = jax.tree_util.tree_map(lambda a: a[start:end], (params["blocks"], full))  # noqa: B023
        x, _ = jax.lax.scan(step, x, part)
        if end - 1 in deep:
            j = cfg.deepstack_visual_indexes.index(end - 1)  # the merger HF pairs with this block
            merger = jax.tree_util.tree_map(lambda a: a[j], params["deepstack"])  # noqa: B023
            features.append(jnp.take(_merge(cfg, x, merger, postshuffle=True), arrays.unorder, axis=0))
        start = end
    out = jnp.take(_merge(cfg, x, params["merger"]), arrays.unorder, axis=0)
    return out, (jnp.stack(features) if features else None)


def encode_images(params: dict, cfg: VisionConfig, pixel_values: jax.Array, arrays: VisionArrays) -> jax.Array:
    """`encode_images_deepstack`'s main features alone: [bucket // merge², out_hidden_size] fp32."""
    return encode_images_deepstack(params, cfg, pixel_values, arrays)[0]


_encode_jit = jax.jit(encode_images_deepstack, static_argnums=1)


def image_features(params: dict, cfg: VisionConfig, pixel_values: Any, grid_thw: Any, bucket: int | None = None,
                   deepstack: bool = False) -> np.ndarray | tuple[np.ndarray, np.ndarray | None]:
    """Host convenience: HF-style pixel_values [n_patches, patch_dim] and grid_thw [n_images, 3]
    -> the real features [n_tokens, out_hidden_size] (NumPy), in HF's order, through one jitted
    `encode_images_deepstack` (``bucket`` defaults to `patch_bucket`). ``deepstack``: also the
    DeepStack features [n_deep, n_tokens, out_hidden_size] (None without DeepStack)."""
    grid = _grid(grid_thw, cfg)
    n_patches = int(np.prod(grid, axis=1).sum())
    if np.shape(pixel_values)[0] != n_patches:
        raise ConfigError(f"pixel_values has {np.shape(pixel_values)[0]} rows but grid_thw describes {n_patches} patches")
    bucket = patch_bucket(n_patches, cfg.merge_unit) if bucket is None else bucket
    layout = vision_layout(grid, cfg, bucket)
    out, deep = _encode_jit(params, cfg, pad_patches(pixel_values, cfg, bucket), layout.arrays)
    out = np.asarray(out[: layout.n_tokens])
    if not deepstack:
        return out
    return out, None if deep is None else np.asarray(deep[:, : layout.n_tokens])
