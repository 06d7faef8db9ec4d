"""A small Qwen2-VL trained here, so that pruning on image+text prompts has a quality measure
that can fail (docs/vlm.md, "A VLM trained here").

No real VLM weights are reachable here, so popjax trains one: a Qwen2-VL-architecture model (a
2-block vision tower with its patch merger, a 4-layer Qwen2 language model with M-RoPE) on
scikit-learn's handwritten digits (1,797 8×8 scans, upscaled to 56×56 RGB: 16 patches, 4 image
tokens), with optax, to answer "which digit is this ?" or "what is this digit plus k ?" (k = 1..4:
the answer needs the image and the question together) with "it is <word>". Its tokenizer is a word-level `tokenizers` vocabulary with a Qwen2-VL chat template, so
`popjax.generate` takes the same chat messages as for a real Qwen2-VL.

The trained weights are cached like a converted model (kind "converted", keyed by the recipe):
`digits_vlm()` trains once (about two minutes on 2 cores) and then loads from the cache.
Held-out: the last 297 digits (a fixed permutation), never trained on.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from PIL import Image
from tqdm.auto import tqdm

from ..cache import get_or_make
from ..convert.convert import checkpoint_shapes, unflatten
from ..convert.store import FORMAT_VERSION, write_into
from ..image_prompts import placeholder_layout
from ..images import PixelBatch, preprocess
from ..loaded import LoadedModel
from ..loading import build_model, load
from ..methods.base import DensePlan
from ..models.config import ModelConfig
from ..models.layers import PlacedEmbeddings
from ..models.interface import CacheView, FFNHook, ModelInputs
from ..models.vision import encode_images, vision_layout
from ..pruned import checkpoint_tree
from ..requests import pad_batch

log = logging.getLogger(__name__)

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
# question i asks for (digit + OFFSETS[i]) mod 10: the answer needs the image and the text
# together (an FFN's kind of work), so pruning and the choice of scoring tokens can show
QUESTIONS = ("which digit is this ?", "what is this digit plus one ?", "what is this digit plus two ?",
             "what is this digit plus three ?", "what is this digit plus four ?")
OFFSETS = (0, 1, 2, 3, 4)
# the answer starts with two words, so the digit's word is the third new token: a decode step (not
# the prompt's own pass) produces it, where POP's candidates and dynamic's selection act
ANSWER_PREFIX = ("it", "is")
SPECIAL = ("<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
IMAGE_SIZE = 56  # pixels: a 4 × 4 patch grid, 4 image tokens after the 2 × 2 merge
HELD_OUT = 297
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }} "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% elif item['type'] == 'text' %}"
    "{{ item['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What the trained model is (its cache key): sizes, steps, batch, learning rate, seed."""

    hidden: int = 128
    ffn: int = 512
    layers: int = 4
    vision_width: int = 64
    vision_depth: int = 2
    steps: int = 1500
    batch: int = 32
    learning_rate: float = 2e-3
    seed: int = 0
    version: int = 4


def vocabulary() -> list[str]:
    words = sorted(({w for q in QUESTIONS for w in q.split()} | {"user", "assistant"} | set(ANSWER_PREFIX)) - set(DIGIT_WORDS))
    return [*SPECIAL, *words, *DIGIT_WORDS]  # "one" .. "four" are question words and answers: one id each


def make_tokenizer():
    """A word-level tokenizer over `vocabulary` with Qwen2-VL's special tokens and chat format."""
    from tokenizers import Tokenizer, models, pre_tokenizers  # heavy: only to build the tokenizer
    from transformers import PreTrainedTokenizerFast  # heavy: see above

    vocab = {w: i for i, w in enumerate(vocabulary())}
    assert len(vocab) == len(vocabulary()), "the vocabulary has a duplicate word"
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>", eos_token="<|im_end|>",
                                  additional_special_tokens=list(SPECIAL[2:]))
    tok.chat_template = CHAT_TEMPLATE
    return tok


