"""Qwen3-VL end to end against transformers 5.25 on a tiny random model saved as a HF checkpoint
and converted by popjax: its config (interleaved M-RoPE, a checked ``mrope_section``), the vision
tower with its learned positions and DeepStack mergers at non-contiguous depths, logits of a
left-padded text batch, one image, two images of different sizes and a padded batch mixing image
and text rows (DeepStack features added after decoder layers 0 and 1 at the image tokens), and 16
greedy tokens after an image prompt."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import popjax
from popjax.images import preprocess
from popjax.loading import build_model
from popjax.models.config import ConfigError, ModelConfig
from popjax.models.mrope import frequency_axes
from popjax.models.vision import image_features
from popjax.pruned import checkpoint_tree

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen3_vl")
pytest.importorskip("sklearn.datasets")

from tests.reference.qwen3_vl import (  # noqa: E402 (after the skips: it imports torch and transformers)
    CASES, IMAGES, TEXT, TOKENS, VISION, assert_greedy_matches, assert_logits_match, digit, expanded, hf_model, padded, saved,
)
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding  # noqa: E402


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(HF model, popjax model converted from its saved checkpoint)."""
    hf = hf_model()
    return hf, popjax.load(str(saved(hf, tmp_path_factory.mktemp("qwen3_vl"))), cache=False)




@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(pair, case):
    assert_logits_match(*pair, case)


def test_vision_tower_and_deepstack_match_get_image_features(pair):
    """The main features and both DeepStack sets of two images whose grids (4×6, 8×4) differ
    from the 4×4 position table (so the bilinear resampling is exercised)."""
    hf, model = pair
    pixels = preprocess([digit(5, (64, 96)), digit(6, (128, 64))], IMAGES)
    with torch.no_grad():
        out = hf.model.get_image_features(torch.from_numpy(pixels.pixel_values), torch.from_numpy(pixels.grid_thw))
    got, deep = image_features(model.vision, model.config.vision, pixels.pixel_values, pixels.grid_thw, deepstack=True)
    np.testing.assert_allclose(got, torch.cat(out.pooler_output).numpy(), atol=1e-4)
    assert deep.shape[0] == 2
    for j, want in enumerate(out.deepstack_features):
        np.testing.assert_allclose(deep[j], torch.cat(want).numpy(), atol=1e-4)
    assert not np.allclose(deep[0], deep[1], atol=1e-2)


def test_deepstack_reaches_the_logits(pair):
    """The DeepStack sets change the image prompt's logits (without them the test above could
    pass on a model that ignored them): zeroing the mergers' last layers moves the logits."""
    _, model = pair
    rows, images = (list(x) for x in zip(expanded([[5, 6], digit(0, (64, 64)), [7, 8, 9]])))
    ids, mask = padded(rows)
    base = np.asarray(popjax.forward(model, ids, mask, images=images))
    deep = model.vision["deepstack"]
    try:
        model.vision["deepstack"] = {**deep, "mlp2_w": deep["mlp2_w"] * 0, "mlp2_b": deep["mlp2_b"] * 0}
        without = np.asarray(popjax.forward(model, ids, mask, images=images))
    finally:
        model.vision["deepstack"] = deep
    assert np.abs(base - without).max() > 1e-2


def test_greedy_tokens_match_transformers(pair):
    """16 greedy tokens after an image prompt: decoding continues M-RoPE's positions as HF does."""
    assert_greedy_matches(*pair)


