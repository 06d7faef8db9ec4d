"""The NumPy side of the method tests: plain, loop-friendly float64 references of the FFN math
and the random layers and batches they are compared on (docs/methods.md §0: W_g, W_u [d, f],
W_d [f, d] in math layout; popjax stores gate/up stacked [2, f, d] and down [d, f]).

The gated FFN is H = act(x W_g) ⊙ (x W_u) with the model's gate activation: SiLU (SwiGLU: LLaMA,
Qwen) or tanh-GELU (GeGLU: Gemma), by the names of ``models.config.FFN_ACTIVATIONS``. A layer W
may carry its activation's name as ``W["act"]`` (SiLU when absent), so every reference built on
`ref_hidden` follows the layer it is given; an explicit ``act`` argument overrides it."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from popjax.models.interface import FFNWeights


def silu(x):
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x):
    """GELU in its tanh approximation (HF "gelu_pytorch_tanh", Gemma's gate activation):
    0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))."""
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


# models.config.FFN_ACTIVATIONS -> the NumPy function
ACTIVATIONS = {"silu": silu, "gelu_pytorch_tanh": gelu_tanh}


def gate_act(W, act: str | None = None):
    """The gate activation function: ``act`` when given, else the layer's ``W["act"]``, else SiLU."""
    return ACTIVATIONS[act or W.get("act", "silu")]


def ref_gate(W, x, act: str | None = None):
    """x [..., d] -> act(x W_g) [..., f] (the gate activations CATS thresholds), in float64."""
    return gate_act(W, act)(x @ W["gate"])


def ref_hidden(W, x, act: str | None = None):
    """x [..., d] -> H = act(x W_g) ⊙ (x W_u) [..., f], in float64 (act: see `gate_act`)."""
    return ref_gate(W, x, act) * (x @ W["up"])


def ref_down_norms(W):
    """‖W_d[:, j]‖₂ per channel j: [f]."""
    return np.array([math.sqrt(sum(v * v for v in row)) for row in W["down"]])


def ref_rank(scores):
    """Indices by decreasing score, ties to the lower index."""
    return sorted(range(len(scores)), key=lambda j: (-scores[j], j))


def ref_top_k(scores, k):
    """The k entries of largest score (ties: the lower index) as a set."""
    return set(ref_rank(list(scores))[:k])


def ref_sizes(f: int, n_keep: int, gamma: float) -> tuple[int, int, int]:
    """POP's (n_R, n_C, m) as in docs/methods.md §2."""
    m = min(int(math.floor(gamma * f / 2 + 0.5)), f - n_keep, n_keep)
    return n_keep - m, 2 * m, m


def random_layer(rng, d, f, act: str = "silu"):
    """Gate/up/down of one FFN in math layout, down rows scaled so channel norms differ; ``act``
    (the gate activation's name) is kept as ``W["act"]``."""
    return {
        "gate": rng.normal(0, 0.3, (d, f)),
        "up": rng.normal(0, 0.3, (d, f)),
        "down": rng.normal(0, 0.05, (f, d)) * rng.uniform(0.2, 2.0, (f, 1)),  # outputs O(1)
        "act": act,
    }


def as_jax(W, layer: int = 0, act: str | None = None, data=None) -> FFNWeights:
    """Math layout -> the `FFNWeights` a plan receives: gate_up [2, f, d], down [d, f], down_norm
    [f], the layer index, the gate activation's name (``act`` or ``W["act"]``, default SiLU) and
    the method's calibrated ``data``."""
    down = np.asarray(W["down"], np.float32)
    return FFNWeights(
        gate_up=jnp.asarray(np.stack([W["gate"].T, W["up"].T]), jnp.float32),
        down=jnp.asarray(down.T),
        down_norm=jnp.asarray(np.sqrt((down.astype(np.float64) ** 2).sum(1)), jnp.float32),
        layer=jnp.int32(layer),
        data=data,
        act=act or W.get("act", "silu"),
    )


def random_batch(rng, d, lengths, T, scale=None, varied_norms: bool = False):
    """Left-padded X [B, T, d] and valid [B, T]; ``scale`` (or, with ``varied_norms``, a random
    per-token scale) multiplies the tokens. Padding is huge, so a statistic that lets it in fails."""
    X = rng.normal(0, 1.0, (len(lengths), T, d))
    if scale is not None:
        X = X * scale
    elif varied_norms:
        X = X * rng.uniform(0.3, 2.0, (len(lengths), T, 1))
    valid = np.zeros((len(lengths), T), bool)
    for b, n in enumerate(lengths):
        valid[b, T - n :] = True  # left padding
    X[~valid] = rng.normal(0, 50.0, (int((~valid).sum()), d))  # padding must not leak into statistics
    return X, valid


def ref_quantize(w):
    """Symmetric int8 per output row of w [out, in] (float64 loops): -> (q int8, scale [out])."""
    q, scale = np.zeros(w.shape, np.int8), np.zeros(w.shape[0])
    for o, row in enumerate(np.asarray(w, np.float64)):
        amax = max(abs(float(v)) for v in row)
        scale[o] = amax / 127 if amax > 0 else 1.0
        q[o] = [max(-127, min(127, int(np.rint(v / scale[o])))) for v in row]
    return q, scale


def int8_layer(W):
    """Math-layout W -> (the layer dict of an int8 model: gate_up / down as `Int8Weight`s,
    down_norm of the dequantized down; the dequantized W in math layout, float64)."""
    from popjax.kernels.int8 import Int8Weight

    gate_up = np.concatenate([W["gate"].T, W["up"].T])  # [2f, d]: a scale per output row
    q_gu, s_gu = ref_quantize(gate_up)
    q_d, s_d = ref_quantize(W["down"].T)  # [d, f]
    f = W["gate"].shape[1]
    deq_gu = q_gu * s_gu[:, None]
    deq_d = q_d * s_d[:, None]
    W_deq = {"gate": deq_gu[:f].T, "up": deq_gu[f:].T, "down": deq_d.T, "act": W.get("act", "silu")}
    layer = FFNWeights(
        gate_up=Int8Weight(jnp.asarray(q_gu.reshape(2, f, -1)), jnp.asarray(s_gu.reshape(2, f, 1), jnp.float32)),
        down=Int8Weight(jnp.asarray(q_d), jnp.asarray(s_d[:, None], jnp.float32)),
        down_norm=jnp.asarray(np.sqrt((deq_d ** 2).sum(0)), jnp.float32),
        layer=jnp.int32(0),
        act=W_deq["act"],
    )
    return layer, W_deq
