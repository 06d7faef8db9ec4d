"""popjax.images against transformers' Qwen2VLImageProcessorPil: same patches, same grids, and
one clear ImageError for each kind of bad input."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import PIL.Image
import pytest

from popjax.images import (
    ImageError,
    ImageProcessorConfig,
    PixelBatch,
    image_token_counts,
    load_image,
    preprocess,
    smart_resize,
)

SMALL = ImageProcessorConfig(min_pixels=28 * 28, max_pixels=28 * 28 * 12)  # at most 12 merged tokens


def _hf_processor(cfg: ImageProcessorConfig):
    module = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    return module.Qwen2VLImageProcessorPil(min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)


def _assert_matches_hf(images, cfg=ImageProcessorConfig(), hf_images=None, **hf_kwargs):
    """preprocess(images) equals HF's processor on hf_images (default: the same images)."""
    ours = preprocess(images, cfg)
    hf_images = images if hf_images is None else hf_images
    hf = _hf_processor(cfg)(images=hf_images, return_tensors="np", **hf_kwargs)
    assert isinstance(ours, PixelBatch)
    assert ours.pixel_values.dtype == np.float32 and ours.grid_thw.dtype == np.int64
    np.testing.assert_array_equal(ours.grid_thw, hf["image_grid_thw"])
    assert ours.pixel_values.shape == hf["pixel_values"].shape
    np.testing.assert_allclose(ours.pixel_values, hf["pixel_values"], rtol=0, atol=1e-5)
    return ours


