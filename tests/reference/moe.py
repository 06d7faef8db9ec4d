"""Tiny random mixture-of-experts models and a NumPy view of their blocks, for the MoE method tests
(tests/methods/test_moe_methods.py, test_moe_statistics.py) and the method matrix: the configs,
a builder, a corpus of random tokens, and per block (routed experts, shared expert, a dense
layer's blocks) its weights and the tokens the router sends it."""

from __future__ import annotations

import numpy as np
from flax import nnx

from popjax.calibration import Corpus
from popjax.convert import convert as conv
from popjax.loading import build_model
from popjax.models.config import ModelConfig

BASE = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
# qwen2_moe: a sparse layer (8 experts + a 24-wide shared expert = 1.5 blocks) and a dense layer
# (mlp_only_layers, 40 wide = 2.5 blocks): 11 block slots, slot 10 empty in layer 0, 0-7 in layer 1.
# qwen3_moe: one layer of 4 routed experts (4 slots); a batch of one routes 2 of 4 (gathered decode).
CONFIGS = {
    "qwen2_moe": dict(num_hidden_layers=2, intermediate_size=40, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                      num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1]),
    "qwen3_moe": dict(num_hidden_layers=1, intermediate_size=48, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                      head_dim=8, norm_topk_prob=True),
}
PROMPTS = {"qwen2_moe": [[5, 6, 7, 8, 9], [10, 11, 12]], "qwen3_moe": [[5, 6, 7, 8]]}


def build_moe(kind: str, seed: int = 0):
    """A random model (float32) and its HF-layout weights (float64 numpy)."""
    cfg = ModelConfig.from_hf_dict({"model_type": kind, **BASE, **CONFIGS[kind]})
    rng = np.random.default_rng(seed)
    hf = {k: rng.normal(0, 0.3, size=s) for k, s in conv.checkpoint_shapes(cfg).items()}
    tree = conv.unflatten({k: v.astype(np.float32) for k, v in hf.items()})
    return build_model(cfg, tree, None, kind, "float32"), hf


def moe_corpus(windows: int = 6, window: int = 16) -> Corpus:
    return Corpus.from_token_ids("random", np.random.default_rng(1).integers(3, 64, windows * window), window=window)


def layer_inputs(model, by_slot_input: np.ndarray) -> np.ndarray:
    """[L, slots, B, T, d] (one copy per block) -> [L, B, T, d] from a slot each layer has."""
    mask = model.config.moe.slot_mask(model.config.num_hidden_layers)
    return np.stack([by_slot_input[l, np.flatnonzero(mask[l])[0]] for l in range(len(mask))]).astype(np.float64)


def slot_ffns(model, hf, layer: int):
    """Per slot (gate [f, d], up [f, d], down [d, f]) float64 in the model's stored channel order
    (zeros for padding), taken from the HF-layout weights; None for a slot without a block."""
    moe, p = model.config.moe, f"layers.{layer}.mlp."
    mlp = nnx.merge(model.graphdef, model.params).layers[layer].mlp
    blocks = [(e, f"{p}experts.{e}.", mlp.experts.channel_order[e]) for e in range(moe.num_experts) if moe.is_sparse(layer)]
    if hasattr(mlp, "shared"):  # a shared expert, or a dense layer's FFN, split into blocks
        prefix = p + "shared." if moe.is_sparse(layer) else p
        blocks += [(moe.num_experts + b, prefix, order) for b, order in enumerate(mlp.shared.channel_order[...])]
    out = [None] * moe.slots(model.config.num_hidden_layers)
    for slot, prefix, order in blocks:
        real, ids = np.asarray(order) >= 0, np.maximum(np.asarray(order), 0)
        rows = lambda w: np.where(real[:, None], w[ids], 0.0)
        out[slot] = (rows(hf[prefix + "gate"]), rows(hf[prefix + "up"]), rows(hf[prefix + "down"].T).T)
    return out


def routed_tokens(model, hf, layer: int, x: np.ndarray) -> np.ndarray:
    """[slots, B, T] bool: the tokens each block sees (top-k experts by router; always-active blocks: all)."""
    cfg = model.config
    S, E, k = cfg.moe.slots(cfg.num_hidden_layers), cfg.moe.num_experts, cfg.moe.top_k
    mask = np.zeros((S, *x.shape[:2]), bool)
    mask[E:] = True
    if cfg.moe.is_sparse(layer):
        logits = x @ hf[f"layers.{layer}.mlp.router"].T
        for idx in np.ndindex(*x.shape[:2]):
            mask[(np.argsort(-logits[idx], kind="stable")[:k], *idx)] = True  # softmax keeps the order
    return mask


def block_hidden(g, u, x):
    """A block's SiLU(x gᵀ) ⊙ (x uᵀ) with g, u [f, d] (HF layout): [..., f]."""
    a, b = x @ g.T, x @ u.T
    return a / (1 + np.exp(-a)) * b


def per_block(model, hf, x_layers, fn):
    """fn(gate, up, down, x [B, T, d], mask [B, T] of the block's tokens) for every block, with
    x_layers [L, B, T, d] the MLP inputs -> {(layer, slot): value}."""
    out = {}
    for layer, x in enumerate(x_layers):
        routed = routed_tokens(model, hf, layer, x)
        for slot, ffn in enumerate(slot_ffns(model, hf, layer)):
            if ffn is not None:
                out[layer, slot] = fn(*ffn, x, routed[slot])
    return out
