"""The optax variant of the calibrated KV projections (``calibrate_kv(method="optax")``).

The closed form (``popjax.methods.prefill_only.kv_calibration``) matches K and V themselves; what matters downstream
is the skipped layer's attention output for the tokens *after* the prompt, whose queries attend
over the prefilled keys/values. So each calibration window of T tokens is split at ``prefix``:

* prefix tokens 0..P−1 play the prompt: their keys/values are projected with ``W' = W + Δ`` from
  the prefill-only input ``norm_l(x_skip)``;
* tokens P..T−1 play the decoded tokens: the full model's queries, keys and values;
* the loss, per skipped layer, is the relative squared error of the attention output (after
  the output projection ``o``) of the later queries against the full model's (whose prefix
  keys/values come from ``norm_l(x_full_l) W``), averaged over the skipped layers.

AdamW trains ``Δ`` (initialised at 0, so ``W'`` starts at ``W``) for a fixed number of steps,
cycling over the calibration batches; its decoupled weight decay pulls ``Δ`` toward 0, i.e.
``W'`` toward the original weights, like the closed form's ridge. The inputs of every skipped
layer are computed once per batch and kept (``tokens`` × (d + ...) floats per layer), so the
default uses fewer tokens than the closed form.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ...calibration import Corpus
from .kv_calibration import KVCalibrationError, window_batches, layer_streams, original_kv
from ...kernels.attention import MASKED, in_window
from ...models.layers import group_kv
from ...kernels.int8 import dequantized

DEFAULT_TOKENS = 4096
DEFAULT_STEPS = 100
DEFAULT_LR = 3e-4
DEFAULT_WEIGHT_DECAY = 0.1


def settings(window: int, steps: int = DEFAULT_STEPS, learning_rate: float = DEFAULT_LR,
             weight_decay: float = DEFAULT_WEIGHT_DECAY, prefix: int | None = None) -> dict[str, Any]:
    """Validated optax settings (part of the cache key); ``prefix`` defaults to window // 2."""
    prefix = window // 2 if prefix is None else prefix
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise KVCalibrationError(f"steps={steps!r} is invalid; use an integer ≥ 1")
    if isinstance(learning_rate, bool) or not isinstance(learning_rate, (int, float)) or not learning_rate > 0:
        raise KVCalibrationError(f"learning_rate={learning_rate!r} is invalid; use a number > 0")
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) or not weight_decay >= 0:
        raise KVCalibrationError(f"weight_decay={weight_decay!r} is invalid; use a number ≥ 0")
    if isinstance(prefix, bool) or not isinstance(prefix, int) or not 1 <= prefix < window:
        raise KVCalibrationError(f"prefix={prefix!r} is invalid for windows of {window} tokens; use 1 ≤ prefix < {window}")
    return {"steps": steps, "learning_rate": float(learning_rate), "weight_decay": float(weight_decay), "prefix": prefix}


def full_qkv(attn, xn: jax.Array, cos: jax.Array, sin: jax.Array):
    """The layer's queries, keys (RoPE'd, qk-normed) and values from normalised input xn [B, T, d]
    (cos, sin: the angles of the layer's kind): the attention's own projection."""
    return attn.rotated_qkv(xn, cos, sin)


