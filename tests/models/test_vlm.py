"""Qwen2-VL and Qwen2.5-VL end to end against transformers on tiny random models saved as HF
checkpoints and converted by popjax: logits of text-only prompts, one image, two images of
different sizes, a left-padded batch mixing image and text-only rows, greedy generation (8 new
tokens, so the decode positions after an image continue as HF's do), and the errors for images
a prompt cannot take. The images are real: scikit-learn's handwritten digits, upscaled."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import popjax
from popjax.images import ImageError, preprocess
from popjax.loading import build_model
from popjax.models.vision import image_features
from popjax.pruned import checkpoint_tree
from tests.reference.vlm import ARCHS, BOS, IMAGE, PAD, VISION_END, VISION_START, digit, expanded, hf_logits, hf_model, ours_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tmp_path_factory):
    """(HF model, popjax model converted from its saved checkpoint)."""
    hf = hf_model(request.param)
    directory = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(directory)
    return hf, popjax.load(str(directory), cache=False)


CASES = {
    "text_only": lambda: [expanded([[5, 6, 7, 8, 9, 10, 11]])],
    "one_image": lambda: [expanded([[5, 6], digit(0, (56, 56)), [7, 8, 9]])],
    "two_images_of_different_sizes": lambda: [expanded([[5], digit(1, (56, 56)), [6, 7], digit(2, (84, 112)), [8, 9]])],
    "mixed_padded_batch": lambda: [expanded([[5, 6], digit(3, (84, 56)), [7]]), expanded([[10, 11, 12]]),
                                   expanded([digit(4, (56, 84)), [13, 14, 15, 16]])],
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(pair, case):
    hf, model = pair
    rows, images = zip(*CASES[case]())
    want, mask = hf_logits(hf, list(rows), list(images))
    got = ours_logits(model, list(rows), list(images))
    valid = mask.astype(bool)
    np.testing.assert_allclose(got[valid], want[valid], atol=1e-4, rtol=1e-4)
    assert np.abs(want[valid]).max() > 1.0  # the check can fail: logits far from flat


def test_vision_tower_matches_get_image_features(pair):
    hf, model = pair
    images = [digit(5, (56, 84)), digit(6, (112, 84))]
    pixels = preprocess(images)
    with torch.no_grad():
        out = hf.model.get_image_features(torch.from_numpy(pixels.pixel_values), torch.from_numpy(pixels.grid_thw))
    want = torch.cat(list(out.pooler_output if hasattr(out, "pooler_output") else out)).numpy()
    got = image_features(model.vision, model.config.vision, pixels.pixel_values, pixels.grid_thw)
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_greedy_generation_matches_transformers(pair):
    """8 greedy tokens after prompts with images (one padded batch with a text-only row): the
    decode positions continue from each row's rope delta."""
    hf, model = pair
    rows, images = zip(expanded([[5, 6], digit(7, (56, 56)), [7, 8]]), expanded([[20, 21, 22, 23, 24]]))
    ours, _ = popjax.generate_ids(model, list(rows), max_new_tokens=8, images=list(images), ignore_eos=True)
    for row, row_images, got in zip(rows, images, ours):
        kwargs = {}
        if row_images:
            pixels = preprocess(row_images)
            ids = torch.tensor([row])
            kwargs = dict(pixel_values=torch.from_numpy(pixels.pixel_values), image_grid_thw=torch.from_numpy(pixels.grid_thw),
                          mm_token_type_ids=(ids == IMAGE).long())
        with torch.no_grad():
            out = hf.generate(input_ids=torch.tensor([row]), attention_mask=torch.ones((1, len(row)), dtype=torch.long),
                              max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=PAD, **kwargs)
        assert got == out[0, len(row):].tolist()


def test_single_placeholders_are_expanded(pair):
    """A prompt with one placeholder per image (as a chat template writes it) generates as its
    expanded form does."""
    _, model = pair
    image = digit(8, (84, 56))
    full, _ = expanded([[5], image, [6]])
    short = [BOS, 5, VISION_START, IMAGE, VISION_END, 6]
    a, _ = popjax.generate_ids(model, [full], max_new_tokens=4, images=[[image]], ignore_eos=True)
    b, _ = popjax.generate_ids(model, [short], max_new_tokens=4, images=[[image]], ignore_eos=True)
    assert a == b


