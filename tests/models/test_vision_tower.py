"""The Qwen2-VL / Qwen2.5-VL vision tower (models/vision.py) against transformers' towers:
merged features of one image, two images of different grids, odd merge grids, two-frame clips and
(Qwen2.5-VL) images that are not a whole number of windows agree within 1e-4; the host layout
equals HF's position ids, frame boundaries and window index; two image sizes in one bucket share
one compile; weight names are those ``save_pretrained`` writes; bad configs fail in one line."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from popjax.models.config import ConfigError
from popjax.models.vision import (
    VisionConfig,
    encode_images,
    image_features,
    pad_patches,
    patch_bucket,
    vision_layout,
    vision_params_from_hf,
    vision_tensor_names,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")
vision_utils = pytest.importorskip("transformers.vision_utils")

ATOL = 1e-4
TEXT = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=1, bos_token_id=0, eos_token_id=1,
    rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
)
VISION = {
    "qwen2_vl": dict(depth=3, embed_dim=48, hidden_size=40, num_heads=4, mlp_ratio=2),
    "qwen2_5_vl": dict(
        depth=3, hidden_size=64, out_hidden_size=40, intermediate_size=80, num_heads=2,
        window_size=56, fullatt_block_indexes=[1],
    ),
}
MODELS = {
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration"),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"),
}


def _randomize(module: "torch.nn.Module", seed: int) -> None:
    """O(1) activations everywhere (HF's 0.02-std init would make any output pass 1e-4)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name or "ln_q" in name:
                p.copy_(1.0 + 0.2 * noise if name.endswith("weight") else 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            else:
                fan_in = int(np.prod(p.shape[1:]))
                p.copy_(noise * (1.5 / fan_in**0.5))


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def tower(request, tmp_path_factory):
    """(cfg, params read from a save_pretrained checkpoint, HF tower) for one architecture."""
    arch = request.param
    config_cls, model_cls = (getattr(transformers, name) for name in MODELS[arch])
    torch.manual_seed(0)
    model = model_cls(config_cls(text_config=dict(TEXT), vision_config=dict(VISION[arch]))).eval()
    _randomize(model.model.visual, seed=1)
    directory = tmp_path_factory.mktemp(arch)
    model.save_pretrained(directory)
    tensors = safetensors_numpy.load_file(str(directory / "model.safetensors"))
    cfg = VisionConfig.from_hf(model.config.vision_config.to_dict(), arch)
    return cfg, vision_params_from_hf(tensors, cfg), model.model.visual


def _pixels(cfg: VisionConfig, grid: np.ndarray, seed: int) -> np.ndarray:
    n = int(np.prod(grid, axis=1).sum())
    return np.random.default_rng(seed).standard_normal((n, cfg.patch_dim)).astype(np.float32)


def _hf_features(visual, pixels: np.ndarray, grid: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = visual(torch.from_numpy(pixels), grid_thw=torch.from_numpy(grid))
    return out.pooler_output.numpy()


GRIDS = {
    "one-image": [[1, 4, 6]],
    "two-images": [[1, 4, 4], [1, 10, 6]],
    "odd-merge-grid": [[1, 6, 10]],
    "two-frames": [[2, 6, 4]],
    "windows-and-remainder": [[1, 10, 14], [1, 8, 8], [2, 6, 10]],
}


@pytest.mark.parametrize("grid", list(GRIDS.values()), ids=list(GRIDS))
def test_features_equal_transformers(tower, grid):
    cfg, params, visual = tower
    grid = np.asarray(grid, dtype=np.int64)
    pixels = _pixels(cfg, grid, seed=int(grid.sum()))
    expected = _hf_features(visual, pixels, grid)
    got = image_features(params, cfg, pixels, grid)
    assert got.shape == expected.shape == (int(np.prod(grid, axis=1).sum()) // 4, cfg.out_hidden_size)
    assert np.abs(expected).max() > 0.1  # the comparison is not between near-zero outputs
    np.testing.assert_allclose(got, expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("grid", list(GRIDS.values()), ids=list(GRIDS))
def test_layout_equals_transformers_helpers(tower, grid):
    cfg, _, visual = tower
    grid_t = torch.tensor(grid)
    layout = vision_layout(np.asarray(grid), cfg, bucket=patch_bucket(int(np.prod(grid, axis=1).sum())))
    n, a = layout.n_patches, layout.arrays
    positions = vision_utils.get_vision_position_ids(grid_t, cfg.spatial_merge_size).numpy()
    bounds = vision_utils.get_vision_cu_seqlens(grid_t).numpy()
    frame_of_patch = np.searchsorted(bounds, np.arange(n), side="right") - 1
    if cfg.windowed:
        window_index, cu_windows = vision_utils.get_vision_window_index(
            grid_t, cfg.spatial_merge_size, cfg.window_size, cfg.patch_size
        )
        merged = window_index.numpy()
        np.testing.assert_array_equal(a.order[:n], (merged[:, None] * 4 + np.arange(4)).reshape(-1))
        np.testing.assert_array_equal(a.unorder[: layout.n_tokens], np.argsort(merged))
        window_of_slot = np.searchsorted(cu_windows.numpy(), np.arange(n), side="right") - 1
        np.testing.assert_array_equal(a.window[:n], window_of_slot)
    else:
        np.testing.assert_array_equal(a.order[:n], np.arange(n))
    # HF applies cu_seqlens to the (window-permuted) sequence: frames stay contiguous and in order
    np.testing.assert_array_equal(a.segment[:n], frame_of_patch)
    np.testing.assert_array_equal(a.positions[:n], positions[a.order[:n]])
    assert (a.segment[n:] == -1).all() and (a.window[n:] == -1).all()
    assert layout.tokens_per_image == tuple(int(np.prod(g)) // 4 for g in grid)


def test_one_compile_per_bucket_and_finite_padding(tower):
    cfg, params, visual = tower
    traces = []

    def traced(params, cfg, pixels, arrays):  # a fresh function: jit caches are shared per function
        traces.append(pixels.shape)
        return encode_images(params, cfg, pixels, arrays)

    encode = jax.jit(traced, static_argnums=1)
    for grid in ([[1, 4, 6]], [[1, 6, 10]], [[1, 4, 4], [1, 2, 6]]):  # 24, 60 and 28 patches: bucket 64
        grid = np.asarray(grid, dtype=np.int64)
        pixels = _pixels(cfg, grid, seed=7)
        layout = vision_layout(grid, cfg, bucket=64)
        out = np.asarray(encode(params, cfg, pad_patches(pixels, cfg, 64), layout.arrays))
        assert out.shape == (16, cfg.out_hidden_size) and np.isfinite(out).all()
        np.testing.assert_allclose(out[: layout.n_tokens], _hf_features(visual, pixels, grid), rtol=0, atol=ATOL)
    assert encode._cache_size() == 1 and len(traces) == 1
    grid = np.asarray([[1, 10, 14]], dtype=np.int64)  # 140 patches: the next bucket compiles once more
    layout = vision_layout(grid, cfg, bucket=patch_bucket(140))
    encode(params, cfg, pad_patches(_pixels(cfg, grid, 8), cfg, layout.bucket), layout.arrays)
    assert layout.bucket == 256 and encode._cache_size() == 2 and len(traces) == 2


def test_tensor_names_are_what_save_pretrained_writes(tower):
    cfg, params, visual = tower
    in_memory = {f"model.visual.{k}": v.numpy() for k, v in visual.state_dict().items()}
    assert set(vision_tensor_names(cfg, prefix="model.visual.")) == set(in_memory)
    from_memory = vision_params_from_hf(in_memory, cfg)  # prefix found: "model.visual."
    for a, b in zip(jax.tree.leaves(from_memory), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert params["patch_embed"].shape == (cfg.embed_dim, cfg.patch_dim)
    assert params["blocks"]["qkv_w"].shape == (cfg.depth, 3 * cfg.embed_dim, cfg.embed_dim)


def test_checkpoint_errors_name_the_tensor(tower):
    cfg, _, visual = tower
    tensors = {f"visual.{k}": v.numpy() for k, v in visual.state_dict().items()}
    missing = dict(tensors)
    del missing["visual.blocks.2.attn.proj.bias"]
    with pytest.raises(ConfigError, match=r"'visual\.blocks\.2\.attn\.proj\.bias' is missing"):
        vision_params_from_hf(missing, cfg)
    wrong = dict(tensors, **{"visual.merger.mlp.2.weight": np.zeros((3, 3), np.float32)})
    with pytest.raises(ConfigError, match=r"'visual\.merger\.mlp\.2\.weight' has shape \(3, 3\)"):
        vision_params_from_hf(wrong, cfg)
    with pytest.raises(ConfigError, match="no vision tower tensors"):
        vision_params_from_hf({}, cfg)


def test_hub_configs():
    """vision_config blocks as the hub's Qwen2-VL-2B / Qwen2.5-VL-3B config.json spell them."""
    two = VisionConfig.from_hf(
        dict(depth=32, embed_dim=1280, mlp_ratio=4, num_heads=16, in_chans=3, hidden_size=1536, patch_size=14,
             spatial_merge_size=2, temporal_patch_size=2), "qwen2_vl")
    assert (two.embed_dim, two.mlp_dim, two.out_hidden_size, two.hidden_act, two.patch_dim) == (1280, 5120, 1536, "quick_gelu", 1176)
    five = VisionConfig.from_hf(
        dict(depth=32, hidden_act="silu", hidden_size=1280, intermediate_size=3420, num_heads=16, in_chans=3,
             out_hidden_size=2048, patch_size=14, spatial_merge_size=2, spatial_patch_size=14, window_size=112,
             fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2, temporal_patch_size=2), "qwen2_5_vl")
    assert (five.embed_dim, five.mlp_dim, five.out_hidden_size, five.window_tokens) == (1280, 3420, 2048, 4)
    assert [i for i in range(32) if five.full_attention(i)] == [7, 15, 23, 31]
    odd = VisionConfig.from_hf(dict(depth=2, embed_dim=48, hidden_size=40, num_heads=4, mlp_ratio=2.1), "qwen2_vl")
    for cfg in (two, five, odd):  # to_dict writes a vision_config block from_hf reads back
        assert VisionConfig.from_hf(cfg.to_dict(), cfg.architecture) == cfg
    assert hash(five) == hash(VisionConfig.from_hf(dict(depth=32, hidden_size=1280, intermediate_size=3420,
                                                         num_heads=16, out_hidden_size=2048), "qwen2_5_vl"))


@pytest.mark.parametrize(
    "arch, change, message",
    [
        ("qwen2_vl", {"depth": None}, "no 'depth' field"),
        ("qwen2_vl", {"embed_dim": None}, "no 'embed_dim' field"),
        ("qwen2_5_vl", {"out_hidden_size": None}, "no 'out_hidden_size' field"),
        ("qwen2_vl", {"num_heads": 5}, "head size must be a whole multiple of 4"),
        ("qwen2_vl", {"hidden_act": "tanh"}, "hidden_act='tanh' is not supported"),
        ("qwen2_vl", {"model_type": "qwen2_5_vl_vision"}, "is a qwen2_5_vl tower, not qwen2_vl"),
        ("qwen2_5_vl", {"window_size": 14}, "window_size=14 is invalid"),
        ("qwen2_5_vl", {"fullatt_block_indexes": [-1]}, "fullatt_block_indexes=\\[-1\\] is invalid"),
        ("qwen2_5_vl", {"depth": 0}, "depth=0 is invalid"),
        ("qwen2_vl", {"rope_parameters": {"rope_type": "default"}}, "rope_type='default' is invalid"),
    ],
)
def test_bad_configs_fail_in_one_line(arch, change, message):
    raw = {k: v for k, v in {**VISION[arch], **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=message) as info:
        VisionConfig.from_hf(raw, arch)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="vision architecture='llava'"):
        VisionConfig.from_hf(VISION["qwen2_vl"], "llava")


def test_bad_layouts():
    cfg = VisionConfig.from_hf(VISION["qwen2_5_vl"], "qwen2_5_vl")
    grid = np.asarray([[1, 4, 6]])
    with pytest.raises(ConfigError, match=r"bucket=16 .* ≥ their 24 patches"):
        vision_layout(grid, cfg, bucket=16)
    with pytest.raises(ConfigError, match=r"bucket=66 .* multiple of merge²=4"):
        vision_layout(grid, cfg, bucket=66)
    with pytest.raises(ConfigError, match="multiples of spatial_merge_size=2"):
        vision_layout(np.asarray([[1, 5, 6]]), cfg, bucket=64)
    with pytest.raises(ConfigError, match=r"grid_thw must be an integer array \[n_images, 3\]"):
        vision_layout(np.asarray([4, 6]), cfg, bucket=64)
    with pytest.raises(ConfigError, match="pixel_values of shape"):
        pad_patches(np.zeros((24, 10), np.float32), cfg, 64)
    assert [patch_bucket(n) for n in (1, 64, 65, 1000)] == [64, 64, 128, 1024]
    assert patch_bucket(70, unit=9) == 135
