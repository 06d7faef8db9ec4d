"""Qwen2-VL / Qwen2.5-VL image preprocessing in NumPy and PIL: images in, vision patches out.

Each image is resized (PIL, bicubic) so both sides are multiples of `patch_size * merge_size`
(28) with its pixel count inside [min_pixels, max_pixels] (`smart_resize`), rescaled to [0, 1],
normalised with the OpenAI CLIP mean and std, its single frame repeated `temporal_patch_size`
times, and cut into flat patches of `3 * 2 * 14 * 14 = 1176` values in the vision tower's order.

The result equals what transformers' `Qwen2VLImageProcessorPil` returns (`pixel_values`,
`image_grid_thw`) for the same images, without torch or torchvision. Two deliberate differences,
both for inputs HF treats oddly: a float array is always read as values in [0, 1] (HF reads an
all-integer float array, such as a 0/1 mask, as 0..255, and rescales [0, 1] floats twice unless
called with `do_rescale=False`), and an image file with transparency is composited onto white,
as a PIL image is (HF's path loader drops the alpha channel instead).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Union

import numpy as np
import PIL.Image
import PIL.ImageOps

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200  # the vision tower's limit, as HF's smart_resize enforces it

ImageInput = Union[PIL.Image.Image, str, os.PathLike, np.ndarray]


class ImageError(ValueError):
    """An image or image-processor setting popjax cannot use; the message names it."""


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _positive_int(name: str, value: Any) -> int:
    # bool is an int subclass; True as a patch size is a config mistake, not 1
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ImageError(f"{name} must be a positive integer, got {_short(value)}")
    return int(value)


def smart_resize(
    height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56, max_pixels: int = 14 * 14 * 4 * 1280
) -> tuple[int, int]:
    """The (height, width) HF's Qwen2-VL processor resizes a `height x width` image to.

    Both sides become multiples of `factor`, rounded to nearest (Python's `round`: halves go to
    the even multiple, so 70 -> 56 but 98 -> 112); if that leaves more than `max_pixels` or fewer
    than `min_pixels`, both sides are scaled by one factor (floor when shrinking, ceil when
    growing), so the aspect ratio is kept as closely as the grid allows.
    """
    for side in (height, width):
        if isinstance(side, bool) or not isinstance(side, (int, np.integer)) or side <= 0:
            raise ImageError(
                f"image size {_short(height)}x{_short(width)} (height x width) is invalid; "
                "both sides must be positive integers"
            )
    height, width = int(height), int(width)
    factor = _positive_int("factor", factor)
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ImageError(
            f"image size {height}x{width} (height x width) has aspect ratio {ratio:.1f}; "
            f"Qwen2-VL accepts at most {MAX_ASPECT_RATIO} (longer side / shorter side)"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


_RESAMPLE_NAMES = {int(r): r.name.lower() for r in sorted(PIL.Image.Resampling)}

# preprocessor_config.json keys: read, must be true (popjax always does that step), or ignored
# (metadata, and HF call options Qwen2VL's processor itself ignores)
_READ_KEYS = frozenset({
    "patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels", "size",
    "image_mean", "image_std", "resample", "rescale_factor",
})
_TRUE_KEYS = frozenset({"do_resize", "do_rescale", "do_normalize", "do_convert_rgb"})
_IGNORED_KEYS = frozenset({
    "image_processor_type", "processor_class", "_processor_class", "feature_extractor_type", "auto_map",
    "data_format", "input_data_format", "default_to_square", "device", "disable_grouping",
    "return_tensors", "do_center_crop", "crop_size", "do_pad", "pad_size",
})


@dataclasses.dataclass(frozen=True)
class ImageProcessorConfig:
    """Qwen2-VL image preprocessing settings; the defaults are HF's `Qwen2VLImageProcessor`'s."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    resample: int = int(PIL.Image.Resampling.BICUBIC)
    rescale_factor: float = 1 / 255

    def __post_init__(self) -> None:
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
            object.__setattr__(self, name, _positive_int(name, getattr(self, name)))
        if self.max_pixels < self.min_pixels:
            raise ImageError(f"max_pixels {self.max_pixels} is below min_pixels {self.min_pixels}")
        for name in ("image_mean", "image_std"):
            value = getattr(self, name)
            try:
                floats = tuple(float(v) for v in value)
            except (TypeError, ValueError):
                floats = ()
            if len(floats) != 3 or not all(math.isfinite(v) for v in floats):
                raise ImageError(f"{name} must be 3 finite numbers (R, G, B), got {_short(value)}")
            if name == "image_std" and min(floats) <= 0:
                raise ImageError(f"image_std must be positive, got {_short(value)}")
            object.__setattr__(self, name, floats)
        if isinstance(self.resample, bool) or self.resample not in _RESAMPLE_NAMES:
            raise ImageError(
                f"resample must be a PIL resampling filter code {_RESAMPLE_NAMES} "
                f"(3 = bicubic, Qwen2-VL's), got {_short(self.resample)}"
            )
        object.__setattr__(self, "resample", int(self.resample))
        rescale = self.rescale_factor
        if isinstance(rescale, bool) or not isinstance(rescale, (int, float)) or not 0 < rescale < math.inf:
            raise ImageError(f"rescale_factor must be a positive number (1/255), got {_short(rescale)}")

    @property
    def factor(self) -> int:
        """Both resized sides are multiples of this: one merged patch is factor x factor pixels."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> ImageProcessorConfig:
        """Reads a `preprocessor_config.json` dict as HF writes it.

        Pixel limits come from `size` (`{"shortest_edge": min, "longest_edge": max}`, what
        transformers 5 writes; older files wrote `{"min_pixels", "max_pixels"}`), and top-level
        `min_pixels` / `max_pixels` override them, as HF's constructor does. A key popjax does not
        know, or a setting it cannot honour, raises `ImageError`.
        """
        if not isinstance(config, Mapping):
            raise ImageError(f"preprocessor config must be a dict, got {type(config).__name__}")
        # JSON null means "not set" in HF's files
        given = {k: v for k, v in config.items() if v is not None}
        unknown = sorted(set(given) - _READ_KEYS - _TRUE_KEYS - _IGNORED_KEYS)
        if unknown:
            raise ImageError(
                f"unknown image processor setting(s) {unknown}; known: {sorted(_READ_KEYS | _TRUE_KEYS)}"
            )
        for key in sorted(_TRUE_KEYS & set(given)):
            if given[key] is not True:
                raise ImageError(
                    f"{key}={_short(given[key])} is not supported; popjax always does this step (true)"
                )
        plain = _READ_KEYS - {"size", "min_pixels", "max_pixels"}
        fields: dict[str, Any] = {k: given[k] for k in plain if k in given}
        # HF replaces its default size with the file's when the file has one (no merging)
        if "size" in given:
            size = given["size"]
            size_keys = {"shortest_edge", "longest_edge", "min_pixels", "max_pixels"}
            if not isinstance(size, Mapping) or set(size) - size_keys:
                raise ImageError(
                    "size must be {'shortest_edge': min_pixels, 'longest_edge': max_pixels}, "
                    f"got {_short(size)}"
                )
            low = size.get("shortest_edge", size.get("min_pixels"))
            high = size.get("longest_edge", size.get("max_pixels"))
        else:
            low, high = cls.min_pixels, cls.max_pixels
        low, high = given.get("min_pixels", low), given.get("max_pixels", high)
        if low is None or high is None:
            raise ImageError(
                f"size {_short(given['size'])} lacks shortest_edge or longest_edge (pixel limits)"
            )
        return cls(min_pixels=low, max_pixels=high, **fields)


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: == on arrays is not a bool
class PixelBatch:
    """Images ready for the Qwen2-VL vision tower.

    pixel_values: float32 [sum over images of t*h*w, 3 * temporal_patch_size * patch_size**2],
        each row one patch, channels outermost, then time, then patch rows and columns.
    grid_thw: int64 [n_images, 3], each image's patch grid (time, height, width); t is 1 for an
        image (its one frame is repeated to fill the temporal patch).
    """

    pixel_values: np.ndarray
    grid_thw: np.ndarray


_VALID_INPUT = "a PIL image, a path (str or pathlib.Path) or a NumPy array [H, W], [H, W, 3] or [H, W, 4]"


def _from_pil(image: PIL.Image.Image) -> np.ndarray:
    if image.width == 0 or image.height == 0:
        raise ImageError(
            f"image {_short(image)} is empty (size {image.height}x{image.width}); expected at least 1x1"
        )
    # as HF's convert_to_rgb: transparency (an alpha band, or a palette's transparent index) is
    # composited onto white; a plain convert("RGB") would keep whatever colour hides under it
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = PIL.Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        rgb = PIL.Image.alpha_composite(white, rgba).convert("RGB")
    else:
        rgb = image.convert("RGB")
    return np.asarray(rgb, dtype=np.uint8)


def _from_path(path: str | os.PathLike) -> np.ndarray:
    path = Path(path)
    if not path.is_file():
        raise ImageError(f"image file {str(path)!r} does not exist or is not a file; expected {_VALID_INPUT}")
    try:
        with PIL.Image.open(path) as opened:
            # a camera's EXIF orientation tag says which way is up; HF's loader applies it too
            return _from_pil(PIL.ImageOps.exif_transpose(opened))
    except ImageError:
        raise
    except (OSError, ValueError, SyntaxError) as e:  # PIL's errors for a corrupt or foreign file
        raise ImageError(
            f"cannot read image file {str(path)!r} ({e}); expected an image file PIL opens"
        ) from None


def _from_array(array: np.ndarray) -> np.ndarray:
    shape = tuple(array.shape)
    if array.ndim == 2:
        array = array[:, :, None]
    if array.ndim != 3 or array.shape[2] not in (1, 3, 4):
        raise ImageError(f"image array has shape {shape}; expected [H, W], [H, W, 1], [H, W, 3] or [H, W, 4]")
    if array.shape[0] == 0 or array.shape[1] == 0:
        raise ImageError(f"image array of shape {shape} is empty; expected height and width of at least 1")
    is_float = np.issubdtype(array.dtype, np.floating)
    if array.dtype != np.uint8 and not is_float:
        raise ImageError(f"image array has dtype {array.dtype}; expected uint8 (0..255) or float (0..1)")
    if is_float and not (np.all(np.isfinite(array)) and array.min() >= 0 and array.max() <= 1):
        raise ImageError(
            f"float image array has values in [{array.min()}, {array.max()}]; "
            "expected finite values in [0, 1]"
        )
    if array.shape[2] == 1:
        array = np.repeat(array, 3, axis=2)
    elif array.shape[2] == 4:
        # HF's convert_to_rgb for arrays: composite onto white in the array's own dtype, rounding
        # uint8 results (the PIL route above rounds its own way, as HF's does for PIL images)
        white = 1.0 if is_float else 255
        alpha = array[..., 3:4] / white
        composite = alpha * array[..., :3] + (1 - alpha) * white
        array = composite.astype(array.dtype) if is_float else np.round(composite).astype(np.uint8)
    if is_float:
        # HF hands floats to PIL as uint8 by scaling in float64, casting to float32, then
        # truncating (not rounding); doing the same keeps every pixel equal to HF's
        array = (array.astype(np.float64) * 255).astype(np.float32).astype(np.uint8)
    return np.ascontiguousarray(array)


def load_image(image: ImageInput) -> np.ndarray:
    """Reads one image as uint8 RGB [H, W, 3].

    image: a PIL image (any mode; transparency composited onto white), a path to an image file
    (str or pathlib.Path; its EXIF orientation applied), or a NumPy array [H, W], [H, W, 1],
    [H, W, 3] or [H, W, 4], channels last, uint8 or float in [0, 1].
    """
    if isinstance(image, PIL.Image.Image):
        try:
            return _from_pil(image)
        except (OSError, SyntaxError) as e:  # a lazily opened file that fails to decode
            raise ImageError(f"cannot decode image {_short(image)} ({e})") from None
    if isinstance(image, (str, os.PathLike)):
        return _from_path(image)
    if isinstance(image, np.ndarray):
        return _from_array(image)
    raise ImageError(
        f"unsupported image {_short(image)} of type {type(image).__name__}; expected {_VALID_INPUT}"
    )


def _patchify(image: np.ndarray, cfg: ImageProcessorConfig) -> np.ndarray:
    """float32 [H, W, 3] -> [grid_h * grid_w, 3 * temporal_patch_size * patch_size**2].

    Rows go merge window by merge window (each 2x2 window's four patches adjacent, as the
    vision tower's patch merger expects); within a row: channel, time, patch row, patch column.
    """
    height, width, channels = image.shape
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    grid_h, grid_w = height // p, width // p
    x = image.reshape(grid_h // m, m, p, grid_w // m, m, p, channels)
    x = x.transpose(0, 3, 1, 4, 6, 2, 5)  # (gh/m, gw/m, m, m, C, p, p): HF's order
    # one frame repeated to fill the temporal patch, so images share the video patch embedding
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))
    return x.reshape(grid_h * grid_w, channels * t * p * p)


def preprocess(
    images: ImageInput | Sequence[ImageInput], cfg: ImageProcessorConfig | None = None
) -> PixelBatch:
    """Images (one, or a list) -> PixelBatch of all their patches in order, as HF's processor.

    Each image is resized to `smart_resize`'s size (an image above max_pixels shrinks, one below
    min_pixels grows), scaled by rescale_factor, normalised, and patchified.
    """
    cfg = ImageProcessorConfig() if cfg is None else cfg
    items = list(images) if isinstance(images, (list, tuple)) else [images]
    if not items:
        raise ImageError(f"no images given ({_short(images)}); expected one image or a non-empty list")
    mean = np.asarray(cfg.image_mean, dtype=np.float32)
    std = np.asarray(cfg.image_std, dtype=np.float32)
    patches, grids = [], []
    for index, item in enumerate(items):
        try:
            rgb = load_image(item)
            height, width = smart_resize(
                rgb.shape[0], rgb.shape[1], cfg.factor, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels
            )
        except ImageError as e:
            raise (ImageError(f"image {index}: {e}") if len(items) > 1 else e) from None
        # HF resizes even when the size is unchanged; PIL returns an equal copy then
        resized = np.asarray(PIL.Image.fromarray(rgb).resize((width, height), resample=cfg.resample))
        # HF's order and precision: scale in float64, cast to float32, normalise in float32
        scaled = (resized.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
        patches.append(_patchify((scaled - mean) / std, cfg))
        grids.append((1, height // cfg.patch_size, width // cfg.patch_size))
    return PixelBatch(
        pixel_values=np.ascontiguousarray(np.concatenate(patches, axis=0), dtype=np.float32),
        grid_thw=np.asarray(grids, dtype=np.int64),
    )


def image_token_counts(grid_thw: np.ndarray | Sequence[Sequence[int]], merge_size: int = 2) -> list[int]:
    """Placeholder tokens per image: its t*h*w patches merged merge_size x merge_size into one token.

    grid_thw: int [n_images, 3] (PixelBatch.grid_thw). Returns n_images counts.
    """
    grid = np.asarray(grid_thw)
    if grid.ndim != 2 or grid.shape[1] != 3 or not np.issubdtype(grid.dtype, np.integer):
        raise ImageError(f"grid_thw must be integers of shape [n_images, 3], got {_short(grid_thw)}")
    merge_size = _positive_int("merge_size", merge_size)
    return [int(t * h * w) // (merge_size * merge_size) for t, h, w in grid.tolist()]
