"""Qwen3-VL-MoE against transformers 5.25 on a tiny random model (4 experts of width 24, top 2,
renormalised; layer 1 dense by ``mlp_only_layers``; DeepStack at vision blocks 0 and 2): logits of
a left-padded text batch, one image, two images of different sizes and a mixed padded batch, for
the fused expert tensors in transformers' layout ([E, 2I, H], [E, H, I], what ``save_pretrained``
writes) and in the hub checkpoints' transposed one ([E, H, 2I], [E, I, H]); 16 greedy tokens after
an image; the config's routing; a fused tensor of neither layout, or of both, is one clear error."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import popjax
from popjax.convert.fused_experts import split_fused_experts
from popjax.convert.readers import CheckpointError
from popjax.models.config import ModelConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen3_vl_moe")
pytest.importorskip("sklearn.datasets")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

from tests.reference.qwen3_vl import (  # noqa: E402 (after the skips: it imports torch and transformers)
    CASES, MOE_TEXT, TOKENS, VISION, assert_greedy_matches, assert_logits_match, hf_model, saved,
)



def transposed_experts(directory):
    """The saved checkpoint rewritten with its fused expert tensors in the hub's layout."""
    path = directory / "model.safetensors"
    tensors = safetensors_numpy.load_file(str(path))
    fused = [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert fused  # transformers saved fused tensors: the test reads what it means to
    for k in fused:
        tensors[k] = np.ascontiguousarray(np.swapaxes(tensors[k], 1, 2))
    safetensors_numpy.save_file(tensors, str(path), metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module", params=["module_layout", "hub_layout"])
def pair(request, tmp_path_factory):
    hf = hf_model(moe=True)
    directory = saved(hf, tmp_path_factory.mktemp(f"qwen3_vl_moe_{request.param}"))
    if request.param == "hub_layout":
        transposed_experts(directory)
    return hf, popjax.load(str(directory), cache=False)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(pair, case):
    assert_logits_match(*pair, case)


def test_greedy_tokens_match_transformers(pair):
    assert_greedy_matches(*pair)


def test_config_routing():
    raw = transformers.Qwen3VLMoeConfig(text_config=MOE_TEXT, vision_config=VISION, **TOKENS).to_dict()
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.moe.norm_topk_prob and cfg.moe.sparse_layers == (0, 2) and cfg.moe.expert_size == 24
    assert cfg.mrope_interleaved and cfg.deepstack_layers == 2 and cfg.vision.is_qwen3
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_fused_tensor_of_neither_layout_is_one_error(tmp_path):
    directory = saved(hf_model(moe=True), tmp_path / "bad")
    path = directory / "model.safetensors"
    tensors = safetensors_numpy.load_file(str(path))
    key = next(k for k in tensors if k.endswith("experts.down_proj"))
    tensors[key] = tensors[key][:, :, :20]
    safetensors_numpy.save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"fused expert tensor .*down_proj.* has shape \(4, 32, 20\); expected \(4, 32, 24\)"):
        popjax.load(str(directory), cache=False)


def test_fused_tensor_both_layouts_fit_is_refused_not_guessed():
    """With H = 2I a square gate_up tensor reads the same in both layouts: refused in one line."""
    raw = transformers.Qwen3VLMoeConfig(text_config=MOE_TEXT, vision_config=VISION, **TOKENS).to_dict()
    cfg = dataclasses.replace(ModelConfig.from_hf_dict(raw), hidden_size=48)  # H = 2I = 48
    name = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    with pytest.raises(CheckpointError, match=r"which both layouts give for this config"):
        list(split_fused_experts(cfg, iter([(name, np.zeros((4, 48, 48), np.float32))])))
    down = "model.language_model.layers.0.mlp.experts.down_proj"
    pieces = dict(split_fused_experts(cfg, iter([(down, np.arange(4 * 24 * 48, dtype=np.float32).reshape(4, 24, 48))])))
    assert pieces[down.replace("down_proj", "3.down_proj.weight")].shape == (48, 24)  # the hub's [E, I, H], transposed
