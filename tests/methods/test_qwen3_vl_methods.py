"""Every registered method generates on the tiny Qwen3-VL and Qwen3-VL-MoE (interleaved M-RoPE,
DeepStack after decoder layers 0 and 1; the MoE variant's methods run per expert, docs/moe.md)
after a prompt with an image, in a padded batch with a text-only row; and
Prefill-Only's decision for DeepStack: a layer it skips in prefill still gets its DeepStack
features added to the residual stream after its slot (models/deepstack.py, docs/vlm.md)."""

from __future__ import annotations

import numpy as np
import pytest

import popjax
from popjax.corpus import Corpus
from popjax.methods import METHODS, make_method

pytest.importorskip("torch")
pytest.importorskip("transformers.models.qwen3_vl")
pytest.importorskip("sklearn.datasets")

from tests.reference.qwen3_vl import digit, expanded, hf_model, padded, saved  # noqa: E402 (after the skips)

CALIBRATED = ("teal", "cats", "wanda-sp", "flap", "glass", "larosa", "principal-teal")  # statistics over a corpus
HYPER = {"pop-lowrank": {"rank": 4}, "principal-teal": {"rank": 2}}
SKIP = (0,)  # Prefill-Only skips decoder layer 0, after which DeepStack adds its first feature set


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_vl_moe"])
def model(request, tmp_path_factory):
    moe = request.param == "qwen3_vl_moe"
    return popjax.load(str(saved(hf_model(moe=moe), tmp_path_factory.mktemp(request.param))), cache=False)


def ready(name: str, model):
    """The registered method ``name`` ready for ``model``: Prefill-Only composed with POP over
    `SKIP`, the calibrated methods calibrated on random token windows, pop-bands given its drift."""
    method = make_method("prefill-only+pop", skip=SKIP) if name == "prefill-only" else make_method(name, **HYPER.get(name, {}))
    corpus = Corpus.from_token_ids("random", np.random.default_rng(1).integers(3, 90, 6 * 16), window=16)
    if name in CALIBRATED:
        method = method.calibrate(model, corpus, cache=False)
    elif name == "pop-bands":
        method = method.prepare(model, corpus=corpus)
    return method.prepare(model)


@pytest.mark.slow  # 21 methods on two models, each compiled for the VLM: about 4 CPU-minutes
@pytest.mark.parametrize("name", sorted(METHODS))
def test_method_generates_after_an_image(model, name):
    rows, images = (list(x) for x in zip(expanded([[5, 6], digit(2, (64, 64)), [7, 8]]), expanded([[9, 10, 11]])))
    out, _ = popjax.generate_ids(model, rows, max_new_tokens=4, images=images, method=ready(name, model), ignore_eos=True)
    assert [len(o) for o in out] == [4, 4] and all(0 <= t < model.config.vocab_size for o in out for t in o), name


def test_prefill_only_keeps_the_deepstack_features_of_a_skipped_layer(model):
    """Prefill-Only skips layer 0 in prefill; DeepStack's set 0, added after layer 0's slot,
    still changes the prompt's logits (were it dropped with the layer, zeroing it would not)."""
    rows, images = (list(x) for x in zip(expanded([[5, 6], digit(0, (64, 64)), [7, 8, 9]])))
    ids, mask = padded(rows)
    method = ready("prefill-only", model)
    assert method.bind(model.config).layer_control(model.config.num_hidden_layers).mode(0) != "full"
    base = np.asarray(popjax.forward(model, ids, mask, method=method, images=images))
    deep = model.vision["deepstack"]
    try:  # set 0 alone is zeroed: its merger's last linear layer
        model.vision["deepstack"] = {**deep, "mlp2_w": deep["mlp2_w"].at[0].set(0), "mlp2_b": deep["mlp2_b"].at[0].set(0)}
        without = np.asarray(popjax.forward(model, ids, mask, method=method, images=images))
    finally:
        model.vision["deepstack"] = deep
    assert np.abs(base - without).max() > 1e-3
