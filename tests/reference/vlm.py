"""The tiny Qwen2-VL and Qwen2.5-VL transformers models the VLM tests compare popjax against, and
their inputs: the token ids and configs, real images (scikit-learn's handwritten digits, upscaled),
prompts with each image's placeholders expanded as the processor writes them, left-padded batches,
and the logits of both sides. Importing it skips the importing test module without torch,
transformers or scikit-learn."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from PIL import Image

import popjax
from popjax.images import preprocess

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("sklearn.datasets")

PAD, BOS, EOS, VISION_START, VISION_END, IMAGE, VIDEO = 0, 1, 2, 90, 91, 92, 93
TEXT = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, max_position_embeddings=1024, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
)
TOKENS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
ARCHS = ("qwen2_vl", "qwen2_5_vl")


def digit(index: int, size: tuple[int, int]) -> Image.Image:
    """scikit-learn's handwritten digit ``index`` (8×8, 0..16) as an RGB image of ``size`` (w, h)."""
    pixels = datasets.load_digits().images[index]
    gray = Image.fromarray((pixels * (255 / 16)).astype(np.uint8), "L").resize(size, Image.BILINEAR)
    return gray.convert("RGB")


def randomise(model) -> None:
    """Weights of order 1/√fan_in (HF's 0.02 init leaves logits nearly flat: a weak check)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                fan_in = int(np.prod(p.shape[1:]))
                p.copy_(torch.randn(p.shape, generator=gen) / fan_in**0.5)
            elif "norm" in name or "ln_q" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen) if name.endswith("weight") else 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


@functools.lru_cache(maxsize=None)
def hf_model(arch: str):
    """The tiny transformers model of ``arch`` ("qwen2_vl" or "qwen2_5_vl"), random weights of order
    1/√fan_in, built once per process."""
    if arch == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=32, num_heads=2)
        cfg = transformers.Qwen2VLConfig(text_config=TEXT, vision_config=vision, tie_word_embeddings=False, **TOKENS)
        cls = transformers.Qwen2VLForConditionalGeneration
    else:  # a window of 56 pixels: the 84×112 image spans several windows; block 1 attends fully
        vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=32, window_size=56,
                      fullatt_block_indexes=[1])
        cfg = transformers.Qwen2_5_VLConfig(text_config=TEXT, vision_config=vision, tie_word_embeddings=False, **TOKENS)
        cls = transformers.Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(0)
    model = cls(cfg).eval()
    randomise(model)
    return model


def expanded(pieces, merge: int = 2) -> tuple[list[int], list[Image.Image]]:
    """pieces: lists of text ids and images -> ids with each image's placeholders expanded as
    the processor writes them (vision_start, one image token per merged patch, vision_end)."""
    ids, images = [BOS], []
    for piece in pieces:
        if isinstance(piece, Image.Image):
            grid = preprocess([piece]).grid_thw[0]
            ids += [VISION_START] + [IMAGE] * int(np.prod(grid) // merge**2) + [VISION_END]
            images.append(piece)
        else:
            ids += list(piece)
    return ids, images


def left_padded(rows: list[list[int]]):
    """Token-id rows -> torch ids, mask [B, T] (left padding with PAD)."""
    T = max(map(len, rows))
    ids = torch.full((len(rows), T), PAD, dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, T - len(r):] = torch.tensor(r)
        mask[b, T - len(r):] = 1
    return ids, mask


def hf_logits(hf, rows: list[list[int]], images: list[list[Image.Image]]) -> np.ndarray:
    """Left-padded batch through transformers -> logits [B, T, V] (padding rows included)."""
    ids, mask = left_padded(rows)
    kwargs = {}
    flat = [im for row in images for im in row]
    if flat:
        pixels = preprocess(flat)
        kwargs = dict(pixel_values=torch.from_numpy(pixels.pixel_values), image_grid_thw=torch.from_numpy(pixels.grid_thw),
                      mm_token_type_ids=(ids == IMAGE).long())
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=mask, **kwargs).logits.numpy(), mask.numpy()


def ours_logits(model, rows, images):
    """popjax's logits [B, T, V] of token-id rows, left-padded with PAD, with each row's images."""
    T = max(map(len, rows))
    ids = np.full((len(rows), T), PAD, np.int64)
    mask = np.zeros((len(rows), T), np.int64)
    for b, r in enumerate(rows):
        ids[b, T - len(r):] = r
        mask[b, T - len(r):] = 1
    return np.asarray(popjax.forward(model, ids, mask, images=images if any(images) else None))
