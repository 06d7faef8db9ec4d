"""Calibrated KV projections for the layers Prefill-Only Pruning skips (docs/methods.md §8).

A layer l skipped in prefill writes keys/values projected from its *input* residual stream
``x_skip`` (the last kept layer's output, passed through), which never received the skipped
layers' updates: its K/V drift from the full model's (``popjax.eval.kv_drift`` measures how far).
Replacement projections ``W_k'``, ``W_v'`` of the same shapes, fitted so that
``norm_l(x_skip) W'ᵀ ≈ norm_l(x_full_l) Wᵀ`` (the full model's pre-RoPE keys and values), cost
nothing extra at inference: the skipped layer still runs one [2·kv_dim, d] projection.

Two fits, both starting from / pulled toward the original ``W`` (rows k then v of ``qkv``; with a
qkv bias, the bias is fitted too, as an extra input column of ones):

* ``method="closed_form"`` — ridge least squares toward the original weights over the valid
  calibration tokens (Z = norm_l(x_skip), Y = the full model's K|V)::

      W' = argmin ‖Z W'ᵀ − Y‖² + λ·s·‖W' − W‖²,   s = tr(ZᵀZ)/d
         = (ZᵀZ + λ s I)⁻¹ (ZᵀY + λ s Wᵀ)          (transposed)

  ``λ = ridge`` is relative to the mean eigenvalue ``s`` of ZᵀZ, so it does not depend on the
  number of tokens or the activations' scale. With λ > 0 the problem is well posed for any
  number of tokens; with λ = 0 it needs at least d (+1 with a bias) tokens. When the skipped
  layers are identity maps, Z = the full model's normalised input and W' = W exactly. Only the
  sums ZᵀZ, ZᵀX̂, X̂ᵀX̂ (X̂ = norm_l(x_full_l), so ZᵀY = ZᵀX̂ Wᵀ) are accumulated, batch by
  batch, in float64 on the host; the solve runs in float64 NumPy.
* ``method="optax"`` — ``kv_training``: AdamW on the skipped layer's attention output
  (after ``o``) for later, decode-time queries, weight decay pulling toward ``W``.

The fitted projections are the method's calibrated data: ``PrefillOnly(kv="calibrated")``
fits them in ``prepare`` (``calibrate.calibrate_kv``, cached by ``kv_store``) and passes them,
as `kv_weights` [n_kv, 2, h, d] in qkv's grouped layout, into the compiled prefill beside the
params; the model's schedule projects the skipped layers' K/V with them::

    popjax.generate(model, prompt, method=popjax.PrefillOnly(skip=0.5, kv="calibrated"))
    cal = calibrate_kv(model, skip=0.5, prompts=my_texts)   # or fit on your own corpus
    popjax.generate(model, prompt, method=popjax.PrefillOnly(skip=0.5, kv="calibrated", kv_calibration=cal))

Decode always uses the original weights.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ... import distributed
from ...calibration import DEFAULT_TOKENS, DEFAULT_WINDOW, Corpus, default_corpus, model_fingerprint
from ...engine import positions_from_mask
from ...loaded import LoadedModel
from ..base import MethodError
from ..dense import Dense
from .skip import check_skip, skipped_layers
from ...models.layers import group_kv
from ...models.rope import layer_rope

log = logging.getLogger(__name__)

METHODS = ("closed_form", "optax")
DEFAULT_RIDGE = 1e-2
DEFAULT_BATCH = 8
HIGHEST = jax.lax.Precision.HIGHEST


class KVCalibrationError(MethodError):
    """Unusable calibration input or file (names the bad value and what is valid)."""


@dataclasses.dataclass(frozen=True, eq=False)
class KVCalibration:
    """Fitted projections for one model and skip set.

    ``weights[l]`` [2·kv_dim, d] float32 (k rows, then v rows) and, for models with a qkv bias,
    ``biases[l]`` [2·kv_dim] per skipped layer l. ``key``: what they were fitted for (model
    fingerprint, skip set, layer count, corpus, method, ridge, settings); ``fit``: diagnostics
    (closed form: relative squared K/V error before/after per layer; optax: the loss history)."""

    skip: tuple[int, ...]
    weights: dict[int, np.ndarray]
    biases: dict[int, np.ndarray]
    key: dict[str, Any]
    fit: dict[str, Any]


# ---------------------------------------------------------------- arguments


def resolve_skip(skip, n_layers: int) -> tuple[int, ...]:
    """Anything ``PrefillOnly(skip=...)`` accepts -> the sorted layer tuple."""
    skip = check_skip(skip)
    layers = skipped_layers(skip, n_layers)
    if not layers:
        raise KVCalibrationError(f"skip={skip!r} skips no layer of this {n_layers}-layer model: nothing to calibrate")
    return layers


def check_ridge(ridge: float) -> float:
    if isinstance(ridge, bool) or not isinstance(ridge, (int, float)) or not np.isfinite(ridge):
        raise KVCalibrationError(f"ridge={ridge!r} is not a finite number; use ridge ≥ 0 (0 = plain least squares)")
    if ridge < 0:
        raise KVCalibrationError(f"ridge={ridge!r} is negative; use ridge ≥ 0 (0 = plain least squares)")
    return float(ridge)


def calibration_corpus(model: LoadedModel, prompts=None, tokens: int | None = None, window: int = DEFAULT_WINDOW) -> Corpus:
    """The calibration windows [n, window]: a `Corpus` as given; texts or token-id lists
    concatenated and cut into windows; None = the Shakespeare corpus (``popjax.calibration``:
    every play but the held-out and dev plays) of ``tokens`` (default 16384) tokens."""
    if prompts is None:
        return default_corpus(model, tokens or DEFAULT_TOKENS, window)
    if isinstance(prompts, Corpus):
        return prompts
    prompts = list(prompts)
    if prompts and all(isinstance(p, str) for p in prompts):
        if model.tokenizer is None:
            raise KVCalibrationError("text prompts need the model's tokenizer; this model has none: pass token ids")
        ids = [i for p in prompts for i in model.tokenizer(p, add_special_tokens=False)["input_ids"]]
    else:
        ids = [int(i) for p in prompts for i in p]
    return Corpus.from_token_ids("prompts", ids, tokens, window)


def window_batches(corpus: Corpus, batch_size: int):
    """(tokens, valid) [B, window] per batch of windows, in order (windows are unpadded)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise KVCalibrationError(f"batch_size={batch_size!r} is invalid; use an integer ≥ 1")
    for start in range(0, len(corpus.windows), batch_size):
        tokens = jnp.asarray(corpus.windows[start : start + batch_size])
        yield tokens, jnp.ones(tokens.shape, bool)