def test_interleaved_axes_match_transformers():
    """`frequency_axes` (interleaved) is the layout HF's recomposition writes: axis k's
    positions land where HF puts them, for the tiny config and the real models' [24, 20, 20]."""
    for head_dim, section in ((16, [2, 3, 3]), (128, [24, 20, 20])):
        text = transformers.Qwen3VLTextConfig(**{**TEXT, "head_dim": head_dim, "rope_parameters": {
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": section, "mrope_interleaved": True}})
        rotary = Qwen3VLTextRotaryEmbedding(text)
        # axis a at position 10^a, the others 0: the angle's nonzero pattern is that axis's frequencies
        half = head_dim // 2
        for axis in range(3):
            positions = torch.zeros((3, 1, 1), dtype=torch.long)
            positions[axis] = 1
            _, sin = rotary(torch.zeros(1), positions)
            uses = (sin[0, 0, :half].abs() > 0).numpy()
            assert (uses == (frequency_axes(section, half, interleaved=True) == axis)).all(), (section, axis)


def _config(**text_changes) -> dict:
    cfg = transformers.Qwen3VLConfig(text_config={**TEXT, **text_changes}, vision_config=VISION, **TOKENS).to_dict()
    return cfg


def test_config_parsing():
    cfg = ModelConfig.from_hf_dict(_config())
    assert (cfg.model_type, cfg.qk_norm, cfg.qkv_bias, cfg.mrope_interleaved, cfg.deepstack_layers) == ("qwen3_vl", True, False, True, 2)
    assert cfg.vision.is_qwen3 and cfg.vision.patch_size == 16 and cfg.vision.deepstack_visual_indexes == (0, 2)
    assert cfg.vision.hidden_act == "gelu_pytorch_tanh" and cfg.head_dim == 16 and cfg.mrope_section == (2, 3, 3)
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg  # popjax's own config.json round-trips


@pytest.mark.parametrize("section, message", [([2, 3, 2], "must be positive and sum to head_dim/2 = 8"),
                                              ([4, 4, 0], "must be positive and sum to head_dim/2 = 8"),
                                              ([-1, 5, 4], "must be positive and sum to head_dim/2 = 8"),
                                              ([4, 4], "interleaved M-RoPE needs 3 values")])
def test_bad_mrope_section_is_one_clear_error(section, message):
    rope = {**TEXT["rope_parameters"], "mrope_section": section}
    with pytest.raises(ConfigError, match=rf"^mrope_section=.* is invalid: .*{message}"):
        ModelConfig.from_hf_dict(_config(rope_parameters=rope))


def test_bad_vision_fields():
    raw = _config()
    for field, value, message in (("deepstack_visual_indexes", [0, 3], "deepstack_visual_indexes"),
                                  ("deepstack_visual_indexes", [1, 1], "distinct"),
                                  ("num_position_embeddings", 15, "square")):
        with pytest.raises(ConfigError, match=message):
            ModelConfig.from_hf_dict({**raw, "vision_config": {**raw["vision_config"], field: value}})


def test_scanned_layers_equal_unrolled(pair, tmp_path):
    """The scanned model adds DeepStack inside its layer scan (a traced layer index): its logits
    with two images equal the unrolled model's."""
    hf, model = pair
    scanned = popjax.load(str(saved(hf, tmp_path / "scan")), cache=False, scan_layers=True)
    rows, images = (list(x) for x in zip(*CASES["mixed_padded_batch"]()))
    ids, mask = padded(rows)
    want = np.asarray(popjax.forward(model, ids, mask, images=images))
    got = np.asarray(popjax.forward(scanned, ids, mask, images=images))
    np.testing.assert_allclose(got[mask.astype(bool)], want[mask.astype(bool)], atol=1e-5, rtol=0)


def test_video_items_are_refused_in_one_line(pair):
    _, model = pair
    video = [{"role": "user", "content": [{"type": "video", "video": "clip.mp4"}, {"type": "text", "text": "what happens?"}]}]
    with pytest.raises(popjax.images.ImageError, match="video items are not supported"):
        popjax.generate(model, video, max_new_tokens=2)


def test_int8_through_the_converted_store_equals_its_dequantized_twin(tmp_path):
    """Loaded through the cached converted store with int8 weights (the language model int8, the
    tower and its DeepStack mergers float): the logits with images equal those of the float model
    rebuilt from its checkpoint tree (the q·s values, the tower's tensors written back to HF names)."""
    model = popjax.load(str(saved(hf_model(), tmp_path / "int8")), weights="int8", activations="float")
    assert model.image_processor == IMAGES  # the checkpoint's preprocessor_config.json travelled
    twin = build_model(dataclasses.replace(model.config, weights="float"), checkpoint_tree(model), None, "dequantized", "float32",
                       image_processor=model.image_processor)
    rows, images = (list(x) for x in zip(*CASES["two_images_of_different_sizes"]()))
    ids, mask = padded(rows)
    np.testing.assert_allclose(np.asarray(popjax.forward(model, ids, mask, images=images)),
                               np.asarray(popjax.forward(twin, ids, mask, images=images)), atol=1e-4)
