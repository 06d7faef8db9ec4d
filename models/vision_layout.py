"""The vision towers' host-side patch layout (NumPy): from ``grid_thw`` to the per-patch arrays
the jitted encoder (models/vision.py) reads, padded to a *bucket* of patch rows.

`vision_layout` gives, for a batch of images (or clips) of patch grids ``grid_thw`` [n, 3], the
order the blocks run the patches in, each patch's 2-D rotary position, the frame and window it
attends within, and (Qwen3-VL) the four taps and weights that resample its learned position
table to the image's grid (`position_taps`, HF's bilinear ``align_corners=True`` interpolation,
in merge-block order). `pad_patches` pads ``pixel_values`` to the bucket; `patch_bucket` picks it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from .hf_fields import ConfigError
from .vision_config import VisionConfig

MIN_BUCKET = 64

class VisionArrays(NamedTuple):
    """The traced per-patch inputs of `encode_images` (int32; bucket = padded patch count).

    order     [bucket]          processing slot i holds input patch ``order[i]`` (HF's order for
                                Qwen2-VL; the window permutation for Qwen2.5-VL; padding: i)
    positions [bucket, 2]       rotary (row, column) of the patch in slot i (padding: 0)
    segment   [bucket]          frame id of slot i (one per image and temporal frame; padding: -1)
    window    [bucket]          window id of slot i (Qwen2-VL: the frame id; padding: -1)
    unorder   [bucket // m²]    output row j is merged slot ``unorder[j]`` (undoes ``order``)
    pos_index [bucket, 4]       Qwen3-VL: the position-table rows patch i interpolates (else None)
    pos_weight [bucket, 4]      Qwen3-VL: their bilinear weights, float32 (padding: 0)
    """

    order: Any
    positions: Any
    segment: Any
    window: Any
    unorder: Any
    pos_index: Any = None
    pos_weight: Any = None


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
    positions, segment, merged_order, merged_window, taps = [], [], [], [], []
    frames = tokens = windows = 0
    for t, h, w in grid.tolist():
        rows, cols = _merge_order(h, w, m)
        positions.append(np.tile(np.stack([rows, cols], axis=-1), (t, 1)))
        if cfg.is_qwen3:  # every frame of a clip takes the same resampled table
            index, weight = position_taps(rows, cols, h, w, cfg.position_side)
            taps.append((np.tile(index, (t, 1)), np.tile(weight, (t, 1))))
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
    if cfg.is_qwen3:
        index, weight = (np.concatenate(part) for part in zip(*taps))
        arrays = arrays._replace(pos_index=np.concatenate([index, np.zeros((pad, 4), np.int64)]).astype(np.int32),
                                 pos_weight=np.concatenate([weight, np.zeros((pad, 4), np.float32)]))
    per_image = tuple(int(t * h * w) // unit for t, h, w in grid.tolist())
    return VisionLayout(grid, bucket, n_patches, n_patches // unit, per_image, arrays)


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps of positions ``index`` [n] on an axis of ``size`` into a table axis of
    ``side`` rows, ``align_corners=True`` (the ends map to rows 0 and side − 1): the rows
    [n, 2] (floor, floor + 1, clamped) and their weights [n, 2], in float32 as HF computes them
    (transformers.vision_utils ``_interpolation_axis_taps_weights``)."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    offsets = np.arange(2)
    rows = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
    weight = np.maximum(np.float32(1) - np.abs(src[:, None] - floor[:, None] - offsets.astype(np.float32)), np.float32(0))
    return rows, weight.astype(np.float32)


def position_taps(rows: np.ndarray, cols: np.ndarray, h: int, w: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3-VL's learned position table (side × side rows) resampled to an h × w patch grid:
    for the patches at (rows, cols) [n] -> the four table rows [n, 4] (row-major ``r·side + c``)
    and bilinear weights [n, 4] float32 each patch's position embedding sums."""
    r, wr = _axis_taps(rows, h, side)
    c, wc = _axis_taps(cols, w, side)
    index = (r[:, :, None] * side + c[:, None, :]).reshape(-1, 4)
    weight = (wr[:, :, None] * wc[:, None, :]).reshape(-1, 4)
    return index, weight


def pad_patches(pixel_values: Any, cfg: VisionConfig, bucket: int) -> np.ndarray:
    """pixel_values [n_patches, patch_dim] -> [bucket, patch_dim] float32, zero rows appended."""
    pixels = np.asarray(pixel_values, dtype=np.float32)
    if pixels.ndim != 2 or pixels.shape[1] != cfg.patch_dim or pixels.shape[0] > bucket:
        raise ConfigError(
            f"pixel_values of shape {pixels.shape} do not fit: expected [n ≤ bucket={bucket}, "
            f"C·t·p·p={cfg.patch_dim}] rows"
        )
    return np.concatenate([pixels, np.zeros((bucket - len(pixels), cfg.patch_dim), np.float32)])


