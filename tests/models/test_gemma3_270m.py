"""The real Gemma 3 270M (``popjax.load("gemma-3-270m", scan_layers=True)``: Google's base model as a Q4_K_M GGUF
assembled from four PyPI chunk packages) against transformers reading the same file (fp32): the
logits of a 632-token window of Hamlet, and 32 greedy tokens past a 600-token prompt, beyond the
512-token sliding window. Fetched, assembled and converted once into the popjax cache (about
250 MB downloaded, 1 GB converted)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

import popjax
from popjax import cache
from popjax.convert import sources
from popjax.data import DEV_PLAY, load_play
from tests.conftest import hf_model_from_gguf

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

PROMPT_TOKENS = 600  # past the sliding window (512): the ring caches wrap during prefill and decode
STEPS = 32
RTOL = 1e-4  # max |popjax − transformers| relative to the largest |logit|


@pytest.fixture(scope="module")
def gemma():
    # its 18 layers as one scanned layer (tests/models/test_scan.py and test_gemma3.py hold it equal to
    # the unrolled model, ring caches included) compile in a fraction of the time (this file: 68 s -> 43 s)
    return popjax.load("gemma-3-270m", dtype="float32", scan_layers=True)


@pytest.fixture(scope="module")
def hf_gemma():
    return hf_model_from_gguf(sources.gemma_3_270m_gguf_path())


def test_the_gguf_is_one_checked_cache_entry(gemma):
    path = sources.gemma_3_270m_gguf_path()
    (entry,) = [e for e in cache.list_entries() if e.path == path.parent]
    assert entry.kind == "downloads" and sorted(p.name for p in path.parent.iterdir()) == ["entry.json", sources.GEMMA_FILE]
    assert path.stat().st_size == sources.GEMMA_SIZE
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(1 << 24):
            digest.update(piece)
    assert digest.hexdigest() == sources.GEMMA_SHA256
    cfg = gemma.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.sliding_window) == ("gemma3_text", 18, 640, 2048, 512)
    assert cfg.layer_types.count("full_attention") == 3 and gemma.source == "gemma-3-270m"


def test_logits_and_greedy_tokens_match_transformers(gemma, hf_gemma):
    """popjax decodes 32 greedy tokens (ring caches, decode path); transformers scores the
    prompt and those tokens in one forward: its logits equal popjax's prefill logits of the same
    632 tokens, and its argmax after each prefix is popjax's next token, so its own greedy
    decoding from the prompt yields the same 32 tokens."""
    text = load_play(DEV_PLAY)[20000:30000]  # real prose: a window of Hamlet (the development play)
    prompt = gemma.tokenizer(text)["input_ids"][:PROMPT_TOKENS]
    assert len(prompt) == PROMPT_TOKENS and prompt[0] == gemma.config.bos_token_id
    tokens, _ = popjax.generate_ids(gemma, [prompt], max_new_tokens=STEPS, ignore_eos=True)
    tokens = tokens[0]
    assert len(tokens) == STEPS
    ours = np.asarray(popjax.forward(gemma, [prompt + tokens]))[0]
    with torch.no_grad():
        want = hf_gemma(torch.tensor([prompt + tokens])).logits[0].numpy()
    assert ours.shape == want.shape == (PROMPT_TOKENS + STEPS, gemma.config.vocab_size)
    assert np.abs(ours - want).max() <= RTOL * np.abs(want).max()
    greedy = want[PROMPT_TOKENS - 1 : PROMPT_TOKENS - 1 + STEPS].argmax(-1).tolist()
    assert greedy == tokens, (gemma.tokenizer.decode(greedy), gemma.tokenizer.decode(tokens))