# ---------------------------------------------------------------- the two residual streams


def layer_streams(model, tokens: jax.Array, valid: jax.Array, skip: tuple[int, ...]):
    """Runs the dense model twice in one pass (inside jit; ``model`` is the merged Transformer):
    the full model and prefill-only (layers in ``skip`` pass x through). -> (x_skip, x_full,
    angles): lists over ``skip`` of layer l's input residual stream [B, T, d] under each, and of
    l's rotary angles (cos, sin) [B, T, h]. Layers before the first skipped one are shared;
    nothing after the last is computed.

    Each layer gets the angles of its attention kind (`models.rope.layer_rope`, as the model's
    own forward does): a Gemma 3 sliding-window layer rotates with its local base, a full layer
    with the global base and scaling; one set of angles for every layer would run the sliding
    layers with the global ones, and both streams, the targets and the fit would be off."""
    cfg = model.cfg
    rope = layer_rope(cfg, positions_from_mask(valid.astype(jnp.int32)))
    angles = lambda i: rope[cfg.layer_type(i)]
    plan = Dense().bind(cfg)
    mlp = lambda w, _state, h, rows: plan.prefill(w, h, rows)  # rows: ``valid`` (a MoE expert's: its tokens)
    run = lambda i, x: model.layers[i](x, *angles(i), valid, None, mlp, None, valid, i)[0]
    x_full = model.embed_tokens(tokens)
    x_skip = x_full
    inputs_skip, inputs_full = [], []
    for i in range(max(skip) + 1):
        if i in skip:
            inputs_skip.append(x_skip)
            inputs_full.append(x_full)
        nxt = run(i, x_full)
        if i not in skip:
            x_skip = nxt if x_skip is x_full else run(i, x_skip)
        x_full = nxt
    return inputs_skip, inputs_full, [angles(l) for l in skip]


