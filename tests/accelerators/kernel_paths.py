"""The check every method's ``kernel="pallas"`` path passes against its ``kernel="xla"`` path
(tests/accelerators/test_*_kernels.py): the same greedy tokens and log-probabilities; the
methods prepared for it (`ready`), and thresholds that need no calibration (`placeholder_thresholds`)."""

from __future__ import annotations

import dataclasses

import numpy as np

import popjax
from popjax.eval.teacher import teacher_forced
from popjax.generation import generate_ids
from popjax.loaded import with_scanned_layers
from popjax.methods.teal import Thresholds
from tests.conftest import random_prompts
from tests.reference.corpus import tiny_corpus

LOGPROB_ATOL = 1e-5
NEW_TOKENS = 6


def logprobs(model, method, prompts, targets) -> np.ndarray:
    """Teacher-forced log-probabilities [B, N, V] of ``targets`` after ``prompts``."""
    return np.asarray(teacher_forced(model, method, prompts, targets, with_logprobs=True)[1])


def assert_kernel_path_equals_xla(model, xla, pallas, prompts, atol: float = LOGPROB_ATOL) -> None:
    """Log-probs within ``atol`` (1e-5) and the same greedy tokens: XLA's greedy continuation
    (`NEW_TOKENS`), fed to both paths, is the argmax of the kernel path's log-probs at every
    step (so greedy decoding through the kernel makes the same tokens, one compile fewer than a
    second generate)."""
    greedy = np.asarray(generate_ids(model, prompts, NEW_TOKENS, method=xla, ignore_eos=True)[0])
    assert greedy.shape == (len(prompts), NEW_TOKENS)
    got, want = logprobs(model, pallas, prompts, greedy), logprobs(model, xla, prompts, greedy)
    np.testing.assert_allclose(got, want, atol=atol, rtol=0)
    np.testing.assert_array_equal(got.argmax(-1), greedy)


def check_method_kernel(model, xla, layout: str, seed: int = 0, atol: float = LOGPROB_ATOL) -> None:
    """A prepared method with ``kernel="xla"`` and its ``kernel="pallas"`` twin (interpret mode
    here) on ``model`` (``layout`` "scanned": its scanned form, where the kernel reads stacked
    copies at a traced layer index): `assert_kernel_path_equals_xla` on a batch of 2 prompts."""
    if layout == "scanned":
        model = with_scanned_layers(model)
    pallas = dataclasses.replace(xla, kernel="pallas")
    assert pallas.bind(model.config).kernel == "pallas-interpret" and xla.bind(model.config).kernel == "xla"
    prompts = random_prompts(np.random.default_rng(seed), (9, 6), model.config.vocab_size)
    assert_kernel_path_equals_xla(model, xla, pallas, prompts, atol)


def ready(name: str, model, aggregate: str, cache_dir):
    """``name``'s method with ``kernel="xla"``, prepared for ``model``: TEAL 40% and CATS at its
    paper's 50% channel sparsity (thresholds calibrated on a small text, cached in ``cache_dir``),
    WINA 40% (its column norms), principal TEAL 40% (rank 4: bases and thresholds from the small
    text) or dynamic POP 40%."""
    if name == "wina":
        return popjax.WINA(ratio=0.4, aggregate=aggregate, kernel="xla").prepare(model)
    if name == "principal-teal":
        return popjax.PrincipalTEAL(ratio=0.4, rank=4, aggregate=aggregate, kernel="xla").calibrate(model, tiny_corpus(), cache=False)
    if name.startswith("dynamic"):  # "dynamic", "dynamic-block" (whole blocks of 8 channels) or "dynamic-block-calibrated"
        method = popjax.Dynamic(ratio=0.4, aggregate=aggregate, kernel="xla", block=1 if name == "dynamic" else 8,
                                block_order="calibrated" if name.endswith("calibrated") else "model")
        return method.calibrate(model, tiny_corpus(), cache=False) if method.needs_calibration else method
    if name == "larosa":
        return popjax.LaRoSa(ratio=0.4, aggregate=aggregate, kernel="xla").calibrate(model, tiny_corpus(), cache=False)
    method = popjax.CATS(ffn_sparsity=0.5, aggregate=aggregate, kernel="xla") if name == "cats" else \
        popjax.TEAL(ratio=0.4, aggregate=aggregate, kernel="xla")
    return method.calibrate(model, tiny_corpus(), cache_dir=cache_dir)


def placeholder_thresholds(cfg, method):
    """``method`` (TEAL or CATS) with thresholds for its budget and no calibration (what bind and
    data check; the values, 0.1 for every layer, matter to no test that uses them)."""
    targets = method.targets(cfg)
    per_tensor = tuple((tensor, (0.1,) * cfg.num_hidden_layers) for tensor in targets)
    return dataclasses.replace(method, thresholds=Thresholds(tuple((t, s) for t, (_, s) in targets.items()), per_tensor))