def later_query_output(attn, q: jax.Array, k: jax.Array, v: jax.Array, key_valid: jax.Array, window: int | None = None) -> jax.Array:
    """Queries q [B, Q, n_q, h] of the last Q of T tokens attend causally to k, v [B, T, n_kv, h]
    (valid keys [B, T]) -> the attention output after ``o``, fp32 [B, Q, d]. As the layer
    attends: scores scaled by its ``attn.scale`` (Gemma's query_pre_attn_scalar^-½, else h^-½)
    and, for a sliding-window layer (``window``: `ModelConfig.window` of the layer), only keys
    less than ``window`` positions back."""
    B, Q, n_q, h = q.shape
    T, n_kv = k.shape[1], k.shape[2]
    qg = q.reshape(B, Q, n_kv, n_q // n_kv, h)
    scores = jnp.einsum("bqkgh,bskh->bkgqs", qg, k, preferred_element_type=jnp.float32) * attn.scale
    allowed = in_window((T - Q + jnp.arange(Q))[:, None], jnp.arange(T)[None, :], window)  # [Q, T]
    scores = jnp.where(allowed[None, None, None] & key_valid[:, None, None, None, :], scores, MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgqs,bskh->bqkgh", probs, v.astype(jnp.float32)).reshape(B, Q, n_q * h)
    return jnp.einsum("bqi,oi->bqo", out, dequantized(attn.weight("o")).astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("graphdef", "skip", "prefix"))
def _attention_data(graphdef, params, tokens, valid, skip, prefix):
    """Per skipped layer (stacked [n, ...]): z (prefix inputs, prefill-only), the later tokens'
    full q, k, v, and the target attention output [n, B, Q, d] (full model everywhere)."""
    model = nnx.merge(graphdef, params)
    xs, xf, angles = layer_streams(model, tokens, valid, skip)
    out = {"z": [], "q": [], "k": [], "v": [], "target": [], "cos": [], "sin": []}
    for l, s, f, (cos, sin) in zip(skip, xs, xf, angles):
        layer = model.layers[l]
        q, k, v = full_qkv(layer.attn, layer.attn_norm(f), cos, sin)
        out["target"].append(later_query_output(layer.attn, q[:, prefix:], k, v, valid, model.cfg.window(l)))
        out["z"].append(layer.attn_norm(s)[:, :prefix])
        out["q"].append(q[:, prefix:])
        out["k"].append(k[:, prefix:])
        out["v"].append(v[:, prefix:])
        out["cos"].append(cos[:, :prefix])  # the prompt keys' angles, of the layer's kind
        out["sin"].append(sin[:, :prefix])
    data = {name: jnp.stack(arrays) for name, arrays in out.items()}
    return {**data, "valid": valid}


def _loss(delta, graphdef, params, data, skip):
    """Mean over skipped layers of ‖out(W + Δ) − target‖² / ‖target‖² on the later queries."""
    model = nnx.merge(graphdef, params)
    cfg, losses = model.cfg, []
    later_valid = data["valid"][:, data["valid"].shape[1] - data["q"].shape[2] :, None]
    for i, l in enumerate(skip):
        attn = model.layers[l].attn
        rows, bias_rows = attn.kv_rows()
        w = group_kv(rows.astype(jnp.float32) + delta["w"][i], cfg)
        b = group_kv(bias_rows.astype(jnp.float32) + delta["b"][i], cfg) if cfg.qkv_bias else None
        kv = attn.project_kv(data["z"][i].astype(jnp.float32), data["cos"][i], data["sin"][i], weights=w, bias=b)
        k = jnp.concatenate([kv.k, data["k"][i].astype(jnp.float32)], axis=1)
        v = jnp.concatenate([kv.v, data["v"][i].astype(jnp.float32)], axis=1)
        err = (later_query_output(attn, data["q"][i], k, v, data["valid"], cfg.window(l)) - data["target"][i]) * later_valid
        losses.append(jnp.sum(err * err) / jnp.maximum(jnp.sum((data["target"][i] * later_valid) ** 2), 1e-30))
    return jnp.mean(jnp.stack(losses))


@functools.partial(jax.jit, static_argnames=("graphdef", "skip", "learning_rate", "weight_decay"))
def _step(delta, opt_state, graphdef, params, data, skip, learning_rate, weight_decay):
    loss, grads = jax.value_and_grad(_loss)(delta, graphdef, params, data, skip)
    optimizer = optax.adamw(learning_rate, weight_decay=weight_decay)
    updates, opt_state = optimizer.update(grads, opt_state, delta)
    return optax.apply_updates(delta, updates), opt_state, loss


_eval_loss = jax.jit(_loss, static_argnames=("graphdef", "skip"))


def fit_optax(model, skip: tuple[int, ...], corpus: Corpus, *, steps: int = DEFAULT_STEPS, learning_rate: float = DEFAULT_LR,
              weight_decay: float = DEFAULT_WEIGHT_DECAY, prefix: int | None = None, batch_size: int = 8):
    """-> (weights {l: [2·kv_dim, d (+1)]} float64 (bias as last column), fit diagnostics:
    ``loss`` per step (the batch it trained on, before its update; step t uses batch
    t mod n_batches), ``loss_before`` / ``loss_after`` averaged over every batch)."""
    s = settings(corpus.window, steps, learning_rate, weight_decay, prefix)
    data = [_attention_data(model.graphdef, model.params, t, v, skip, s["prefix"]) for t, v in window_batches(corpus, batch_size)]
    cfg, n = model.config, len(skip)
    delta = {"w": jnp.zeros((n, 2 * cfg.kv_dim, cfg.hidden_size), jnp.float32),
             "b": jnp.zeros((n, 2 * cfg.kv_dim) if cfg.qkv_bias else (n, 0), jnp.float32)}
    opt_state = optax.adamw(s["learning_rate"], weight_decay=s["weight_decay"]).init(delta)
    mean_loss = lambda d: float(np.mean([_eval_loss(d, model.graphdef, model.params, b, skip) for b in data]))
    before, history = mean_loss(delta), []
    for t in range(s["steps"]):
        delta, opt_state, loss = _step(delta, opt_state, model.graphdef, model.params, data[t % len(data)], skip,
                                       s["learning_rate"], s["weight_decay"])
        history.append(float(loss))
    originals = original_kv(model, skip)
    weights = {}
    for i, l in enumerate(skip):
        step = np.asarray(delta["w"][i], np.float64)
        if cfg.qkv_bias:
            step = np.concatenate([step, np.asarray(delta["b"][i], np.float64)[:, None]], axis=1)
        weights[l] = originals[l] + step
    fit = {"tokens": corpus.n_tokens, "loss": history, "loss_before": before, "loss_after": mean_loss(delta)}
    return weights, fit


__all__ = ["DEFAULT_TOKENS", "fit_optax", "full_qkv", "later_query_output", "settings"]
