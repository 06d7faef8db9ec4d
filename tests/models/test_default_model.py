"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers on the same file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import popjax
from popjax import cache, loading
from popjax.convert import default_gguf_path
from tests.conftest import hf_model_from_gguf, shared_gguf_readers

pytestmark = pytest.mark.slow  # the real default model

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the square of a number.",
    "Give me three tips for sleeping better.",
]


@pytest.fixture(scope="session")
def default_model():
    # scanned layers: the same decoder layer as the unrolled default (tests/models/test_scan.py holds
    # them equal; the two-layer cut of the notebooks and CLI tests runs unrolled), compiled once
    return popjax.load(scan_layers=True)


@pytest.fixture(scope="session")
def hf_default_model():
    return hf_model_from_gguf(default_gguf_path())


@pytest.mark.real_model
def test_config_of_the_default_model(default_model):
    cfg = default_model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.tie_word_embeddings) == (9, 3, True)


@pytest.mark.real_model
def test_the_default_model_is_read_from_the_cache(default_model, monkeypatch):
    """The GGUF and the conversion are popjax cache entries (`popjax cache list` shows them); the
    second load converts nothing, and the converted entry (large: checked by its manifest) is
    still as recorded after orbax restored it, so no later load rebuilds it."""
    gguf = default_gguf_path()
    entries = {e.path: e for e in cache.list_entries()}
    assert entries[gguf.parent].kind == "downloads" and entries[gguf.parent].key_fields["member"].endswith(gguf.name)
    (converted,) = [e for e in entries.values() if e.kind == "converted" and e.key_fields["source"] == str(gguf.resolve())
                    and e.key_fields["dtype"] == default_model.dtype and e.key_fields.get("weights", "float") == "float"]
    assert converted.size > cache.FULL_VERIFY_MAX_BYTES
    monkeypatch.setattr(loading, "_convert", lambda *a: pytest.fail("converted again on a cache hit"))
    again = popjax.load()
    assert again.config == default_model.config
    assert cache.check_entry(converted.path, "manifest") is None and cache.check_entry(gguf.parent, "manifest") is None


@pytest.fixture(scope="module")
def greedy(default_model):
    """32 greedy tokens for each of PROMPTS (chat template, one left-padded batch) in fp32."""
    return popjax.generate(default_model, PROMPTS, max_new_tokens=32)


@pytest.mark.real_model
def test_greedy_generation_matches_transformers(default_model, hf_default_model, greedy):
    ours = greedy
    tok = default_model.tokenizer
    eos = tok.eos_token_id
    for prompt_ids, got in zip(ours.prompt_token_ids, ours.token_ids):
        with torch.no_grad():
            out = hf_default_model.generate(
                torch.tensor([prompt_ids]), max_new_tokens=32, do_sample=False, eos_token_id=eos, pad_token_id=eos
            )
        want = out[0, len(prompt_ids) :].tolist()
        want = want[: want.index(eos)] if eos in want else want
        assert got == want, (tok.decode(got), tok.decode(want))
    assert "Paris" in ours.texts[0]


def test_sampling_is_reproducible_with_a_seed(short_default_model_dir):
    """Its embeddings, tokenizer and first two layers: a real distribution to sample from."""
    model = popjax.load(short_default_model_dir)
    a = popjax.generate(model, PROMPTS[2], max_new_tokens=16, temperature=0.8, top_p=0.9, seed=7)
    b = popjax.generate(model, PROMPTS[2], max_new_tokens=16, temperature=0.8, top_p=0.9, seed=7)
    c = popjax.generate(model, PROMPTS[2], max_new_tokens=16, temperature=0.8, top_p=0.9, seed=8)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_torch_free_gguf_tokenizer_matches_transformers():
    """popjax builds the GGUF tokenizer without torch; it must equal transformers' (which needs torch)."""
    from transformers import AutoTokenizer

    from popjax.convert.readers import gguf_tokenizer

    path = default_gguf_path()
    ours = gguf_tokenizer(path)
    with shared_gguf_readers():
        theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = ["Hello, world!", "  def f(x):\n\treturn x ** 2  # 12345", "Ünïcödé — 東京 🙂", PROMPTS[1]]
    for text in texts:
        assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    chat = [{"role": "user", "content": PROMPTS[0]}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == theirs.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=False
    )
    assert (ours.eos_token_id, ours.bos_token_id) == (theirs.eos_token_id, theirs.bos_token_id)


@pytest.mark.real_model
def test_bf16_follows_the_fp32_greedy_tokens(default_model, greedy):
    """bf16 (weights, activations; tests/models/test_bf16.py holds every architecture to
    transformers in bf16), teacher-forced on the fp32 model's greedy continuations of the chat
    prompts, picks fp32's token at ≥ 90% of the positions and at every one where fp32's top two
    logits are more than 1 nat apart. bf16 rounding moves the logits by up to ~0.7 (measured),
    so a near tie may flip; compared free-running, one early flip (the first token of PROMPTS[0]:
    fp32's top two are 0.08 apart) changes the whole continuation."""
    seqs = [p + t for p, t in zip(greedy.prompt_token_ids, greedy.token_ids)]
    T = max(map(len, seqs))
    ids = np.array([[0] * (T - len(s)) + s for s in seqs])
    mask = np.array([[0] * (T - len(s)) + [1] * len(s) for s in seqs])
    # scanned layers: the same decoder layer (tests/models/test_scan.py), a fraction of the compile time
    bf16 = np.asarray(popjax.forward(popjax.load(dtype="bfloat16", scan_layers=True), ids, mask))
    fp32 = np.asarray(popjax.forward(default_model, ids, mask))
    agree, total = 0, 0
    for i, tokens in enumerate(greedy.token_ids):
        at = np.arange(T - len(tokens) - 1, T - 1)  # the positions that predicted each generated token
        assert (fp32[i, at].argmax(-1) == tokens).all()  # the forward pass is the greedy run's model
        top2 = np.sort(fp32[i, at], -1)[:, -2:]
        picked = bf16[i, at].argmax(-1) == np.asarray(tokens)
        assert picked[top2[:, 1] - top2[:, 0] > 1.0].all(), (i, picked, top2)
        agree, total = agree + picked.sum(), total + len(tokens)
    assert agree / total >= 0.9, (agree, total)
