"""How far the skipped layers' prefill drifts from the full model (Prefill-Only Pruning's appendix
A quantities), before and after KV calibration (what ``popjax kv-drift`` reports).

For each skipped layer l, on windows of T tokens split at ``prefix`` P (tokens 0..P−1 are the
prefilled prompt, P..T−1 the later, decode-time tokens), the mean cosine similarity between
prefill-only and the full model of:

* ``hidden``: l's input residual stream (x_skip vs x_full_l) on the prompt tokens;
* ``k``, ``v``: the keys (RoPE'd) and values the layer writes for the prompt tokens
  (``norm_l(x_skip) W`` vs ``norm_l(x_full_l) W``), all heads as one vector per token;
* ``attn``: the attention output (after ``o``) of the later tokens' queries — the full model's
  queries, keys and values for the later tokens, the prompt's keys/values either prefill-only's
  or the full model's — attending as the layer does (its score scale; a sliding-window layer's
  queries see only the prompt keys inside their window).

Every layer rotates with the angles of its attention kind (Gemma 3's sliding layers: their
local base; `kv_calibration.layer_streams`).

With a calibration, ``k_cal``, ``v_cal``, ``attn_cal`` use its projections ``W'`` instead.
Default prompts: windows of the dev play (``popjax.data.DEV_PLAY``), which the calibration
corpus excludes.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..calibration import Corpus
from ..data import DEV_PLAY, HELD_OUT_PLAY, load_play
from ..methods import Dense, PrefillOnly
from ..methods.prefill_only.kv_calibration import KVCalibration, calibration_corpus, layer_streams, resolve_skip, window_batches
from ..methods.prefill_only.kv_training import full_qkv, later_query_output
from ..models.layers import group_kv
from .tasks import NLLSettings, online_nll

QUANTITIES = ("hidden", "k", "v", "attn")


def _cos(a: jax.Array, b: jax.Array) -> jax.Array:
    """Per-token cosine of [B, T, ...] arrays (flattened beyond T) -> [B, T] fp32."""
    a = a.reshape(*a.shape[:2], -1).astype(jnp.float32)
    b = b.reshape(*b.shape[:2], -1).astype(jnp.float32)
    dot = jnp.sum(a * b, axis=-1)
    return dot / jnp.maximum(jnp.linalg.norm(a, axis=-1) * jnp.linalg.norm(b, axis=-1), 1e-30)


@functools.partial(jax.jit, static_argnames=("graphdef", "skip", "prefix"))
def _drift_sums(graphdef, params, tokens, valid, skip, prefix, weights, biases):
    """Sums over valid tokens of each quantity's cosine, per skipped layer -> {name: [n]}, counts.
    ``weights`` [n, 2·kv_dim, d] (biases [n, 2·kv_dim]) are a calibration's, or None."""
    model = nnx.merge(graphdef, params)
    xs, xf, angles = layer_streams(model, tokens, valid, skip)
    early, late = valid[:, :prefix].astype(jnp.float32), valid[:, prefix:].astype(jnp.float32)
    sums: dict[str, list] = {}
    add = lambda name, c, m: sums.setdefault(name, []).append(jnp.sum(c * m))
    for i, (l, s, f, (cos, sin)) in enumerate(zip(skip, xs, xf, angles)):  # each layer's kind's angles
        layer, window = model.layers[l], model.cfg.window(l)
        pc, ps = cos[:, :prefix], sin[:, :prefix]
        q, k, v = full_qkv(layer.attn, layer.attn_norm(f), cos, sin)
        target = later_query_output(layer.attn, q[:, prefix:], k, v, valid, window)
        zs = layer.attn_norm(s)[:, :prefix]
        variants = {"": {}}
        if weights is not None:
            variants["_cal"] = {"weights": group_kv(weights[i], model.cfg),
                                "bias": None if biases is None else group_kv(biases[i], model.cfg)}
        add("hidden", _cos(s[:, :prefix], f[:, :prefix]), early)
        for suffix, options in variants.items():
            kv = layer.attn.project_kv(zs, pc, ps, **options)
            add("k" + suffix, _cos(kv.k, k[:, :prefix]), early)
            add("v" + suffix, _cos(kv.v, v[:, :prefix]), early)
            keys = jnp.concatenate([kv.k, k[:, prefix:]], axis=1)
            values = jnp.concatenate([kv.v, v[:, prefix:]], axis=1)
            add("attn" + suffix, _cos(later_query_output(layer.attn, q[:, prefix:], keys, values, valid, window), target), late)
    return {name: jnp.stack(vals) for name, vals in sums.items()}, jnp.sum(early), jnp.sum(late)


def drift_windows(model, windows: int = 8, window: int = 256) -> np.ndarray:
    """``windows`` windows of ``window`` tokens at evenly spaced offsets of the dev play."""
    ids = model.tokenizer(load_play(DEV_PLAY), add_special_tokens=False)["input_ids"]
    starts = np.linspace(0, len(ids) - window, windows).astype(int)
    return np.array([ids[a : a + window] for a in starts], np.int32)