def model_config(recipe: Recipe) -> ModelConfig:
    ids = {w: i for i, w in enumerate(vocabulary())}
    heads = recipe.hidden // 32  # head_dim 32: M-RoPE's 16 frequencies as (4, 6, 6)
    return ModelConfig.from_hf_dict({
        "model_type": "qwen2_vl", "vocab_size": len(ids), "hidden_size": recipe.hidden, "intermediate_size": recipe.ffn,
        "num_hidden_layers": recipe.layers, "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2),
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256, "tie_word_embeddings": True,
        "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]}, "eos_token_id": ids["<|im_end|>"],
        "image_token_id": ids["<|image_pad|>"], "vision_start_token_id": ids["<|vision_start|>"],
        "vision_config": {"depth": recipe.vision_depth, "embed_dim": recipe.vision_width, "hidden_size": recipe.hidden,
                          "num_heads": recipe.vision_width // 16, "mlp_ratio": 2},
    })


def digit_images(split: str) -> tuple[list[np.ndarray], np.ndarray]:
    """scikit-learn's digits of ``split`` ("train": all but the last `HELD_OUT` of a fixed
    permutation, "test": those) -> (RGB uint8 [56, 56, 3] images, labels [n])."""
    from sklearn.datasets import load_digits  # heavy: scikit-learn only for the digits

    digits = load_digits()
    order = np.random.default_rng(0).permutation(len(digits.target))
    order = order[:-HELD_OUT] if split == "train" else order[-HELD_OUT:]
    images = []
    for pixels in digits.images[order]:
        gray = Image.fromarray((pixels * (255 / 16)).astype(np.uint8), "L").resize((IMAGE_SIZE, IMAGE_SIZE), Image.BILINEAR)
        images.append(np.asarray(gray.convert("RGB")))
    return images, digits.target[order]


def answer(label: int, index: int) -> int:
    """The digit question ``index`` asks for about an image of ``label``."""
    return (int(label) + OFFSETS[index % len(QUESTIONS)]) % 10


def question(image: Any, index: int) -> list[dict]:
    """The chat messages asking question ``index`` (mod 5) about ``image``."""
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": QUESTIONS[index % len(QUESTIONS)]}]}]


def _initial_tree(cfg: ModelConfig, seed: int) -> dict[str, Any]:
    """Random weights for every tensor of ``cfg`` (the converted layout): norms 1, biases 0,
    matrices N(0, 1/fan_in)."""
    rng = np.random.default_rng(seed)
    flat = {}
    for name, shape in checkpoint_shapes(cfg).items():
        if name.endswith("norm.weight") or name.endswith(("norm1.weight", "norm2.weight", "ln_q.weight")):
            flat[name] = np.ones(shape, np.float32)
        elif name.endswith("bias") or len(shape) == 1:
            flat[name] = np.zeros(shape, np.float32)
        else:
            flat[name] = (rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32)
    return unflatten(flat)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Batch:
    tokens: np.ndarray  # [B, T] left-padded
    mask: np.ndarray
    positions: np.ndarray  # [3, B, T]
    slots: np.ndarray  # [B, T]
    targets: np.ndarray  # [B, T] next token, -1 where not scored


def question_prompts(model: LoadedModel) -> list[list[int]]:
    """Each question's prompt ids through the chat template, the image's placeholder expanded to
    the 4 tokens of a 56 × 56 digit (its 4 × 4 patch grid merged 2 × 2)."""
    tok, image_id = model.tokenizer, model.config.image_token_id
    out = []
    for index in range(len(QUESTIONS)):
        ids = tok.apply_chat_template(question(None, index), add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        at = ids.index(image_id)
        out.append(ids[:at] + [image_id] * 4 + ids[at + 1:])
    return out


def _examples(model: LoadedModel, prompts: list[list[int]], pixels: PixelBatch, labels, rng) -> Batch:
    """The questions' prompts (`question_prompts`), the batch's images (preprocessed) and labels
    -> one teacher-forcing batch: a random question per image, its answer ("it is <digit>") and
    the end-of-turn scored."""
    tok = model.tokenizer
    rows, answer_starts = [], []
    for label in labels:
        index = int(rng.integers(len(QUESTIONS)))
        answer_starts.append(len(prompts[index]))
        rows.append(prompts[index] + tok.convert_tokens_to_ids([*ANSWER_PREFIX, DIGIT_WORDS[answer(label, index)], "<|im_end|>"]))
    tokens, mask = pad_batch(rows, 0, length=max(map(len, rows)))
    targets = np.full(tokens.shape, -1, np.int32)
    T = tokens.shape[1]
    for b, (ids, start) in enumerate(zip(rows, answer_starts)):
        targets[b, T - len(ids) + start - 1: T - 1] = ids[start:]
    slots, positions, _ = placeholder_layout(model.config, tokens, mask, pixels.grid_thw)
    return Batch(tokens, mask, positions.astype(np.int32), slots, targets)


def train(recipe: Recipe = Recipe()) -> LoadedModel:
    """Trains the model of ``recipe`` from random weights (in memory) and returns it."""
    cfg = model_config(recipe)
    model = build_model(cfg, _initial_tree(cfg, recipe.seed), make_tokenizer(), "digits-vlm", "float32")
    images, labels = digit_images("train")
    rng = np.random.default_rng(recipe.seed)
    plan = DensePlan(f=cfg.intermediate_size, n_keep=cfg.intermediate_size)
    layout = vision_layout(np.tile([[1, 4, 4]], (recipe.batch, 1)), cfg.vision, recipe.batch * 16).arrays
    graphdef = model.graphdef

    def loss_fn(trainable, batch: Batch, pixel_values):
        state, vision = trainable
        net = nnx.merge(graphdef, state)
        valid = batch.mask.astype(bool)
        features = encode_images(vision, cfg.vision, pixel_values, layout)
        dense = lambda w, _s, x, rows: plan.prefill(w, x, rows)
        logits = net(ModelInputs(batch.tokens, batch.positions, PlacedEmbeddings(features, batch.slots)),
                     cache=CacheView(None, valid), ffn=FFNHook(dense, None, valid)).logits
        scored = batch.targets >= 0
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, jnp.maximum(batch.targets, 0)[..., None], axis=-1)[..., 0]
        return jnp.sum(jnp.where(scored, nll, 0.0)) / jnp.sum(scored)

    warmup = min(50, recipe.steps // 4)
    schedule = optax.warmup_cosine_decay_schedule(0.0, recipe.learning_rate, warmup, max(recipe.steps, warmup + 1))
    optimizer = optax.adamw(schedule, weight_decay=0.01)
    trainable = (model.params, model.vision)
    opt_state = optimizer.init(trainable)

    @jax.jit
    def step(trainable, opt_state, batch, pixel_values):
        loss, grads = jax.value_and_grad(loss_fn)(trainable, batch, pixel_values)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, loss

    prompts = question_prompts(model)  # the chat template and the image preprocessing run once, not per step
    pixels = preprocess(images, model.image_processor)
    patches = pixels.pixel_values.reshape(len(images), -1, pixels.pixel_values.shape[-1])  # 16 patches per digit
    bar = tqdm(range(recipe.steps), desc="training the digits VLM", unit="step")
    for _ in bar:
        pick = rng.choice(len(images), recipe.batch, replace=False)
        chosen = PixelBatch(patches[pick].reshape(-1, patches.shape[-1]), pixels.grid_thw[pick])
        batch = _examples(model, prompts, chosen, labels[pick], rng)
        trainable, opt_state, loss = step(trainable, opt_state, jax.tree_util.tree_map(jnp.asarray, batch),
                                          jnp.asarray(chosen.pixel_values))
        bar.set_postfix(loss=f"{float(loss):.3f}")
    state, vision = trainable
    trained = dataclasses.replace(model, params=state, vision=vision)  # derived constants are recomputed on the rebuild
    return build_model(cfg, checkpoint_tree(trained), model.tokenizer, "digits-vlm", "float32", image_processor=model.image_processor)


def digits_vlm(recipe: Recipe = Recipe(), cache: bool = True) -> LoadedModel:
    """The trained digits VLM: from popjax's cache (kind "converted"), trained into it first if
    it is not there (atomic: a killed training leaves no entry)."""
    return load(trained_directory(recipe)) if cache else train(recipe)


def trained_directory(recipe: Recipe = Recipe()) -> Path:
    """The cache entry (a converted directory) of the digits VLM trained with ``recipe``,
    trained into it first if it is not there. The named source ``digits-vlm``
    (convert/sources.py) resolves to it, so ``popjax.load("digits-vlm")`` and every command's
    ``--model digits-vlm`` read it."""

    def make(directory: Path) -> None:
        trained = train(recipe)
        write_into(directory, trained.config, checkpoint_tree(trained), lambda target: trained.tokenizer.save_pretrained(str(target)) or True,
                   {"source": "digits-vlm", "kind": "trained", "dtype": "float32", "weights": "float"})

    key = {"format": FORMAT_VERSION, "source": "popjax digits VLM", **dataclasses.asdict(recipe), "vocabulary": vocabulary(),
           "questions": list(QUESTIONS), "offsets": list(OFFSETS), "answer": list(ANSWER_PREFIX)}
    return get_or_make("converted", key, make, name="digits-vlm")
