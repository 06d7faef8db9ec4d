"""The digits VLM trained here (popjax.eval.digits_vlm) and its accuracy measure: the word-level
tokenizer writes Qwen2-VL's chat format, a short training lowers the loss and is cached like a
converted model (the cached model's logits equal the trained one's: the tower's weights survive
the converted store), the answers it is scored on follow the question, and the vision tower's
tensors round-trip through their HF names."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from PIL import Image

import popjax
from popjax.cli import main
from popjax.eval.digits_vlm import DIGIT_WORDS, QUESTIONS, answer, digits_vlm, make_tokenizer, question, train
from popjax.eval.digits_vqa import accuracy, answer_nll, digits_task
from popjax.eval.harness import EvalSettings, evaluate
from popjax.models.vision_config import VisionConfig, vision_params_from_hf, vision_tensor_shapes, vision_tensors_to_hf
from tests.reference.lm import SHORT


def test_tokenizer_writes_the_chat_format():
    tok = make_tokenizer()
    ids = tok.apply_chat_template(question(None, 1), add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    words = tok.convert_ids_to_tokens(ids)
    assert words == ["<|im_start|>", "user", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", *QUESTIONS[1].split(),
                     "<|im_end|>", "<|im_start|>", "assistant"]
    assert "<unk>" not in words and len(set(tok.convert_tokens_to_ids(list(DIGIT_WORDS)))) == 10


def test_answers_follow_the_question():
    assert [answer(7, i) for i in range(5)] == [7, 8, 9, 0, 1]


@pytest.mark.slow
def test_training_is_cached_like_a_converted_model(tmp_path, capsys):
    trained = train(SHORT)
    cached = digits_vlm(SHORT)
    assert digits_vlm(SHORT).source == cached.source  # a cache hit: the same entry, not a second training
    images = [np.full((56, 56, 3), 200, np.uint8), np.zeros((56, 56, 3), np.uint8)]
    prompts = [question(images[0], 0), question(images[1], 3)]
    a = popjax.generate(trained, prompts, max_new_tokens=3)
    b = popjax.generate(cached, prompts, max_new_tokens=3)
    assert a.token_ids == b.token_ids
    ids = popjax.generate(trained, prompts, max_new_tokens=1).prompt_token_ids  # one placeholder per image
    expanded = [r[:3] + r[3:4] * 4 + r[4:] for r in ids]
    got = np.asarray(popjax.forward(cached, [expanded[0]], images=[[images[0]]]))
    want = np.asarray(popjax.forward(trained, [expanded[0]], images=[[images[0]]]))
    np.testing.assert_allclose(got, want, atol=1e-5)
    acc, _ = accuracy(cached, None, images, np.array([3, 5]))
    assert acc.total == 2 and 0.0 <= acc.value <= 1.0
    assert np.all(np.isfinite(answer_nll(cached, popjax.POP(0.2, prompt_tokens="balanced"), images, np.array([3, 5]))))
    # popjax eval's digits_vqa task on the same model, and its refusal of a text model
    records = evaluate(cached, [popjax.POP(0.2, aggregate="per_sequence")], ["digits_vqa"], "", EvalSettings(digits_images=3))
    assert records[0]["digits_images"] == 3 and 0.0 <= records[0]["digits_accuracy"] <= 1.0
    # the CLI: an image file and a question, through the model's chat template
    Image.fromarray(images[0]).save(tmp_path / "digit.png")
    capsys.readouterr()
    assert main(["generate", "--model", cached.source, "--image", str(tmp_path / "digit.png"), QUESTIONS[0], "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.strip() == b.texts[0]


def test_vision_tensors_round_trip(tiny_vision_params):
    params, cfg = tiny_vision_params
    back = vision_params_from_hf(vision_tensors_to_hf(params, cfg, "visual."), cfg, prefix="visual.")
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(back)
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.fixture(scope="module")
def tiny_vision_params():
    """A random two-block Qwen2.5-VL tower (windowed: RMSNorm, gated MLP)."""
    cfg = VisionConfig.from_hf({"depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "out_hidden_size": 24,
                                "window_size": 56, "fullatt_block_indexes": [1]}, "qwen2_5_vl")
    rng = np.random.default_rng(0)
    tensors = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in vision_tensor_shapes(cfg).items()}
    return vision_params_from_hf(tensors, cfg), cfg


def test_digits_task_refuses_another_model(tiny_model):
    with pytest.raises(ValueError, match="the digits_vqa task asks the digits VLM"):
        digits_task(tiny_model, popjax.POP(0.2))


def test_digits_vqa_refuses_a_method_not_in_its_table():
    from popjax.eval.digits_vqa import digits_vqa

    with pytest.raises(ValueError, match=r"methods \['pop\(everything\)'\] are not in the table; valid: \['pop\(all\)'"):
        digits_vqa(None, methods=("pop(all)", "pop(everything)"))