def kv_drift(model, skip, prompts=None, calibration: KVCalibration | None = None, *, windows: int = 8,
             window: int = 256, prefix: int | None = None, batch_size: int = 8) -> dict[str, Any]:
    """The drift report for one skip set -> {"skip", "tokens", "later_tokens", and per quantity a
    list over the skipped layers of mean cosines}: see the module docstring.

    Args:
      prompts: a `Corpus`, texts or token-id lists (cut into windows), or None = dev-play windows.
      calibration: also report ``k_cal``, ``v_cal``, ``attn_cal`` (must be for this skip set).
      prefix: prompt part of each window (default window // 2).
    """
    skip = resolve_skip(skip, model.config.num_hidden_layers)
    corpus = (Corpus("dev", drift_windows(model, windows, window)) if prompts is None
              else calibration_corpus(model, prompts, None, window))
    prefix = corpus.window // 2 if prefix is None else prefix
    if not 1 <= prefix < corpus.window:
        raise ValueError(f"prefix={prefix} is invalid for windows of {corpus.window} tokens; use 1 ≤ prefix < {corpus.window}")
    weights = biases = None
    if calibration is not None:
        if tuple(calibration.skip) != skip:
            raise ValueError(f"the calibration is for skipped layers {list(calibration.skip)}, not {list(skip)}")
        weights = jnp.stack([jnp.asarray(calibration.weights[l]) for l in skip])
        if calibration.biases:
            biases = jnp.stack([jnp.asarray(calibration.biases[l]) for l in skip])
    totals, n_early, n_late = None, 0.0, 0.0
    for tokens, valid in window_batches(corpus, batch_size):
        sums, early, late = _drift_sums(model.graphdef, model.params, tokens, valid, skip, prefix, weights, biases)
        sums = {k: np.asarray(v, np.float64) for k, v in jax.device_get(sums).items()}
        totals = sums if totals is None else {k: totals[k] + sums[k] for k in totals}
        n_early, n_late = n_early + float(early), n_late + float(late)
    report = {"skip": list(skip), "tokens": int(n_early), "later_tokens": int(n_late), "prefix": prefix, "window": corpus.window}
    for name, total in totals.items():
        report[name] = (total / (n_late if name.startswith("attn") else n_early)).tolist()
    return report


def format_drift(report: dict[str, Any]) -> str:
    """A table: one row per skipped layer, one column per quantity (calibrated as ``k'``)."""
    names = [n for n in ("hidden", "k", "v", "attn", "k_cal", "v_cal", "attn_cal") if n in report]
    header = "layer " + " ".join(f"{n.replace('_cal', chr(39)):>8}" for n in names)
    rows = [header] + [
        f"{l:>5} " + " ".join(f"{report[n][i]:8.4f}" for n in names) for i, l in enumerate(report["skip"])
    ]
    return "\n".join(rows)


def plot_drift(reports: list[dict[str, Any]], path: str | Path, title: str = "") -> None:
    """One panel per skip set: each quantity's cosine by layer; dashed = calibrated."""
    import matplotlib  # optional: matplotlib (popjax[eval]), only for the plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: matplotlib (popjax[eval])

    fig, axes = plt.subplots(1, len(reports), figsize=(6 * len(reports), 4), squeeze=False)
    colors = dict(zip(QUANTITIES, ("tab:gray", "tab:blue", "tab:orange", "tab:green")))
    for ax, report in zip(axes[0], reports):
        for name in QUANTITIES:
            ax.plot(report["skip"], report[name], "o-", color=colors[name], label=name)
            if name + "_cal" in report:
                ax.plot(report["skip"], report[name + "_cal"], "s--", color=colors[name], label=f"{name} (calibrated)")
        ax.set_title(f"{len(report['skip'])} layers skipped ({report['skip'][0]}–{report['skip'][-1]})")
        ax.set_xlabel("skipped layer")
        ax.set_ylabel("cosine similarity to the full model")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def prefill_nll(model, skip, calibration: KVCalibration | None, windows: int, dense: float | None = None) -> dict[str, float]:
    """Online NLL on the held-out play of dense (``dense`` when already measured), prefill-only
    with independent K/V projections and, with a ``calibration``, with the calibrated ones; plus
    ``gap_recovered``: the share of the independent projection's NLL gap the calibration closes."""
    text, s = load_play(HELD_OUT_PLAY), NLLSettings(windows=windows)
    out = {"dense": dense if dense is not None else online_nll(model, Dense(), text, s)["nll"]}
    out["independent"] = online_nll(model, PrefillOnly(skip=skip), text, s)["nll"]
    if calibration is not None:
        calibrated = PrefillOnly(skip=skip, kv="calibrated", kv_calibration=calibration)
        out["calibrated"] = online_nll(model, calibrated, text, s)["nll"]
        gap = out["independent"] - out["dense"]
        out["gap_recovered"] = (out["independent"] - out["calibrated"]) / gap if gap > 0 else float("nan")
    return out


__all__ = ["QUANTITIES", "drift_windows", "format_drift", "kv_drift", "plot_drift", "prefill_nll"]