def _random_rgb(height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _digit(index: int, size: int = 56) -> PIL.Image.Image:
    """A real handwritten digit (8x8, values 0..16) as a grayscale PIL image upscaled to size."""
    datasets = pytest.importorskip("sklearn.datasets")
    pixels = datasets.load_digits().images[index]
    gray = np.round(pixels * (255 / 16)).astype(np.uint8)
    return PIL.Image.fromarray(gray, mode="L").resize((size, size), PIL.Image.Resampling.BICUBIC)


def test_small_rgb_image_matches_hf():
    image = _random_rgb(60, 90)
    batch = _assert_matches_hf(image)
    np.testing.assert_array_equal(batch.grid_thw, [[1, 4, 6]])  # 60x90 -> 56x84 pixels
    assert batch.pixel_values.shape == (24, 3 * 2 * 14 * 14)
    _assert_matches_hf(PIL.Image.fromarray(image))


@pytest.mark.parametrize("size", [(71, 113), (42, 70), (29, 300), (333, 97)])
def test_size_not_a_multiple_of_28_matches_hf(size):
    # 42 = 1.5 * 28 and 70 = 2.5 * 28: Python's round sends halves to the even multiple
    _assert_matches_hf(_random_rgb(*size, seed=sum(size)))


def test_two_images_of_different_sizes_in_one_call():
    images = [_random_rgb(45, 100, seed=1), _digit(3).convert("RGB")]
    batch = _assert_matches_hf(images)
    assert batch.grid_thw.shape == (2, 3)
    assert batch.pixel_values.shape[0] == int(np.prod(batch.grid_thw, axis=1).sum())


def test_grayscale_and_transparent_images_match_hf():
    rng = np.random.default_rng(2)
    _assert_matches_hf(_digit(7))  # mode "L"
    rgba = rng.integers(0, 256, (50, 64, 4), dtype=np.uint8)
    _assert_matches_hf(PIL.Image.fromarray(rgba, mode="RGBA"))  # alpha composited onto white
    _assert_matches_hf(rgba)  # the array route rounds its own composite, as HF's does
    gray = np.asarray(_digit(1, size=60))
    # HF cannot take a 2-D array (it reads it as a list of rows); [H, W, 1] is the same image
    _assert_matches_hf(gray, hf_images=gray[:, :, None])
    np.testing.assert_array_equal(load_image(gray), np.repeat(gray[:, :, None], 3, axis=2))


def test_float_array_images_match_hf():
    rng = np.random.default_rng(3)
    for channels in (3, 4):
        image = rng.random((57, 85, channels), dtype=np.float32)
        # HF rescales [0, 1] floats by 1/255 twice unless told they are already rescaled
        _assert_matches_hf(image, do_rescale=False)
    exact = _random_rgb(30, 40, seed=4)
    np.testing.assert_array_equal(load_image(exact / 255.0), exact)


def test_image_above_max_pixels_is_resized_down():
    image = _random_rgb(200, 310, seed=5)
    batch = _assert_matches_hf(image, SMALL)
    t, h, w = batch.grid_thw[0]
    assert h * w * 14 * 14 <= SMALL.max_pixels
    assert image_token_counts(batch.grid_thw, SMALL.merge_size) == [t * h * w // 4]


def test_paths_match_hf(tmp_path: Path):
    path = tmp_path / "digit.png"
    _digit(5, size=90).convert("RGB").save(path)
    _assert_matches_hf(str(path))
    batch = preprocess([path, str(path)])
    np.testing.assert_array_equal(batch.pixel_values[: len(batch.pixel_values) // 2],
                                  batch.pixel_values[len(batch.pixel_values) // 2:])


def test_smart_resize_matches_hf_on_a_grid():
    module = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    sizes = [1, 2, 13, 14, 27, 28, 29, 42, 55, 56, 70, 98, 111, 224, 333, 500, 1000, 1999]
    limits = [(56 * 56, 14 * 14 * 4 * 1280), (28 * 28, 28 * 28 * 12), (1000, 5000), (3136, 12845056)]
    for min_pixels, max_pixels in limits:
        for height in sizes:
            for width in sizes:
                if max(height, width) / min(height, width) > 200:
                    continue
                expected = module.smart_resize(height, width, 28, min_pixels, max_pixels)
                assert smart_resize(height, width, 28, min_pixels, max_pixels) == expected, (height, width)
    assert smart_resize(60, 90) == module.smart_resize(60, 90)
    with pytest.raises(ValueError):
        module.smart_resize(10, 2500)  # HF rejects it too; ours is a ValueError subclass


def test_config_from_hf_dicts():
    hf = _hf_processor(ImageProcessorConfig(min_pixels=1000, max_pixels=5000))
    cfg = ImageProcessorConfig.from_hf(hf.to_dict())  # transformers 5: size = {shortest_edge, longest_edge}
    assert (cfg.min_pixels, cfg.max_pixels, cfg.resample) == (1000, 5000, 3)
    assert cfg.image_mean == pytest.approx(hf.image_mean) and cfg.rescale_factor == pytest.approx(1 / 255)
    legacy = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
              "merge_size": 2, "image_processor_type": "Qwen2VLImageProcessor",
              "processor_class": "Qwen2VLProcessor"}
    assert ImageProcessorConfig.from_hf(legacy).max_pixels == 12845056
    # top-level limits override size, as HF's constructor does
    both = {"size": {"shortest_edge": 10, "longest_edge": 20}, "max_pixels": 30000}
    merged = ImageProcessorConfig.from_hf(both)
    assert (merged.min_pixels, merged.max_pixels) == (10, 30000)
    assert ImageProcessorConfig.from_hf({}) == ImageProcessorConfig()
    bad = [({"frobnicate": 1}, "frobnicate"), ({"do_resize": False}, "do_resize"),
           ({"resample": 9}, "resample"), ({"patch_size": 0}, "patch_size"),
           ({"size": {"height": 224}}, "height"), ({"image_mean": [0.5, 0.5]}, "image_mean"),
           ({"min_pixels": 10, "max_pixels": 5}, "max_pixels 5")]
    for config, name in bad:
        with pytest.raises(ImageError, match=name):
            ImageProcessorConfig.from_hf(config)


def test_image_token_counts():
    assert image_token_counts(np.array([[1, 4, 6], [1, 2, 2]])) == [6, 1]
    assert image_token_counts([[1, 8, 8]], merge_size=1) == [64]
    with pytest.raises(ImageError, match="grid_thw"):
        image_token_counts([1, 4, 6])


def test_bad_inputs_raise_image_error_naming_the_value(tmp_path: Path):
    missing = tmp_path / "nowhere.png"
    with pytest.raises(ImageError, match="nowhere.png"):
        load_image(missing)
    not_an_image = tmp_path / "notes.png"
    not_an_image.write_text("just text")
    with pytest.raises(ImageError, match="cannot read image file .*notes.png"):
        load_image(str(not_an_image))
    with pytest.raises(ImageError, match=r"\(0, 5, 3\).*empty"):
        load_image(np.zeros((0, 5, 3), dtype=np.uint8))
    with pytest.raises(ImageError, match=r"empty \(size 0x4\)"):
        load_image(PIL.Image.new("RGB", (4, 0)))
    with pytest.raises(ImageError, match=r"\(2, 8, 8, 3\)"):
        load_image(np.zeros((2, 8, 8, 3), dtype=np.uint8))
    with pytest.raises(ImageError, match=r"\(8, 8, 2\)"):
        load_image(np.zeros((8, 8, 2), dtype=np.uint8))
    with pytest.raises(ImageError, match="int64"):
        load_image(np.zeros((8, 8, 3), dtype=np.int64))
    out_of_range = np.zeros((8, 8, 3))
    out_of_range[0, 0, 0] = 2.0
    with pytest.raises(ImageError, match=r"\[0.0, 2.0\]"):
        load_image(out_of_range)
    with pytest.raises(ImageError, match="unsupported image 7 of type int"):
        load_image(7)
    with pytest.raises(ImageError, match=r"2x500 .*aspect ratio 250.0"):
        preprocess(np.zeros((2, 500, 3), dtype=np.uint8))
    with pytest.raises(ImageError, match=r"image 1: .*\(3, 3, 3, 3\)"):
        preprocess([_random_rgb(30, 30), np.zeros((3, 3, 3, 3), dtype=np.uint8)])
    with pytest.raises(ImageError, match="no images"):
        preprocess([])
    with pytest.raises(ImageError, match="0x5"):
        smart_resize(0, 5)
    assert math.isclose(ImageProcessorConfig().rescale_factor, 1 / 255)
