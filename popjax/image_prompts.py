"""Images in a vision-language model's prompts: from the user's images to the engine's
`ImagePrompt` (image features at their placeholder slots, M-RoPE positions).

A Qwen2-VL prompt marks each image with its placeholder token (``image_token_id``, what the chat
template writes as ``<|image_pad|>`` between ``<|vision_start|>`` and ``<|vision_end|>``). Three
host-side steps, as transformers' processor and model take them:

1. `expand_placeholders`: each image's single placeholder becomes one token per merged patch
   (``t·h·w / merge²`` for its patch grid, `images.image_token_counts`), as the processor does.
2. The rows are left-padded into their buckets (``requests.pad_batch``).
3. `image_prompt`: the vision tower (models/vision.py, jitted per patch bucket, so a new image
   size within a bucket compiles nothing) encodes every image of the batch, in row order; each
   placeholder token takes the next feature row (``PlacedEmbeddings``; Qwen3-VL's DeepStack
   features ride along at the same slots); `models.mrope.rope_index`
   gives the [3, B, T] positions and each row's next position (its length + its rope delta).

Rows without images (text-only rows in a mixed batch) get ordinary positions (three equal axes).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .engine import ImagePrompt
from .images import ImageError, PixelBatch, image_token_counts, preprocess
from .loaded import LoadedModel
from .models.layers import PlacedEmbeddings
from .models.mrope import image_runs, rope_index
from .models.vision import encode_images_deepstack, pad_patches, patch_bucket, vision_layout


@dataclasses.dataclass(frozen=True, eq=False)
class ExpandedPrompts:
    """Token-id rows with every image placeholder expanded, and the batch's images in row order
    (``pixels`` None when no row has an image)."""

    rows: list[list[int]]
    pixels: PixelBatch | None


def check_vision_model(model: LoadedModel, what: str = "images") -> None:
    """One clear line when ``model`` has no vision tower."""
    if not model.config.is_vision_language:
        raise ImageError(f"{what} given to {model.source}, a text-only {model.config.model_type} model; "
                         "images need a vision-language model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL)")


def expand_placeholders(model: LoadedModel, rows: Sequence[Sequence[int]], images: Sequence[Sequence[Any]] | None) -> ExpandedPrompts:
    """rows: token ids per prompt, each image's placeholder one ``image_token_id`` (or a run of
    them, as a processor that already expanded it writes); images: per row, its images (PIL,
    path or array) in placeholder order -> the expanded rows and the preprocessed images.

    A row's number of placeholder runs must equal its number of images (each a clear error)."""
    rows = [list(r) for r in rows]
    if images is None or not any(len(row_images) for row_images in images):
        if model.config.is_vision_language:
            _check_no_placeholders(model, rows)
        return ExpandedPrompts(rows, None)
    check_vision_model(model)
    if len(images) != len(rows):
        raise ImageError(f"images are given for {len(images)} prompts, and there are {len(rows)} prompts: give one list per prompt")
    flat = [image for row_images in images for image in row_images]
    pixels = preprocess(flat, model.image_processor)
    counts = iter(image_token_counts(pixels.grid_thw, model.image_processor.merge_size))
    image_id = model.config.image_token_id
    out = []
    for i, (ids, row_images) in enumerate(zip(rows, images)):
        runs = image_runs(np.asarray(ids) == image_id)
        if len(runs) != len(row_images):
            raise ImageError(f"prompt {i} has {len(runs)} image placeholder(s) (token {image_id}) and {len(row_images)} image(s): "
                             "give one image per placeholder (a chat message's {'type': 'image', 'image': ...} item writes one)")
        expanded, last = [], 0
        for start, end in runs:
            expanded += ids[last:start] + [image_id] * next(counts)
            last = end
        out.append(expanded + ids[last:])
    return ExpandedPrompts(out, pixels)


def _check_no_placeholders(model: LoadedModel, rows: list[list[int]]) -> None:
    for i, ids in enumerate(rows):
        if model.config.image_token_id in ids:
            raise ImageError(f"prompt {i} has image placeholders (token {model.config.image_token_id}) and no images were given")


