"""The Qwen2-VL / Qwen2.5-VL vision tower: host-side patch layout (NumPy) and the encoder (JAX).

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

Attention is dense over the bucket under a mask (same frame; in Qwen2.5-VL's window blocks also
the same window; padding rows see only themselves, so no row is fully masked and nothing is NaN),
so a block holds [heads, bucket, bucket] fp32 scores: choose buckets with that in mind.
All compute is fp32 with HIGHEST-precision dots (HF parity within 1e-4).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

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

__all__ = [
    "ARCHITECTURES", "VISION_ACTIVATIONS", "VisionArrays", "VisionConfig", "VisionLayout", "encode_images",
    "image_features", "pad_patches", "patch_bucket", "vision_layout", "vision_params_from_hf", "vision_tensor_names",
]

HIGHEST = jax.lax.Precision.HIGHEST
MIN_BUCKET = 64


class VisionArrays(NamedTuple):
    """The traced per-patch inputs of `encode_images` (int32; bucket = padded patch count).

    order     [bucket]          processing slot i holds input patch ``order[i]`` (HF's order for
                                Qwen2-VL; the window permutation for Qwen2.5-VL; padding: i)
    positions [bucket, 2]       rotary (row, column) of the patch in slot i (padding: 0)
    segment   [bucket]          frame id of slot i (one per image and temporal frame; padding: -1)
    window    [bucket]          window id of slot i (Qwen2-VL: the frame id; padding: -1)
    unorder   [bucket // m²]    output row j is merged slot ``unorder[j]`` (undoes ``order``)
    """

    order: Any
    positions: Any
    segment: Any
    window: Any
    unorder: Any


@dataclasses.dataclass(frozen=True, eq=False)
class VisionLayout:
    """`vision_layout`'s result: the traced `arrays` and the host-side sizes around them."""

    grid_thw: np.ndarray  # [n_images, 3] int64
    bucket: int
    n_patches: int  # real patch rows: sum(t·h·w)
    n_tokens: int  # real feature rows: n_patches // merge²
    tokens_per_image: tuple[int, ...]  # t·h·w // merge² for each image (HF's get_image_features split)
    arrays: VisionArrays


def patch_bucket(n_patches: int, unit: int = 4, minimum: int = MIN_BUCKET) -> int:
    """The bucket for ``n_patches`` patches: the next power of two ≥ max(n_patches, minimum),
    rounded up to a multiple of ``unit`` (merge²)."""
    if n_patches < 1:
        raise ConfigError(f"n_patches={n_patches} is invalid: an image has at least one patch")
    size = 1 << (max(int(n_patches), minimum) - 1).bit_length()
    return -(-size // unit) * unit


def _grid(grid_thw: Any, cfg: VisionConfig) -> np.ndarray:
    grid = np.asarray(grid_thw)
    if grid.ndim != 2 or grid.shape[0] < 1 or grid.shape[1] != 3 or not np.issubdtype(grid.dtype, np.integer):
        raise ConfigError(f"grid_thw must be an integer array [n_images, 3] (t, h, w), got shape {grid.shape} {grid.dtype}")
    grid = grid.astype(np.int64)
    m = cfg.spatial_merge_size
    bad = [tuple(int(v) for v in row) for row in grid if row.min() < 1 or row[1] % m or row[2] % m]
    if bad:
        raise ConfigError(f"grid_thw rows {bad} are invalid: t, h, w must be ≥ 1 and h, w multiples of spatial_merge_size={m}")
    return grid


def _merge_order(h: int, w: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Row and column of each patch of an h×w frame in HF's merge-window order."""
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    block = lambda a: a.reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).reshape(-1)  # noqa: E731
    return block(rows), block(cols)


def _window_index(t: int, lh: int, lw: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """HF's ``get_vision_window_index`` for one image of t frames of lh×lw merged tokens: the
    merged-token permutation (windows of size×size tokens, frame by frame, each window
    row-major) and the window id of each permuted token (0-based, windows never empty)."""
    nh, nw = -(-lh // size), -(-lw // size)
    padded = np.full((t, nh * size, nw * size), -1, dtype=np.int64)
    padded[:, :lh, :lw] = np.arange(t * lh * lw).reshape(t, lh, lw)
    windows = padded.reshape(t, nh, size, nw, size).transpose(0, 1, 3, 2, 4).reshape(t * nh * nw, size * size)
    ids = np.broadcast_to(np.arange(t * nh * nw)[:, None], windows.shape)
    keep = windows >= 0
    return windows[keep], ids[keep]


def vision_layout(grid_thw: Any, cfg: VisionConfig, bucket: int) -> VisionLayout:
    """The per-patch arrays for images of ``grid_thw`` [n_images, 3], padded to ``bucket``
    patches (a multiple of merge², ≥ the total patch count; else a `ConfigError`)."""
    grid = _grid(grid_thw, cfg)
    m, unit = cfg.spatial_merge_size, cfg.merge_unit
    n_patches = int(np.prod(grid, axis=1).sum())
    if bucket % unit or bucket < n_patches:
        raise ConfigError(
            f"bucket={bucket} cannot hold these images: it must be a multiple of merge²={unit} and ≥ their "
            f"{n_patches} patches (patch_bucket gives one)"
        )
    positions, segment, merged_order, merged_window = [], [], [], []
    frames = tokens = windows = 0
    for t, h, w in grid.tolist():
        rows, cols = _merge_order(h, w, m)
        positions.append(np.tile(np.stack([rows, cols], axis=-1), (t, 1)))
        segment.append(np.repeat(np.arange(frames, frames + t), h * w))
        frames += t
        n_merged = t * (h // m) * (w // m)
        if cfg.windowed:
            index, ids = _window_index(t, h // m, w // m, cfg.window_tokens)
            merged_order.append(index + tokens)
            merged_window.append(ids + windows)
            windows += int(ids.max()) + 1
        tokens += n_merged
    positions, segment = np.concatenate(positions), np.concatenate(segment)
    if cfg.windowed:
        merged = np.concatenate(merged_order)
        order = (merged[:, None] * unit + np.arange(unit)).reshape(-1)
        window = np.repeat(np.concatenate(merged_window), unit)
        positions, segment = positions[order], segment[order]
        unorder = np.argsort(merged, kind="stable")
    else:
        order, window, unorder = np.arange(n_patches), segment, np.arange(tokens)
    pad = bucket - n_patches

    def padded(a: np.ndarray, fill: Any, length: int) -> np.ndarray:
        tail = np.arange(len(a), length) if fill is None else np.full((length - len(a), *a.shape[1:]), fill)
        return np.concatenate([a, tail]).astype(np.int32)

    arrays = VisionArrays(
        order=padded(order, None, bucket),
        positions=np.concatenate([positions, np.zeros((pad, 2), np.int64)]).astype(np.int32),
        segment=padded(segment, -1, bucket),
        window=padded(window, -1, bucket),
        unorder=padded(unorder, None, bucket // unit),
    )
    per_image = tuple(int(t * h * w) // unit for t, h, w in grid.tolist())
    return VisionLayout(grid, bucket, n_patches, n_patches // unit, per_image, arrays)


def pad_patches(pixel_values: Any, cfg: VisionConfig, bucket: int) -> np.ndarray:
    """pixel_values [n_patches, patch_dim] -> [bucket, patch_dim] float32, zero rows appended."""
    pixels = np.asarray(pixel_values, dtype=np.float32)
    if pixels.ndim != 2 or pixels.shape[1] != cfg.patch_dim or pixels.shape[0] > bucket:
        raise ConfigError(
            f"pixel_values of shape {pixels.shape} do not fit: expected [n ≤ bucket={bucket}, "
            f"C·t·p·p={cfg.patch_dim}] rows"
        )
    return np.concatenate([pixels, np.zeros((bucket - len(pixels), cfg.patch_dim), np.float32)])


# ---------------------------------------------------------------------------------------- JAX


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


def encode_images(params: dict, cfg: VisionConfig, pixel_values: jax.Array, arrays: VisionArrays) -> jax.Array:
    """pixel_values [bucket, patch_dim] (HF's rows, zero-padded: `pad_patches`) and the layout's
    `VisionArrays` -> features [bucket // merge², out_hidden_size] fp32.

    Rows ``[:layout.n_tokens]`` are the images' features in HF's order (what HF's tower returns
    as ``pooler_output``); the rest are padding, to be ignored. Jit with ``cfg`` static:
    ``jax.jit(encode_images, static_argnums=1)``; images of any size in one bucket share a compile."""
    bucket, unit = pixel_values.shape[0], cfg.merge_unit
    if pixel_values.ndim != 2 or pixel_values.shape[1] != cfg.patch_dim or bucket % unit:
        raise ConfigError(f"pixel_values shape {pixel_values.shape} is invalid: expected [bucket (a multiple of {unit}), {cfg.patch_dim}]")
    if arrays.order.shape != (bucket,) or arrays.unorder.shape != (bucket // unit,):
        raise ConfigError(f"the layout arrays are for bucket={arrays.order.shape[0]}, pixel_values for {bucket}")
    x = _linear(pixel_values.astype(jnp.float32), params["patch_embed"])
    x = jnp.take(x, arrays.order, axis=0)
    cos, sin = _rotary(cfg, arrays.positions)
    frame_mask = _mask(arrays.segment)
    window_mask = _mask(arrays.window) if cfg.windowed else frame_mask
    full = jnp.asarray([cfg.full_attention(i) for i in range(cfg.depth)])

    def step(x: jax.Array, layer: tuple[dict, jax.Array]) -> tuple[jax.Array, None]:
        p, is_full = layer
        mask = jnp.where(is_full, frame_mask, window_mask) if cfg.windowed else frame_mask
        return _block(cfg, x, p, cos, sin, mask), None

    x, _ = jax.lax.scan(step, x, (params["blocks"], full))
    m = params["merger"]
    h = _norm(cfg, x, m["ln_q_w"], m.get("ln_q_b")).reshape(bucket // unit, cfg.merger_dim)
    h = _linear(jax.nn.gelu(_linear(h, m["mlp0_w"], m["mlp0_b"]), approximate=False), m["mlp2_w"], m["mlp2_b"])
    return jnp.take(h, arrays.unorder, axis=0)


_encode_jit = jax.jit(encode_images, static_argnums=1)


def image_features(params: dict, cfg: VisionConfig, pixel_values: Any, grid_thw: Any, bucket: int | None = None) -> np.ndarray:
    """Host convenience: HF-style pixel_values [n_patches, patch_dim] and grid_thw [n_images, 3]
    -> the real features [n_tokens, out_hidden_size] (NumPy), in HF's order, through one jitted
    `encode_images` (``bucket`` defaults to `patch_bucket`)."""
    grid = _grid(grid_thw, cfg)
    n_patches = int(np.prod(grid, axis=1).sum())
    if np.shape(pixel_values)[0] != n_patches:
        raise ConfigError(f"pixel_values has {np.shape(pixel_values)[0]} rows but grid_thw describes {n_patches} patches")
    bucket = patch_bucket(n_patches, cfg.merge_unit) if bucket is None else bucket
    layout = vision_layout(grid, cfg, bucket)
    out = _encode_jit(params, cfg, pad_patches(pixel_values, cfg, bucket), layout.arrays)
    return np.asarray(out[: layout.n_tokens])
