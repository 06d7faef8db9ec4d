"""Qwen2-VL's multimodal rotary positions (models/mrope.py) against transformers: the 3-axis
positions and deltas of ``get_rope_index`` (Qwen2-VL and Qwen2.5-VL, images, padding), the
rotation of ``Qwen2VLRotaryEmbedding`` + ``apply_rotary_pos_emb``, the positions ``generate``
feeds while decoding, and the errors for image tokens that do not match their grids."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from popjax.models.config import ConfigError, ModelConfig
from popjax.models.mrope import PositionError, decode_positions, mrope_cos_sin, rope_index
from popjax.models.rope import apply_rope, inverse_frequencies, rope_cos_sin

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PAD, VISION_START, VISION_END, IMAGE, VIDEO = 0, 58, 59, 60, 61
MERGE = 2
HEAD_DIM, SECTION = 16, (2, 3, 3)  # mrope_section sums to head_dim / 2
TEXT = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=PAD,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": list(SECTION)},
)
TOKENS = dict(
    image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END
)


@functools.lru_cache(maxsize=None)
def hf_model(kind: str):
    """A tiny random Qwen2-VL or Qwen2.5-VL (text hidden 32, 2 layers, vision depth 1)."""
    if kind == "qwen2_vl":
        vision = dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, spatial_merge_size=MERGE, patch_size=2)
        cfg = transformers.Qwen2VLConfig(text_config=TEXT, vision_config=vision, **TOKENS)
        cls = transformers.Qwen2VLForConditionalGeneration
    else:
        vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                      spatial_merge_size=MERGE, patch_size=2, window_size=8, fullatt_block_indexes=[0])
        cfg = transformers.Qwen2_5_VLConfig(text_config=TEXT, vision_config=vision, **TOKENS)
        cls = transformers.Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(0)
    return cls(cfg).eval()


def prompt(rng: np.random.Generator, pieces) -> tuple[list[int], list[tuple[int, int, int]]]:
    """pieces: ints (that many text tokens) and (t, h, w) grids (an image as the processor
    writes it: vision_start, t·h·w/merge² image tokens, vision_end) -> token ids, grids."""
    ids, grids = [], []
    for piece in pieces:
        if isinstance(piece, int):
            ids += rng.integers(3, 50, piece).tolist()
        else:
            t, h, w = piece
            ids += [VISION_START] + [IMAGE] * (t * h * w // MERGE**2) + [VISION_END]
            grids.append(piece)
    return ids, grids


def left_padded(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    T = max(len(r) for r in rows)
    ids = np.full((len(rows), T), PAD, np.int64)
    mask = np.zeros((len(rows), T), bool)
    for b, r in enumerate(rows):
        ids[b, T - len(r):] = r
        mask[b, T - len(r):] = True
    return ids, mask


def batch(pieces_per_row, seed=0):
    """-> input_ids [B, T], mask [B, T] (left padding) or None, image_grid_thw [n, 3] or None."""
    rng = np.random.default_rng(seed)
    rows, grids = zip(*(prompt(rng, p) for p in pieces_per_row))
    ids, mask = left_padded(list(rows))
    all_grids = [g for gs in grids for g in gs]
    return ids, (None if mask.all() else mask), (np.array(all_grids, np.int64) if all_grids else None)


def hf_rope_index(kind, ids, mask, grids):
    """transformers 5.25: get_rope_index(input_ids, mm_token_type_ids, image_grid_thw=,
    video_grid_thw=, [second_per_grid_ts=,] attention_mask=) -> [3, B, T], deltas [B, 1]."""
    ids_t = torch.tensor(ids)
    pos, deltas = hf_model(kind).model.get_rope_index(
        ids_t,
        mm_token_type_ids=(ids_t == IMAGE).int(),
        image_grid_thw=None if grids is None else torch.tensor(grids),
        attention_mask=None if mask is None else torch.tensor(mask.astype(np.int64)),
    )
    return pos.numpy(), deltas.numpy()[:, 0]


CASES = {
    "text_only": [[9], [9]],
    "one_image": [[4, (1, 4, 6), 5]],
    "two_grids_one_row": [[3, (1, 4, 6), 2, (2, 6, 4), 4]],
    "image_at_start": [[(1, 8, 4), 3]],
    "left_padded_image_and_text": [[2, (1, 6, 4), 3], [5]],
    "images_across_rows": [[2, (1, 4, 4), 3], [4], [1, (1, 2, 6), 2, (1, 4, 2), 1]],
}


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_rope_index_matches_hf(kind, case):
    ids, mask, grids = batch(CASES[case])
    want_pos, want_deltas = hf_rope_index(kind, ids, mask, grids)
    pos, deltas = rope_index(ids, mask, grids, image_token_id=IMAGE, vision_start_token_id=VISION_START,
                             spatial_merge_size=MERGE)
    assert pos.dtype == np.int64 and pos.shape == (3, *ids.shape) and deltas.shape == (ids.shape[0],)
    np.testing.assert_array_equal(pos, want_pos)
    np.testing.assert_array_equal(deltas, want_deltas)
    if mask is not None:
        assert (pos[:, ~mask] == 0).all()  # 5.25 leaves padding at 0 (older releases wrote 1)


def test_positions_of_one_image_by_hand():
    ids, _, grids = batch([[2, (1, 4, 6), 2]])  # text 2, start, 6 image tokens (2×3), end, text 2
    pos, deltas = rope_index(ids, None, grids, image_token_id=IMAGE)
    np.testing.assert_array_equal(pos[:, 0, 3:9], [[3] * 6, [3, 3, 3, 4, 4, 4], [3, 4, 5, 3, 4, 5]])
    # the image spans max(2, 3) = 3 positions: vision_end resumes at 3 + 3 = 6
    np.testing.assert_array_equal(pos[:, 0, 9:], [[6, 7, 8]] * 3)
    assert deltas.tolist() == [9 - 12]


def tiny_config() -> ModelConfig:
    return ModelConfig(
        model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=HEAD_DIM, rms_norm_eps=1e-6, rope_theta=1e4,
        max_position_embeddings=512, tie_word_embeddings=False,
    )


def test_rotation_matches_hf():
    from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb

    rotary = hf_model("qwen2_vl").model.language_model.rotary_emb
    inv = inverse_frequencies(tiny_config())
    np.testing.assert_array_equal(inv, rotary.inv_freq.numpy())
    rng = np.random.default_rng(1)
    B, T, n = 2, 7, 3
    positions = rng.integers(0, 400, (3, B, T))  # three unrelated axes: every section is seen
    q, k = (rng.normal(size=(B, T, n, HEAD_DIM)).astype(np.float32) for _ in range(2))
    cos_t, sin_t = rotary(torch.tensor(q), torch.tensor(positions))
    q_hf, k_hf = apply_rotary_pos_emb(torch.tensor(q), torch.tensor(k), cos_t, sin_t, unsqueeze_dim=2)

    cos, sin = mrope_cos_sin(inv, jnp.asarray(positions), SECTION)
    assert cos.shape == sin.shape == (B, T, HEAD_DIM) and cos.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(cos), cos_t.numpy(), atol=1e-6)
    np.testing.assert_allclose(np.asarray(sin), sin_t.numpy(), atol=1e-6)
    np.testing.assert_allclose(np.asarray(apply_rope(jnp.asarray(q), cos, sin)), q_hf.numpy(), atol=1e-5)
    np.testing.assert_allclose(np.asarray(apply_rope(jnp.asarray(k), cos, sin)), k_hf.numpy(), atol=1e-5)


def test_equal_axes_are_plain_rope():
    cfg = tiny_config()
    positions = jnp.asarray(np.random.default_rng(2).integers(0, 5000, (3, 11)), jnp.int32)
    # jitted, as the engine would: the section layout is static, the positions traced
    cos, sin = jax.jit(mrope_cos_sin, static_argnums=2)(
        inverse_frequencies(cfg), jnp.broadcast_to(positions, (3, *positions.shape)), SECTION
    )
    want_cos, want_sin = rope_cos_sin(cfg, positions)
    np.testing.assert_array_equal(np.asarray(cos), np.asarray(want_cos))
    np.testing.assert_array_equal(np.asarray(sin), np.asarray(want_sin))


def test_decode_positions_match_hf_generate():
    """HF's generate continues every axis from the prompt's last position + 1: the engine's text
    position (valid tokens so far) + delta, on all three axes."""
    model = hf_model("qwen2_vl")
    ids, mask, grids = batch(CASES["left_padded_image_and_text"], seed=3)
    seen = []
    hook = model.model.language_model.rotary_emb.register_forward_pre_hook(
        lambda module, args: seen.append(args[1].clone())
    )
    steps = 3
    try:
        with torch.no_grad():
            model.generate(
                input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask.astype(np.int64)),
                mm_token_type_ids=torch.tensor((ids == IMAGE).astype(np.int32)), image_grid_thw=torch.tensor(grids),
                max_new_tokens=steps + 1, min_new_tokens=steps + 1, do_sample=False, pad_token_id=PAD,
            )
    finally:
        hook.remove()
    positions, deltas = rope_index(ids, mask, grids, image_token_id=IMAGE)
    assert len(seen) == steps + 1
    np.testing.assert_array_equal(seen[0].numpy(), positions)  # the prefill
    lengths = mask.sum(axis=1)
    for k in range(steps):
        fed = seen[1 + k].numpy()  # [3, B, 1]: the k-th generated token, fed back
        want = np.asarray(decode_positions(jnp.asarray(lengths + k, jnp.int32), deltas))
        np.testing.assert_array_equal(fed, np.broadcast_to(want[None, :, None], fed.shape))
    # and the 2-D form: [B, T] text positions take the same per-row shift
    two_d = decode_positions(jnp.asarray(lengths[:, None] + np.arange(2)), deltas)
    np.testing.assert_array_equal(np.asarray(two_d), lengths[:, None] + np.arange(2) + deltas[:, None])


def test_image_tokens_without_grid():
    ids, _, _ = batch([[2, (1, 4, 4), 2]])
    with pytest.raises(PositionError, match=r"1 image-token runs .* but image_grid_thw has 0 grids"):
        rope_index(ids, None, None, image_token_id=IMAGE)


def test_grid_without_image_tokens():
    ids, _, _ = batch([[6]])
    with pytest.raises(PositionError, match=r"0 image-token runs .* but image_grid_thw has 1 grids"):
        rope_index(ids, None, np.array([[1, 4, 4]]), image_token_id=IMAGE)


def test_wrong_run_length():
    ids, _, _ = batch([[2, (1, 4, 4), 2]])  # 4 image tokens
    with pytest.raises(PositionError, match=r"image 0 has grid \(t=1, h=4, w=6\).* = 6 tokens, but .* has 4"):
        rope_index(ids, None, np.array([[1, 4, 6]]), image_token_id=IMAGE)


def test_other_errors():
    ids, _, grids = batch([[2, (1, 4, 4), 2]])
    no_start = ids.copy()
    no_start[0, 2] = 5
    with pytest.raises(PositionError, match="vision_start_token_id=58"):
        rope_index(no_start, None, grids, image_token_id=IMAGE, vision_start_token_id=VISION_START)
    with pytest.raises(PositionError, match="multiples of spatial_merge_size=2"):
        rope_index(ids, None, np.array([[1, 2, 3]]), image_token_id=IMAGE)
    with pytest.raises(PositionError, match="attention_mask has shape"):
        rope_index(ids, np.ones((1, 3), bool), grids, image_token_id=IMAGE)
    with pytest.raises(ConfigError, match="summing to head_dim/2 = 8"):
        mrope_cos_sin(np.ones(8, np.float32), jnp.zeros((3, 1, 2), jnp.int32), (2, 3, 2))
    with pytest.raises(PositionError, match=r"\[3, B, T\]"):
        mrope_cos_sin(np.ones(8, np.float32), jnp.zeros((1, 2), jnp.int32), SECTION)