@functools.partial(jax.jit, static_argnums=1)
def _tower(params, cfg, pixel_values, arrays):
    """The vision tower, one compile per (config, patch bucket): (features, DeepStack features or None)."""
    return encode_images_deepstack(params, cfg, pixel_values, arrays)


def image_prompt(model: LoadedModel, pixels: PixelBatch | None, tokens: np.ndarray, mask: np.ndarray) -> ImagePrompt | None:
    """The padded batch (tokens, mask [B, T], placeholders expanded) and its images -> the
    engine's `ImagePrompt` (features [N_bucket, d] in the compute dtype, slots [B, T],
    positions [3, B, T], next positions [B]); None without images."""
    if pixels is None:
        return None
    cfg = model.config
    bucket = patch_bucket(int(pixels.pixel_values.shape[0]), cfg.vision.merge_unit)
    layout = vision_layout(pixels.grid_thw, cfg.vision, bucket)
    features, deepstack = _tower(model.vision, cfg.vision, jnp.asarray(pad_patches(pixels.pixel_values, cfg.vision, bucket)),
                                 jax.tree_util.tree_map(jnp.asarray, layout.arrays))
    slots, positions, next_position = placeholder_layout(cfg, tokens, mask, pixels.grid_thw)
    if int((slots >= 0).sum()) != layout.n_tokens:
        raise ImageError(f"the prompts hold {int((slots >= 0).sum())} image tokens and the images give {layout.n_tokens} features")
    return ImagePrompt(
        PlacedEmbeddings(features.astype(jnp.dtype(model.dtype)), jnp.asarray(slots),
                         None if deepstack is None else deepstack.astype(jnp.dtype(model.dtype))),
        jnp.asarray(positions, jnp.int32),
        jnp.asarray(next_position, jnp.int32),
    )


def placeholder_layout(cfg, tokens: np.ndarray, mask: np.ndarray, grid_thw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host-side, for a padded batch (tokens, mask [B, T], placeholders expanded) and its images'
    grids -> (slots [B, T] int32: the image feature each placeholder takes, in row order, −1
    elsewhere; M-RoPE positions [3, B, T]; each row's next position [B])."""
    tokens, mask = np.asarray(tokens), np.asarray(mask).astype(bool)
    is_image = (tokens == cfg.image_token_id) & mask
    slots = np.where(is_image, np.cumsum(is_image.reshape(-1)).reshape(is_image.shape) - 1, -1).astype(np.int32)
    positions, deltas = rope_index(tokens, mask, grid_thw, image_token_id=cfg.image_token_id,
                                   spatial_merge_size=cfg.vision.spatial_merge_size)
    return slots, positions, mask.sum(axis=1) + deltas


def split_images(prompt: Any) -> tuple[Any, list[Any]]:
    """A prompt -> (the prompt a chat template reads, its images in order). Chat messages whose
    ``content`` is a list of items (transformers' format: ``{"type": "image", "image": PIL image
    | path | array}``, ``{"type": "text", "text": ...}``) give up their images, each item left as
    ``{"type": "image"}`` for the template to write its placeholder; other prompts have none.
    A ``{"type": "video"}`` item is refused in one line (video is not supported)."""
    if isinstance(prompt, str) or not isinstance(prompt, (list, tuple)):
        return prompt, []
    images, messages = [], []
    for message in prompt:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, (list, tuple)):
            messages.append(message)
            continue
        items = []
        for item in content:
            if isinstance(item, dict) and item.get("type") == "video":  # decided: docs/vlm.md, "Decisions"
                raise ImageError("video items are not supported (popjax takes images only): give a clip's frames as "
                                 "{'type': 'image'} items, or one frame")
            if isinstance(item, dict) and item.get("type") == "image":
                if "image" not in item:
                    raise ImageError(f"a chat item {{'type': 'image'}} has no 'image' (a PIL image, path or array): {item!r}")
                images.append(item["image"])
                item = {k: v for k, v in item.items() if k != "image"}
            items.append(item)
        messages.append({**message, "content": items})
    return messages, images
