"""Pruning methods on a vision-language model: POP's partition of an image+text prompt for each
choice of scoring tokens (all, text, image, balanced) against a NumPy reference built from
transformers' own FFN inputs, and the fallbacks of a choice whose tokens are absent (every
registered method runs on a VLM prompt with an image in tests/methods/test_method_matrix.py)."""

from __future__ import annotations

import numpy as np
import pytest

import popjax
from popjax.methods import MethodError
from popjax.methods.prompt_tokens import PROMPT_TOKENS
from tests.reference.vlm import IMAGE, digit, expanded, hf_model, left_padded

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = hf_model("qwen2_vl")
    directory = tmp_path_factory.mktemp("qwen2_vl_methods")
    hf.save_pretrained(directory)
    return hf, popjax.load(str(directory), cache=False)


def scoring_weights(valid: np.ndarray, image: np.ndarray, choice: str) -> np.ndarray:
    """The prompt tokens' weights in POP's importance for ``choice`` (docs/methods.md §13), over
    the whole batch (aggregate "shared")."""
    text, img = valid & ~image, valid & image
    if choice == "all" or not img.any():
        return valid.astype(np.float64)
    if choice == "text":
        return (text if text.any() else valid).astype(np.float64)
    if choice == "image":
        return img.astype(np.float64)
    share = 0.5 if text.any() else 1.0
    return share * text / max(text.sum(), 1) + share * img / max(img.sum(), 1)


def reference_partitions(hf, rows, images, choice: str, n_keep: int, n_r: int, n_c: int):
    """POP's prefill in NumPy on transformers' model: in every layer H = silu(x W_g) ⊙ (x W_u) of
    the layer's FFN input x, I_j = √(Σ_t weight_t H_tj²) · ‖W_d[:, j]‖₂, the ranking cut into R
    (top n_r) and C (next n_c), and the layer's output through its top n_keep channels only (the
    prompt's own pruned pass, so the next layer sees what POP's does) -> [(R, C)] per layer."""
    ids, mask = left_padded(rows)
    weight = scoring_weights(mask.numpy().astype(bool), ids.numpy() == IMAGE, choice)
    parts = []

    def pruned_mlp(mlp, args, _out):
        x = args[0].detach().numpy().astype(np.float64)
        g = x @ mlp.gate_proj.weight.detach().numpy().T.astype(np.float64)
        h = (g / (1 + np.exp(-g))) * (x @ mlp.up_proj.weight.detach().numpy().T.astype(np.float64))
        down = mlp.down_proj.weight.detach().numpy().astype(np.float64)
        importance = np.sqrt((weight[..., None] * h**2).sum(axis=(0, 1))) * np.linalg.norm(down, axis=0)
        order = np.argsort(-importance, kind="stable")
        parts.append((set(order[:n_r].tolist()), set(order[n_r: n_r + n_c].tolist())))
        keep = np.zeros(h.shape[-1])
        keep[order[:n_keep]] = 1.0
        return torch.from_numpy(((h * keep) @ down.T).astype(np.float32))

    pixels = popjax.images.preprocess([im for row in images for im in row])
    hooks = [layer.mlp.register_forward_hook(pruned_mlp) for layer in hf.model.language_model.layers]
    try:
        with torch.no_grad():
            hf(input_ids=ids, attention_mask=mask, pixel_values=torch.from_numpy(pixels.pixel_values),
               image_grid_thw=torch.from_numpy(pixels.grid_thw), mm_token_type_ids=(ids == IMAGE).long())
    finally:
        for h in hooks:
            h.remove()
    return parts


@pytest.mark.parametrize("choice", PROMPT_TOKENS)
def test_pop_partition_matches_reference(pair, choice):
    """A padded batch of an image+text row and a text-only row (one shared partition)."""
    hf, model = pair
    rows, images = zip(expanded([[5, 6], digit(0, (84, 84)), [7, 8, 9, 10]]), expanded([[11, 12, 13]]))
    method = popjax.POP(0.2, gamma=0.3, prompt_tokens=choice, aggregate="shared")
    plan = method.bind(model.config)
    trace = popjax.generate_ids(model, list(rows), max_new_tokens=2, method=method, images=list(images), return_trace=True)[1]
    want = reference_partitions(hf, list(rows), list(images), choice, plan.n_keep, plan.n_retained, plan.n_candidates)
    for layer, (want_r, want_c) in enumerate(want):
        assert set(np.asarray(trace["partition"]["retained_idx"][layer]).tolist()) == want_r
        assert set(np.asarray(trace["partition"]["candidate_idx"][layer]).tolist()) == want_c


@pytest.mark.slow  # two prompts through every choice's program (~4 s)
def test_choices_differ_and_fall_back(pair):
    """With an image the choices pick different partitions; on a text-only prompt every choice
    is POP's own ("all")."""
    _, model = pair
    with_image = expanded([[5, 6], digit(1, (84, 112)), [7, 8, 9, 10, 11, 12]])
    text_only = expanded([[5, 6, 7, 8, 9, 10, 11, 12, 13]])

    def retained(prompt, choice):
        trace = popjax.generate_ids(model, [prompt[0]], max_new_tokens=2, images=[prompt[1]],
                                    method=popjax.POP(0.2, gamma=0.3, prompt_tokens=choice, aggregate="shared"), return_trace=True)[1]
        return [frozenset(np.asarray(r).tolist()) for r in trace["partition"]["retained_idx"]]

    parts = {c: retained(with_image, c) for c in PROMPT_TOKENS}
    assert parts["text"] != parts["image"]
    assert all(retained(text_only, c) == retained(text_only, "all") for c in ("text", "image", "balanced"))


def test_prompt_tokens_errors():
    with pytest.raises(MethodError, match="prompt_tokens='video' is not one of"):
        popjax.POP(0.2, prompt_tokens="video")
    with pytest.raises(MethodError, match="applies to partition='global' only"):
        popjax.POP(0.2, prompt_tokens="text", partition="per_shard")
