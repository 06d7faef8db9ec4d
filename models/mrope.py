"""Qwen2-VL's multimodal rotary positions (M-RoPE), for images and text.

Each token gets three positions (temporal, height, width). Text tokens carry the same value on
all three axes and count up by one; the tokens of an image (one contiguous run of
``image_token_id``, ``t·(h/m)·(w/m)`` long for a patch grid ``(t, h, w)`` and spatial merge ``m``)
count the grid cell from the position where the image starts, and the text after the image
resumes at ``start + max(h, w)/m``, so a sequence with images ends at a position below its
length. ``rope_index`` computes these positions on the host (transformers 5.25's
``Qwen2VLModel.get_rope_index``; Qwen2.5-VL's is the same for images and differs only in video
time steps); ``mrope_cos_sin`` turns them into the cos/sin that ``rope.apply_rope`` takes.

The rotary frequencies are split into consecutive chunks by ``mrope_section`` (e.g. [16, 24, 24]
of h/2 = 64 for Qwen2-VL-7B): chunk i rotates by the position of axis ``i % 3``. This is HF's
chunked layout (``Qwen2VLRotaryEmbedding.recomposition_frequencies``). Qwen3-VL interleaves them
instead (``Qwen3VLTextRotaryEmbedding.recomposition_frequencies``, ``mrope_section`` [24, 20, 20]):
frequency k is height's when k ≡ 1 (mod 3) and k < 3·s[1], width's when k ≡ 2 (mod 3) and
k < 3·s[2], and temporal's otherwise (`frequency_axes`). The angles are then repeated twice: the
half-split convention of ``rope.rope_cos_sin``.

After the prompt all three axes are equal, so decoding needs only 1-D rope at the text position
shifted by a per-row ``delta`` (``decode_positions``).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .config import ConfigError


class PositionError(ValueError):
    """The image tokens of a prompt do not match ``image_grid_thw``, or positions are mis-shaped."""


def image_runs(is_image: np.ndarray) -> list[tuple[int, int]]:
    """[n] bool -> [(start, end)] of each maximal run of True (HF groups tokens by modality the
    same way, so two images with no token between them would read as one)."""
    edges = np.diff(np.concatenate([[0], is_image.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


def _check_grids(image_grid_thw: np.ndarray | None, merge: int) -> np.ndarray:
    if image_grid_thw is None:
        return np.zeros((0, 3), np.int64)
    grids = np.asarray(image_grid_thw)
    if grids.ndim != 2 or grids.shape[1] != 3 or (grids.size and not np.issubdtype(grids.dtype, np.integer)):
        raise PositionError(
            f"image_grid_thw must be an integer array [n_images, 3], got shape {grids.shape} {grids.dtype}"
        )
    grids = grids.astype(np.int64)
    for i, (t, h, w) in enumerate(grids.tolist()):
        # the vision tower merges m×m patches into one token, so h and w must be multiples of m
        if t < 1 or h < 1 or w < 1 or h % merge or w % merge:
            raise PositionError(
                f"image_grid_thw[{i}] = (t={t}, h={h}, w={w}) is not a positive grid with h and w "
                f"multiples of spatial_merge_size={merge}"
            )
    return grids


def rope_index(
    input_ids: np.ndarray,
    attention_mask: np.ndarray | None = None,
    image_grid_thw: np.ndarray | None = None,
    *,
    image_token_id: int,
    vision_start_token_id: int | None = None,
    spatial_merge_size: int = 2,
) -> tuple[np.ndarray, np.ndarray]:
    """Qwen2-VL positions of a (padded) batch of prompts with images.

    input_ids [B, T] int; attention_mask [B, T] bool/int (None: all valid; padding may sit on
    either side, only valid tokens are numbered); image_grid_thw [n_images, 3] int: the vision
    tower's (t, h, w) patch grids, consumed in order row by row, left to right, as HF does.

    Returns positions np.int64 [3, B, T] (temporal, height, width; padding gets 0 on every axis,
    as transformers 5.25 sets it) and deltas np.int64 [B] = max position + 1 − valid length, so
    the token after the prompt sits at (valid length + delta) on all three axes.

    ``vision_start_token_id`` (optional; 5.25 no longer reads it) checks that every image run
    follows that token, as Qwen2-VL's processor writes ``<|vision_start|><|image_pad|>…``.
    Raises PositionError when the number of image-token runs differs from the number of grids or
    a run's length is not t·h·w/merge².
    """
    ids = np.asarray(input_ids)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise PositionError(f"input_ids must be an integer array [B, T], got shape {ids.shape} {ids.dtype}")
    B, T = ids.shape
    if attention_mask is None:
        mask = np.ones((B, T), bool)
    else:
        mask = np.asarray(attention_mask).astype(bool)
        if mask.shape != (B, T):
            raise PositionError(f"attention_mask has shape {mask.shape}, input_ids {ids.shape}")
    m = int(spatial_merge_size)
    if m < 1:
        raise ConfigError(f"spatial_merge_size must be >= 1, got {spatial_merge_size}")
    grids = _check_grids(image_grid_thw, m)

    rows = [ids[b][mask[b]] for b in range(B)]
    runs = [image_runs(row == image_token_id) for row in rows]
    # Count before numbering so the error states both totals (HF raises StopIteration on too few
    # grids and silently ignores extra ones).
    n_runs = sum(len(r) for r in runs)
    if n_runs != len(grids):
        raise PositionError(
            f"{n_runs} image-token runs (token id {image_token_id}; per row {[len(r) for r in runs]}) "
            f"but image_grid_thw has {len(grids)} grids"
        )

    positions = np.zeros((3, B, T), np.int64)
    deltas = np.zeros(B, np.int64)
    g = 0  # the next grid: images are consumed across rows in order
    for b, (row, row_runs) in enumerate(zip(rows, runs)):
        out = np.empty((3, len(row)), np.int64)
        cur = 0  # the next position to hand out
        text_start = 0
        for start, end in row_runs:
            if vision_start_token_id is not None and (start == 0 or row[start - 1] != vision_start_token_id):
                raise PositionError(
                    f"row {b}: image run at valid token {start} does not follow "
                    f"vision_start_token_id={vision_start_token_id}"
                )
            out[:, text_start:start] = cur + np.arange(start - text_start)
            cur += start - text_start
            t, h, w = grids[g].tolist()
            gh, gw = h // m, w // m
            if end - start != t * gh * gw:
                raise PositionError(
                    f"row {b}: image {g} has grid (t={t}, h={h}, w={w}) and spatial_merge_size={m}, so "
                    f"t*h*w/merge^2 = {t * gh * gw} tokens, but its run of token {image_token_id} has {end - start}"
                )
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
            out[:, start:end] = np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + cur
            # the image spans max(h, w)/m positions, not its token count: what follows resumes there
            cur += max(gh, gw)
            text_start = end
            g += 1
        out[:, text_start:] = cur + np.arange(len(row) - text_start)
        positions[:, b, mask[b]] = out
        # a row with no valid token has nothing to continue from: delta 0 (HF fails on it)
        deltas[b] = out.max() + 1 - len(row) if len(row) else 0
    return positions, deltas


def _check_sections(mrope_section: Sequence[int], half: int) -> np.ndarray:
    sections = np.asarray(list(mrope_section), np.int64)
    if sections.ndim != 1 or sections.size == 0 or (sections < 1).any() or int(sections.sum()) != half:
        raise ConfigError(
            f"mrope_section={list(mrope_section)} is invalid: its values must be positive integers summing to head_dim/2 = {half}"
        )
    return sections


def frequency_axes(mrope_section: Sequence[int], half: int, interleaved: bool = False) -> np.ndarray:
    """[half] int: the position axis (0 temporal, 1 height, 2 width) each rotary frequency turns
    by. Chunked (Qwen2-VL): chunk i of ``mrope_section`` takes axis ``i % 3``. Interleaved
    (Qwen3-VL): frequencies ``1, 4, 7, …`` below 3·s[1] take height, ``2, 5, 8, …`` below 3·s[2]
    width, the rest temporal (HF's slices ``offset:3·s:3``, which stop at ``half``).
    ``mrope_section`` must be positive and sum to ``half`` (= head_dim / 2), else a ConfigError."""
    sections = _check_sections(mrope_section, half)
    if not interleaved:
        return np.repeat(np.arange(sections.size) % 3, sections)
    if sections.size != 3:
        raise ConfigError(f"mrope_section={list(mrope_section)} must have 3 entries (temporal, height, width) for interleaved M-RoPE")
    axes = np.zeros(half, np.int64)
    for axis in (1, 2):
        axes[axis: 3 * int(sections[axis]): 3] = axis
    return axes


def mrope_cos_sin(
    inv_freq: jax.Array | np.ndarray, positions: jax.Array, mrope_section: Sequence[int], interleaved: bool = False
) -> tuple[jax.Array, jax.Array]:
    """inv_freq [h/2] (e.g. ``rope.inverse_frequencies(cfg)``); positions [3, B, T] int
    (``rope_index``) -> cos, sin [B, T, h] fp32 for ``rope.apply_rope``.

    Frequency k rotates by the position of axis `frequency_axes` ``[k]`` (``interleaved``:
    Qwen3-VL's layout, else Qwen2-VL's chunks), equal to HF's cos/sin after
    ``recomposition_frequencies``. With the three axes equal this is ``rope.rope_cos_sin`` at
    that position.
    """
    inv = jnp.asarray(inv_freq, jnp.float32)
    if inv.ndim != 1:
        raise PositionError(f"inv_freq must be [h/2], got shape {inv.shape}")
    axis_of = frequency_axes(mrope_section, inv.shape[0], interleaved)
    positions = jnp.asarray(positions)
    if positions.ndim != 3 or positions.shape[0] != 3:
        raise PositionError(f"positions must be [3, B, T] (temporal, height, width), got shape {positions.shape}")
    # static [h/2] axis per frequency: a gather on the host-known layout, traced positions only
    per_freq = jnp.moveaxis(positions, 0, -1)[..., axis_of].astype(jnp.float32)  # [B, T, h/2]
    # an elementwise product (no sum), as HF's `position.float() * inv_freq`: exact in fp32;
    # selecting the axis before cos/sin equals HF's selecting after
    angles = jnp.einsum("btk,k->btk", per_freq, inv, precision=jax.lax.Precision.HIGHEST)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def decode_positions(text_positions: jax.Array, deltas: jax.Array | np.ndarray) -> jax.Array:
    """text_positions [B] or [B, T] int: each token's index among its row's valid tokens (the
    engine's ``DecodeState.position``, ``cumsum(mask) − 1``; HF's cache index when there is no
    padding); deltas [B] from ``rope_index`` -> the rope position [same shape] of those tokens.

    After the prompt all three axes hold the same value (HF continues every axis from the
    prompt's last position + 1), so M-RoPE there is 1-D rope (``rope.rope_cos_sin``) at
    position + delta: ``mrope_cos_sin`` with three equal axes equals it.
    """
    p = jnp.asarray(text_positions)
    d = jnp.asarray(deltas)
    if d.ndim != 1 or p.ndim < 1 or d.shape[0] != p.shape[0]:
        raise PositionError(f"deltas must be [B] matching text_positions {p.shape}, got {d.shape}")
    return (p + d.reshape(d.shape + (1,) * (p.ndim - 1))).astype(p.dtype)