def test_bad_image_input(pair, tmp_path):
    _, model = pair
    image = digit(9, (56, 56))
    one, _ = expanded([[5], image, [6]])
    with pytest.raises(ImageError, match="2 image\\(s\\)"):
        popjax.generate_ids(model, [one], max_new_tokens=2, images=[[image, image]])
    with pytest.raises(ImageError, match="no images were given"):
        popjax.generate_ids(model, [one], max_new_tokens=2)
    with pytest.raises(ImageError, match="shape \\(0, 5, 3\\) is empty"):
        popjax.generate_ids(model, [one], max_new_tokens=2, images=[[np.zeros((0, 5, 3), np.uint8)]])
    bad = tmp_path / "not-an-image.png"
    bad.write_text("hello")
    with pytest.raises(ImageError, match="not-an-image.png"):
        popjax.generate_ids(model, [one], max_new_tokens=2, images=[[str(bad)]])


def test_an_image_for_a_text_only_model(tiny_model):
    with pytest.raises(ImageError, match="text-only"):
        popjax.generate_ids(tiny_model, [[1, 2, 3]], max_new_tokens=2, images=[[digit(0, (56, 56))]])


def test_stream_with_an_image_equals_generate(pair):
    """The streamed tokens of an image prompt are the compiled loop's."""
    _, model = pair
    ids, images = expanded([[5, 6], digit(3, (56, 84)), [7, 8]])
    want, _ = popjax.generate_ids(model, [ids], max_new_tokens=6, images=[images], ignore_eos=True)
    got = list(popjax.stream_ids(model, ids, max_new_tokens=6, images=images, ignore_eos=True))
    assert got == want[0]


def test_int8_vlm_equals_its_dequantized_twin(tmp_path):
    """An int8 VLM (the language model int8, the tower float) gives the logits and POP's tokens of
    the float model on its dequantized weights, with images."""
    hf = hf_model("qwen2_vl")
    hf.save_pretrained(tmp_path)
    model = popjax.load(str(tmp_path), cache=False, weights="int8", activations="float")
    float_cfg = dataclasses.replace(model.config, weights="float")
    twin = build_model(float_cfg, checkpoint_tree(model), None, "dequantized", "float32")  # checkpoint_tree: the q · s values
    rows, images = zip(*CASES["mixed_padded_batch"]())
    np.testing.assert_allclose(ours_logits(model, list(rows), list(images)), ours_logits(twin, list(rows), list(images)), atol=1e-4)
    a, _ = popjax.generate_ids(model, list(rows), 6, images=list(images), method=popjax.POP(0.2), ignore_eos=True)
    b, _ = popjax.generate_ids(twin, list(rows), 6, images=list(images), method=popjax.POP(0.2), ignore_eos=True)
    assert a == b


def test_the_checkpoints_image_preprocessing_is_kept(tmp_path):
    """A checkpoint's preprocessor_config.json (here a small max_pixels) travels into the cached
    converted store and sizes the images as transformers' processor does with it."""
    hf = hf_model("qwen2_5_vl")
    hf.save_pretrained(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text('{"min_pixels": 3136, "max_pixels": 12544, "patch_size": 14}')
    model = popjax.load(str(tmp_path))  # through the cache: converted once, then read back
    assert (model.image_processor.min_pixels, model.image_processor.max_pixels) == (3136, 12544)
    big = digit(2, (280, 224))  # above max_pixels: resized down, as the processor does
    processor = transformers.Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12544)
    want = processor(images=[big], return_tensors="np")["image_grid_thw"]
    np.testing.assert_array_equal(preprocess([big], model.image_processor).grid_thw, want)
    out, _ = popjax.generate_ids(model, [[BOS, 5, VISION_START, IMAGE, VISION_END, 6]], max_new_tokens=2, images=[[big]],
                                 ignore_eos=True)  # one placeholder, expanded to the resized grid's tokens
    assert len(out[0]) == 2