def _features(x: jax.Array, valid: jax.Array, with_bias: bool) -> jax.Array:
    """[B, T, d] -> fp32 [B·T, d (+1)] with invalid tokens zeroed (the bias column is 1 on valid tokens)."""
    v = valid.reshape(-1, 1).astype(jnp.float32)
    f = x.reshape(-1, x.shape[-1]).astype(jnp.float32) * v
    return jnp.concatenate([f, v], axis=1) if with_bias else f


@functools.partial(jax.jit, static_argnames=("graphdef", "skip"))
def _normal_sums(graphdef, params, tokens, valid, skip):
    """-> ZᵀZ, ZᵀX̂, X̂ᵀX̂ [n_skip, d', d'] fp32 and Σ valid, for the batch."""
    model = nnx.merge(graphdef, params)
    xs, xf, _ = layer_streams(model, tokens, valid, skip)
    bias = model.cfg.qkv_bias
    sums = {"zz": [], "zx": [], "xx": []}
    for l, s, f in zip(skip, xs, xf):
        norm = model.layers[l].attn_norm
        z, x = _features(norm(s), valid, bias), _features(norm(f), valid, bias)
        sums["zz"].append(jnp.matmul(z.T, z, precision=HIGHEST))
        sums["zx"].append(jnp.matmul(z.T, x, precision=HIGHEST))
        sums["xx"].append(jnp.matmul(x.T, x, precision=HIGHEST))
    return {k: jnp.stack(v) for k, v in sums.items()}, jnp.sum(valid)


def original_kv(model: LoadedModel, skip: tuple[int, ...]) -> dict[int, np.ndarray]:
    """Per layer the original [2·kv_dim, d (+1)] float64 projection (the bias as last column)."""
    module = nnx.merge(model.graphdef, model.params)
    cfg, out = model.config, {}
    for l in skip:
        rows, bias = module.layers[l].attn.kv_rows()
        w = np.asarray(rows, np.float64)
        if cfg.qkv_bias:
            w = np.concatenate([w, np.asarray(bias, np.float64)[:, None]], axis=1)
        out[l] = w
    return out


# ---------------------------------------------------------------- the closed form


def ridge_solve(zz: np.ndarray, zx: np.ndarray, xx: np.ndarray, w: np.ndarray, ridge: float, n_tokens: int,
                d: int, kv_dim: int) -> tuple[np.ndarray, dict[str, float]]:
    """The closed form for one layer, float64. zz = ZᵀZ, zx = ZᵀX̂, xx = X̂ᵀX̂ [d', d'] (d' = d or
    d + 1 with a bias column), w = the original [2·kv_dim, d'] -> (W' [2·kv_dim, d'], relative
    squared K and V errors on the calibration tokens before (W) and after (W'))."""
    unknowns = zz.shape[0]
    if ridge == 0 and n_tokens < unknowns:
        extra = " + 1 bias column" if unknowns > d else ""
        raise KVCalibrationError(
            f"ridge=0 with {n_tokens} calibration tokens: fewer than the {unknowns} unknowns per output "
            f"(hidden size {d}{extra}), so plain least squares is underdetermined; use ridge > 0 "
            f"(e.g. {DEFAULT_RIDGE}) or at least {unknowns} tokens"
        )
    zy = zx @ w.T  # ZᵀY, Y = X̂ Wᵀ: [d', 2·kv_dim]
    scale = np.trace(zz[:d, :d]) / d
    lhs = zz + ridge * scale * np.eye(unknowns)
    if ridge == 0 and np.linalg.matrix_rank(lhs) < unknowns:
        raise KVCalibrationError(
            f"ridge=0: the {n_tokens} calibration tokens span only {np.linalg.matrix_rank(lhs)} of the {unknowns} "
            "input dimensions (ZᵀZ is singular); use ridge > 0 or more varied text"
        )
    fitted = np.linalg.solve(lhs, zy + ridge * scale * w.T).T
    yy = np.diag(w @ xx @ w.T)  # ‖Y[:, o]‖² per output

    def rel_err(m: np.ndarray, rows: slice) -> float:
        err = np.diag(m @ zz @ m.T) - 2 * np.einsum("od,do->o", m, zy) + yy
        return float(np.maximum(err[rows], 0).sum() / max(yy[rows].sum(), 1e-30))

    k, v = slice(0, kv_dim), slice(kv_dim, 2 * kv_dim)
    fit = {"k_err_before": rel_err(w, k), "v_err_before": rel_err(w, v),
           "k_err_after": rel_err(fitted, k), "v_err_after": rel_err(fitted, v)}
    return fitted, fit


