"""The tiny random Qwen3-VL and Qwen3-VL-MoE transformers models the Qwen3-VL tests compare popjax
against: their HF configs (interleaved M-RoPE over head_dim 16, a 3-block tower with a 4×4 learned
position table and DeepStack at blocks 0 and 2; the MoE variant's 4 experts of width 24 and a dense
layer), the models with O(1) random weights, Qwen3-VL's image preprocessing, real images
(scikit-learn's digits) and prompts with their placeholders expanded as the processor writes them.
Importing it skips the importing test module without torch, transformers' qwen3_vl or scikit-learn."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen3_vl")
pytest.importorskip("transformers.models.qwen3_vl_moe")
datasets = pytest.importorskip("sklearn.datasets")

from popjax.images import ImageProcessorConfig, preprocess  # noqa: E402 (after the skips)

PAD, BOS, EOS, VISION_START, VISION_END, IMAGE, VIDEO = 0, 1, 2, 90, 91, 92, 93
# head_dim 16: 8 rotary frequencies, interleaved over (t, h, w) by mrope_section [2, 3, 3]
TEXT = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, max_position_embeddings=1024, bos_token_id=BOS, eos_token_id=EOS,
    pad_token_id=PAD,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True},
)
# DeepStack at blocks 0 and 2 of 3 (non-contiguous); a 4×4 position table, resampled to every grid
VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=32, patch_size=16,
              num_position_embeddings=16, deepstack_visual_indexes=[0, 2])
TOKENS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
# Qwen3-VL's preprocessing (patch 16, mean and std 0.5), with a small minimum so 64-pixel images stay small
PROCESSOR = dict(patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=32 * 32, max_pixels=512 * 512,
                 image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
IMAGES = ImageProcessorConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in PROCESSOR.items()})


def digit(index: int, size: tuple[int, int]) -> Image.Image:
    """scikit-learn's handwritten digit ``index`` as an RGB image of ``size`` (w, h)."""
    pixels = datasets.load_digits().images[index]
    return Image.fromarray((pixels * (255 / 16)).astype(np.uint8), "L").resize(size, Image.BILINEAR).convert("RGB")


def randomise(model, seed: int = 0) -> None:
    """Weights of order 1/√fan_in, norms near 1 with biases (HF's 0.02 init leaves logits flat)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise if name.endswith("weight") else 0.1 * noise)
            elif p.ndim >= 2:  # fused experts [E, out, in]: each expert's fan-in is the last axis
                fan_in = p.shape[-1] if "experts" in name else int(np.prod(p.shape[1:]))
                p.copy_(noise / fan_in**0.5)
            else:
                p.copy_(0.1 * noise)


# Qwen3-VL-MoE's language model: 4 experts of width I = 24, top 2, layer 1 dense (mlp_only_layers)
# of width 64; H = 32, I = 24 and 2I = 48 all differ, so the fused tensors' layouts tell apart
MOE_TEXT = dict(TEXT, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                mlp_only_layers=[1], tie_word_embeddings=False)


@functools.lru_cache(maxsize=None)
def hf_model(moe: bool = False):
    """The tiny Qwen3-VL (``moe``: Qwen3-VL-MoE) with random O(1) weights, in eval mode."""
    if moe:
        cfg = transformers.Qwen3VLMoeConfig(text_config=MOE_TEXT, vision_config=VISION, tie_word_embeddings=False, **TOKENS)
        cls = transformers.Qwen3VLMoeForConditionalGeneration
    else:
        cfg = transformers.Qwen3VLConfig(text_config=TEXT, vision_config=VISION, tie_word_embeddings=False, **TOKENS)
        cls = transformers.Qwen3VLForConditionalGeneration
    torch.manual_seed(0)
    model = cls(cfg).eval()
    randomise(model)
    return model


def expanded(pieces) -> tuple[list[int], list[Image.Image]]:
    """Text-id lists and images -> ids with each image's placeholders expanded as the processor
    writes them (vision_start, one image token per merged patch, vision_end), and the images."""
    ids, images = [BOS], []
    for piece in pieces:
        if isinstance(piece, Image.Image):
            grid = preprocess([piece], IMAGES).grid_thw[0]
            ids += [VISION_START] + [IMAGE] * int(np.prod(grid) // 4) + [VISION_END]
            images.append(piece)
        else:
            ids += list(piece)
    return ids, images


def padded(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    T = max(map(len, rows))
    ids, mask = np.full((len(rows), T), PAD, np.int64), np.zeros((len(rows), T), np.int64)
    for b, r in enumerate(rows):
        ids[b, T - len(r):], mask[b, T - len(r):] = r, 1
    return ids, mask


def image_kwargs(ids: np.ndarray, images: list[Image.Image]) -> dict:
    if not images:
        return {}
    pixels = preprocess(images, IMAGES)
    return dict(pixel_values=torch.from_numpy(pixels.pixel_values), image_grid_thw=torch.from_numpy(pixels.grid_thw),
                mm_token_type_ids=torch.from_numpy((ids == IMAGE).astype(np.int64)))




def saved(model, directory: Path) -> Path:
    """``model`` saved as a HF checkpoint directory with Qwen3-VL's preprocessor_config.json."""
    model.save_pretrained(directory)
    (directory / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return directory


# The parity cases both variants run: a left-padded text batch, one image, two images of
# different sizes, and a padded batch mixing image rows with a text row.
CASES = {
    "padded_text_batch": lambda: [expanded([[5, 6, 7, 8, 9, 10, 11]]), expanded([[12, 13, 14]])],
    "one_image": lambda: [expanded([[5, 6], digit(0, (64, 64)), [7, 8, 9]])],
    "two_images_of_different_sizes": lambda: [expanded([[5], digit(1, (64, 64)), [6, 7], digit(2, (96, 128)), [8, 9]])],
    "mixed_padded_batch": lambda: [expanded([[5, 6], digit(3, (128, 64)), [7]]), expanded([[10, 11, 12]]),
                                   expanded([digit(4, (64, 96)), [13, 14, 15, 16]])],
}


def assert_logits_match(hf, model, case: str) -> None:
    """popjax's fp32 logits [B, T, V] of ``CASES[case]`` equal transformers' at every real token (1e-4)."""
    import torch

    import popjax

    rows, images = (list(x) for x in zip(*CASES[case]()))
    ids, mask = padded(rows)
    with torch.no_grad():
        want = hf(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                  **image_kwargs(ids, [im for row in images for im in row])).logits.numpy()
    got = np.asarray(popjax.forward(model, ids, mask, images=images if any(images) else None))
    valid = mask.astype(bool)
    np.testing.assert_allclose(got[valid], want[valid], atol=1e-4, rtol=1e-4)
    assert np.abs(want[valid]).max() > 1.0  # the check can fail: logits far from flat


def assert_greedy_matches(hf, model, new_tokens: int = 16) -> None:
    """``new_tokens`` greedy tokens after an image prompt equal transformers' (decoding continues
    M-RoPE's positions as HF does)."""
    import torch

    import popjax

    row, images = expanded([[5, 6], digit(7, (96, 64)), [7, 8]])
    ours, _ = popjax.generate_ids(model, [row], max_new_tokens=new_tokens, images=[images], ignore_eos=True)
    ids = np.asarray([row])
    with torch.no_grad():
        out = hf.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.ones_like(torch.from_numpy(ids)),
                          max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=PAD,
                          **image_kwargs(ids, images))
    assert ours[0] == out[0, len(row):].tolist()
    assert len(set(ours[0])) > 1  # the check can fail: not one token repeated
