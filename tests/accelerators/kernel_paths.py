"""The check every method's ``kernel="pallas"`` path passes against its ``kernel="xla"`` path
(tests/accelerators/test_*_kernels.py): the same greedy tokens and log-probabilities."""

from __future__ import annotations

import dataclasses

import numpy as np

from popjax.eval.teacher import teacher_forced
from popjax.generation import generate_ids
from popjax.loaded import with_scanned_layers
from tests.conftest import random_prompts

LOGPROB_ATOL = 1e-5
NEW_TOKENS = 6


def logprobs(model, method, prompts, targets) -> np.ndarray:
    """Teacher-forced log-probabilities [B, N, V] of ``targets`` after ``prompts``."""
    return np.asarray(teacher_forced(model, method, prompts, targets, with_logprobs=True)[1])


def assert_kernel_path_equals_xla(model, xla, pallas, prompts) -> None:
    """Log-probs within 1e-5 and the same greedy tokens: XLA's greedy continuation
    (`NEW_TOKENS`), fed to both paths, is the argmax of the kernel path's log-probs at every
    step (so greedy decoding through the kernel makes the same tokens, one compile fewer than a
    second generate)."""
    greedy = np.asarray(generate_ids(model, prompts, NEW_TOKENS, method=xla, ignore_eos=True)[0])
    assert greedy.shape == (len(prompts), NEW_TOKENS)
    got, want = logprobs(model, pallas, prompts, greedy), logprobs(model, xla, prompts, greedy)
    np.testing.assert_allclose(got, want, atol=LOGPROB_ATOL, rtol=0)
    np.testing.assert_array_equal(got.argmax(-1), greedy)


def check_method_kernel(model, xla, layout: str, seed: int = 0) -> None:
    """A prepared method with ``kernel="xla"`` and its ``kernel="pallas"`` twin (interpret mode
    here) on ``model`` (``layout`` "scanned": its scanned form, where the kernel reads stacked
    copies at a traced layer index): `assert_kernel_path_equals_xla` on a batch of 2 prompts."""
    if layout == "scanned":
        model = with_scanned_layers(model)
    pallas = dataclasses.replace(xla, kernel="pallas")
    assert pallas.bind(model.config).kernel == "pallas-interpret" and xla.bind(model.config).kernel == "xla"
    prompts = random_prompts(np.random.default_rng(seed), (9, 6), model.config.vocab_size)
    assert_kernel_path_equals_xla(model, xla, pallas, prompts)
