"""What the method matrix and the tests beside it (int8, Gemma 3, MoE) share: a registered method
made ready for a tiny model of one family (calibrated on random tokens, given its drift, or
prepared), and an int8 model's float reference, its dequantized twin (weights q · s)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

from popjax.convert.fused import dequantize_tree
from popjax.corpus import Corpus
from popjax.loading import build_model, place_model
from popjax.methods import make_method
from popjax.pruned import checkpoint_tree
from tests.reference.gemma3 import SKIP as GEMMA3_SKIP

CALIBRATED = ("teal", "cats", "wanda-sp", "flap", "glass", "larosa", "principal-teal")  # statistics over a corpus
HYPER = {"pop-lowrank": {"rank": 4}, "principal-teal": {"rank": 2}}
PREFILL_SKIP = {"llama": (1,), "moe": (0,), "gemma3": GEMMA3_SKIP, "vlm": (1,)}  # Prefill-Only's skipped layers


def dequantized_twin(model):
    """The float model whose weights are the int8 model's q · s (same config, weights "float");
    a VLM's through its checkpoint tree (the vision tower with it)."""
    cfg = dataclasses.replace(model.config, weights="float")
    if model.config.vision is not None:
        return build_model(cfg, checkpoint_tree(model), model.tokenizer, "dequantized", "float32")
    tree = dequantize_tree(jax.tree_util.tree_map(np.asarray, nnx.to_pure_dict(model.params)))
    tree["layers"] = {str(k): v for k, v in tree["layers"].items()}
    return place_model(cfg, tree, model.tokenizer, "dequantized", "float32")


def ready(name: str, arch_name: str, model, **hyper):
    """The registered method ``name`` (with ``hyper`` over the matrix's own hyper-parameters)
    ready for ``model`` of the family ``arch_name``: prefill-only composed with POP over the
    family's skipped layers, calibrated on random tokens or given its drift, then prepared."""
    if name == "prefill-only":
        method = make_method("prefill-only+pop", skip=PREFILL_SKIP[arch_name], **hyper)
    else:
        method = make_method(name, **{**HYPER.get(name, {}), **hyper})
    vocab = min(model.config.vocab_size, 160)
    corpus = Corpus.from_token_ids("random", np.random.default_rng(1).integers(3, vocab, 6 * 16), window=16)
    if name in CALIBRATED:
        method = method.calibrate(model, corpus, cache=False)
    elif name == "pop-bands":
        method = method.prepare(model, corpus=corpus)
    return method.prepare(model)