def fit_closed_form(model: LoadedModel, skip: tuple[int, ...], corpus: Corpus, ridge: float, batch_size: int = DEFAULT_BATCH):
    """-> (weights {l: [2·kv_dim, d']} float64, fit diagnostics): sums streamed batch by batch."""
    totals, n_tokens = None, 0
    for tokens, valid in window_batches(corpus, batch_size):
        sums, count = _normal_sums(model.graphdef, model.params, tokens, valid, skip)
        sums = {k: np.asarray(v, np.float64) for k, v in distributed.to_host(sums).items()}
        totals = sums if totals is None else {k: totals[k] + sums[k] for k in totals}
        n_tokens += int(count)
    cfg, originals = model.config, original_kv(model, skip)
    weights, fit = {}, {"tokens": n_tokens, "layers": {}}
    for i, l in enumerate(skip):
        weights[l], fit["layers"][str(l)] = ridge_solve(
            totals["zz"][i], totals["zx"][i], totals["xx"][i], originals[l], ridge, n_tokens, cfg.hidden_size, cfg.kv_dim
        )
    return weights, fit


# ---------------------------------------------------------------- entry point and model surgery


def check_calibration(calibration: KVCalibration, model: LoadedModel, skipped: tuple[int, ...]) -> None:
    """Refuses a calibration fitted for another skip set, layer count or model's weights:
    projections map the input of *this* skip set's stream in *this* model, so another's are wrong."""
    if calibration.key.get("n_layers") != model.config.num_hidden_layers:
        raise KVCalibrationError(
            f"the calibration is for a {calibration.key.get('n_layers')}-layer model; this one has {model.config.num_hidden_layers}"
        )
    if tuple(calibration.skip) != tuple(skipped):
        raise KVCalibrationError(
            f"the calibration was fitted for skipped layers {list(calibration.skip)}, but this method skips "
            f"{list(skipped)}; calibrate for this skip set (calibrate_kv(model, skip=...))"
        )
    if calibration.key.get("model") != model_fingerprint(model):
        raise KVCalibrationError(
            f"the calibration was fitted for model {str(calibration.key.get('model'))[:16]}…, not this one "
            f"({model_fingerprint(model)[:16]}…); run calibrate_kv on this model"
        )


def kv_weights(calibration: KVCalibration, model: LoadedModel) -> dict[int, tuple[jax.Array, jax.Array | None]]:
    """The calibration as the model's ``kv_weights``: per skipped layer (w [n_kv, 2, h, d],
    bias [n_kv, 2, h] or None) in qkv's grouped layout and the model's dtype."""
    dtype = jnp.dtype(model.dtype)
    group = lambda a: jnp.asarray(group_kv(a, model.config), dtype)
    return {
        l: (group(calibration.weights[l]), group(calibration.biases[l]) if model.config.qkv_bias else None)
        for l in calibration.skip
    }


__all__ = [
    "DEFAULT_RIDGE",
    "KVCalibration",
    "KVCalibrationError",
    "METHODS",
    "calibration_corpus",
    "layer_streams",
    "resolve_skip",
    "ridge_solve",
    "window_batches",
    "check_calibration",
    "kv_weights",
]
