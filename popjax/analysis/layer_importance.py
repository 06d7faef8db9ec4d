"""Virtual-gate layer importance of Prefill-Only Pruning (docs/methods.md §9): which layers matter
in prefill, which in decode.

A scalar gate per layer and per phase multiplies both residual branches of that layer
(``x + g·Attn(x)``, ``y + g·FFN(y)``): ``g_prefill[l]`` on the prompt tokens, ``g_decode[l]`` on the
response tokens. The importance of a gate is the empirical Fisher ``Ĩ_l = E[(∂L/∂g_l)²]`` at
``g = 1``, where ``L`` is the mean cross-entropy of the **response tokens only** and the response
is **sampled from the model itself** (temperature 1) for each calibration prompt.

One forward-backward per batch gives every sample's own gradient: each batch row has its own
gates ``[B, L]`` and rows do not interact, so the gradient of the summed row losses with respect
to row b's gates is exactly ``∂L_b/∂g``; the square is taken per sample before averaging.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from .. import engine
from ..data import HELD_OUT_PLAY, INSTRUCTIONS, humaneval_problems, load_play, play_names
from ..generation import generate_ids
from ..loaded import LoadedModel, unrolled
from ..methods import Dense

log = logging.getLogger(__name__)

DEFAULT_SAMPLES = 200  # as in the paper
DEFAULT_RESPONSE_TOKENS = 32
# Finer than the engine's powers of two (about ×1.5 apart): a forward-backward costs three
# forwards, so padding costs more here; each bucket used compiles once.
LENGTH_BUCKETS = (32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


@dataclasses.dataclass
class LayerImportance:
    """``prefill``, ``decode`` [L]: ``E[(∂L/∂g_l)²]`` over the samples. ``per_sample_*`` [N, L]: the
    raw (signed) gradients ``∂L_i/∂g_l``, when requested."""

    prefill: np.ndarray
    decode: np.ndarray
    n_samples: int
    response_tokens: int
    boundary: bool
    mean_prompt_tokens: float
    mean_response_tokens: float
    sources: dict[str, int] = dataclasses.field(default_factory=dict)
    per_sample_prefill: np.ndarray | None = None
    per_sample_decode: np.ndarray | None = None

    @property
    def n_layers(self) -> int:
        return len(self.prefill)

    def normalised(self) -> tuple[np.ndarray, np.ndarray]:
        """Each phase's importance as shares of its total (each sums to 1)."""
        return self.prefill / self.prefill.sum(), self.decode / self.decode.sum()

    def ranks(self) -> tuple[np.ndarray, np.ndarray]:
        """Per layer, its rank within each phase: 1 = the most important layer."""
        rank = lambda v: np.argsort(np.argsort(-v, kind="stable"), kind="stable") + 1
        return rank(self.prefill), rank(self.decode)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in out.items()}

    def least_important_prefill(self, k: int) -> list[int]:
        """`least_important_prefill_layers` of this result (what ``PrefillOnly.least_important`` asks)."""
        return least_important_prefill_layers(self, k)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LayerImportance":
        fields = {f.name for f in dataclasses.fields(cls)}
        arrays = ("prefill", "decode", "per_sample_prefill", "per_sample_decode")
        return cls(**{k: np.asarray(v) if k in arrays and v is not None else v for k, v in d.items() if k in fields})


def least_important_prefill_layers(result: LayerImportance, k: int) -> list[int]:
    """The ``k`` layers of lowest prefill importance, in layer order (ties go to the lower index).
    ``0 ≤ k < L``: Prefill-Only Pruning cannot skip every layer."""
    L = result.n_layers
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k < L:
        raise ValueError(f"k={k!r} is invalid; use an integer in [0, {L}) (a model of {L} layers)")
    order = np.argsort(result.prefill, kind="stable")
    return sorted(int(i) for i in order[:k])


def qualitative_finding(result: LayerImportance) -> dict[str, Any]:
    """The paper's finding, tested on these numbers: the last ⌊L/3⌋ layers carry a smaller share of
    the prefill importance than of the decode importance."""
    L = result.n_layers
    k = L // 3
    last = list(range(L - k, L))
    share_p, share_d = (float(v[last].sum()) for v in result.normalised())
    least = least_important_prefill_layers(result, k) if k else []
    overlap = len(set(least) & set(last))
    holds = bool(k and share_p < share_d)
    verdict = "holds" if holds else "does not hold"
    statement = (
        f"The paper's finding {verdict} on this model: the last third (layers {last[0]}-{last[-1]}) "
        f"carries {100 * share_p:.1f}% of the prefill importance vs {100 * share_d:.1f}% of the decode "
        f"importance; {overlap} of the {k} least important prefill layers are in the last third."
        if k
        else f"The model has {L} layers: no last third to test."
    )
    return {
        "holds": holds, "last_third": last, "prefill_share_last_third": share_p, "decode_share_last_third": share_d,
        "least_important_prefill": least, "overlap_with_last_third": overlap, "statement": statement,
    }


# ------------------------------------------------------------------ the per-sample gradients


@functools.partial(jax.jit, static_argnames=("graphdef", "plan"))
def gate_gradients(graphdef, params, plan, tokens, mask, is_prompt, targets, loss_mask):
    """Per-row response loss and its gradients w.r.t. the row's own gates, all at ``g = 1``.

    tokens, mask, targets [B, T] int32 (left-padded; ``targets[:, t]`` is the token predicted at
    ``t``); is_prompt [B, T] bool (the tokens gated by ``g_prefill``; the rest by ``g_decode``);
    loss_mask [B, T] float (1 where ``targets`` is a response token) ->
    (loss [B], grad_prefill [B, L], grad_decode [B, L]).
    """
    L, B = len(params["layers"]), tokens.shape[0]

    def row_losses(g_prefill, g_decode):  # [B, L] each
        gates = jnp.where(is_prompt[None], g_prefill.T[:, :, None], g_decode.T[:, :, None])
        logits, _, _, _ = engine.prefill(graphdef, params, tokens, mask, plan, all_logits=True, gates=gates)
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        return (nll * loss_mask).sum(1) / jnp.maximum(loss_mask.sum(1), 1.0)

    ones = jnp.ones((B, L), jnp.float32)
    loss, vjp = jax.vjp(row_losses, ones, ones)
    grad_prefill, grad_decode = vjp(jnp.ones_like(loss))  # rows are independent: per-row grads
    return loss, grad_prefill, grad_decode


def _stop_set(model: LoadedModel) -> set[int]:
    tok_eos = getattr(model.tokenizer, "eos_token_id", None)
    return set(model.config.eos_token_ids) | ({int(tok_eos)} if tok_eos is not None else set())


def _sample_responses(model, prompts, response_tokens, key, batch_size: int = 0) -> list[list[int]]:
    """Temperature-1 samples from the model, cut after the first stop token (kept: the model
    sampled it, so it belongs to the response's likelihood). The batch is filled up to
    ``batch_size`` rows with copies of the first prompt (discarded), so a short last batch does
    not compile the decode loop again."""
    n_real = len(prompts)
    prompts = list(prompts) + [prompts[0]] * max(batch_size - n_real, 0)
    out, _ = generate_ids(model, prompts, response_tokens, temperature=1.0, seed=key, ignore_eos=True)
    stops = _stop_set(model)
    responses = []
    for ids in out[:n_real]:
        cut = next((i + 1 for i, t in enumerate(ids) if t in stops), len(ids))
        responses.append(ids[:cut])
    return responses


def check_counts(**counts: int) -> None:
    """Each named value must be an integer ≥ 1 (``samples=0`` is the usual mistake)."""
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is invalid; the layer importance analysis needs an integer ≥ 1")


def length_bucket(n: int) -> int:
    return engine.bucket_for(n, LENGTH_BUCKETS, "a prompt+response length")


def batch_arrays(prompts, responses, batch_size: int, boundary: bool, length: int | None = None) -> dict[str, np.ndarray]:
    """Left-padded ``gate_gradients`` inputs [batch_size, T] for prompt+response rows, T = ``length``
    or the bucket of the longest row; rows past ``len(prompts)`` are empty (no loss, no effect).
    ``boundary`` gates the last prompt token with the decode gates, as Prefill-Only Pruning runs
    it (its first decode step)."""
    T = length or length_bucket(max(len(p) + len(r) for p, r in zip(prompts, responses)))
    dtypes = {"tokens": np.int32, "mask": np.int32, "is_prompt": bool, "targets": np.int32, "loss_mask": np.float32}
    arrays = {name: np.zeros((batch_size, T), dtype) for name, dtype in dtypes.items()}
    for row, (p, r) in enumerate(zip(prompts, responses)):
        seq = list(p) + list(r)
        start = T - len(seq)
        arrays["tokens"][row, start:] = seq
        arrays["mask"][row, start:] = 1
        arrays["is_prompt"][row, start : start + len(p) - int(boundary)] = True
        arrays["targets"][row, start : T - 1] = seq[1:]
        arrays["loss_mask"][row, T - 1 - len(r) : T - 1] = 1.0  # positions predicting the response
    return arrays


def layer_importance(
    model: LoadedModel,
    samples: Sequence[Sequence[int]],
    response_tokens: int = DEFAULT_RESPONSE_TOKENS,
    batch_size: int = 4,
    seed: int = 0,
    boundary: bool = False,
    keep_per_sample: bool = False,
    progress: bool = True,
    sources: dict[str, int] | None = None,
    sample_batch_size: int = 16,
) -> LayerImportance:
    """Prefill and decode importance [L] of every layer, over token-id calibration prompts.

    For each prompt a response of up to ``response_tokens`` tokens is sampled from the model
    (temperature 1, stopping after EOS; ``sample_batch_size`` prompts at a time, since decoding is
    memory-bound); then one forward-backward over prompt+response gives ``∂L/∂g_prefill`` and
    ``∂L/∂g_decode``. Samples are grouped by the bucket of ``len(prompt) + response_tokens`` and
    run ``batch_size`` rows at a time, so ``gate_gradients`` compiles once per bucket.

    A scanned model (``scan_layers=True``) is analysed through its unrolled view
    (`popjax.loaded.unrolled`): the gates are per layer, which a scan does not run.
    """
    model = unrolled(model)
    samples = [list(s) for s in samples]
    check_counts(
        samples=len(samples), response_tokens=response_tokens, batch_size=batch_size, sample_batch_size=sample_batch_size
    )
    plan = Dense().bind(model.config)
    L = model.config.num_hidden_layers
    bucket = lambda i: length_bucket(len(samples[i]) + response_tokens)
    groups: dict[int, list[int]] = {}
    for i in sorted(range(len(samples)), key=lambda i: (bucket(i), i)):
        groups.setdefault(bucket(i), []).append(i)
    sample_batch = -(-sample_batch_size // batch_size) * batch_size  # whole forward-backward batches
    grads_p, grads_d = np.zeros((len(samples), L)), np.zeros((len(samples), L))
    response_lengths = np.zeros(len(samples))
    key = jax.random.key(seed)
    with tqdm(total=len(samples), desc="layer importance", unit="sample", disable=not progress) as bar:
        for T, group in groups.items():
            for a in range(0, len(group), sample_batch):
                block = group[a : a + sample_batch]
                responses = _sample_responses(
                    model, [samples[i] for i in block], response_tokens, jax.random.fold_in(key, block[0]), sample_batch
                )
                for c in range(0, len(block), batch_size):
                    idx = block[c : c + batch_size]
                    arrays = batch_arrays([samples[i] for i in idx], responses[c : c + batch_size], batch_size, boundary, T)
                    arrays = {k: jnp.asarray(v) for k, v in arrays.items()}
                    _, gp, gd = gate_gradients(model.graphdef, model.params, plan, **arrays)
                    grads_p[idx], grads_d[idx] = np.asarray(gp)[: len(idx)], np.asarray(gd)[: len(idx)]
                    response_lengths[idx] = [len(r) for r in responses[c : c + batch_size]]
                    bar.update(len(idx))
    return LayerImportance(
        prefill=(grads_p**2).mean(0),
        decode=(grads_d**2).mean(0),
        n_samples=len(samples),
        response_tokens=response_tokens,
        boundary=boundary,
        mean_prompt_tokens=float(np.mean([len(s) for s in samples])),
        mean_response_tokens=float(response_lengths.mean()),
        sources=dict(sources or {"token ids": len(samples)}),
        per_sample_prefill=grads_p if keep_per_sample else None,
        per_sample_decode=grads_d if keep_per_sample else None,
    )


# ------------------------------------------------------------------ calibration text


def calibration_prompts(
    model: LoadedModel, n: int = DEFAULT_SAMPLES, seed: int = 0, max_prompt_tokens: int = 160, excerpt_tokens: int = 128
) -> tuple[list[list[int]], dict[str, int]]:
    """``n`` token-id prompts from real offline text, taken round-robin from three sources until
    each runs out: the chat instructions (through the chat template), HumanEval prompts (raw, the
    last ``max_prompt_tokens`` tokens) and Shakespeare excerpts of ``excerpt_tokens`` tokens from
    every play but the held-out one. -> (prompts, how many came from each source)."""
    check_counts(samples=n)
    tok = model.tokenizer
    if tok is None:
        raise ValueError(f"{model.source} has no tokenizer; pass token-id prompts to layer_importance()")
    encode = lambda text: tok(text, add_special_tokens=False)["input_ids"][-max_prompt_tokens:]
    rng = np.random.default_rng(seed)
    plays = [p for p in play_names() if p != HELD_OUT_PLAY]

    def chat():
        for text in INSTRUCTIONS:
            messages = [{"role": "user", "content": text}]
            yield encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))

    def humaneval():
        for problem in humaneval_problems():
            yield encode(problem["prompt"])

    def shakespeare():
        for i in range(n):
            text = load_play(plays[i % len(plays)])
            start = text.find("\n", int(len(text) * rng.uniform(0.1, 0.9))) + 1  # skip Gutenberg front/back matter
            yield tok(text[start : start + 8 * excerpt_tokens], add_special_tokens=False)["input_ids"][:excerpt_tokens]

    sources = {"chat instructions": chat(), "humaneval prompts": humaneval(), "shakespeare excerpts": shakespeare()}
    prompts, counts = [], dict.fromkeys(sources, 0)
    while len(prompts) < n and sources:
        for name, it in list(sources.items()):
            if len(prompts) == n:
                break
            ids = next(it, None)
            if ids is None:
                del sources[name]
            else:
                prompts.append(list(ids))
                counts[name] += 1
    return prompts, counts


def analyze_layers(
    model: LoadedModel,
    n_samples: int = DEFAULT_SAMPLES,
    response_tokens: int = DEFAULT_RESPONSE_TOKENS,
    seed: int = 0,
    **kwargs: Any,
) -> LayerImportance:
    """``layer_importance`` over ``calibration_prompts(model, n_samples)``."""
    prompts, counts = calibration_prompts(model, n_samples, seed)
    log.info("calibration prompts: %s", counts)
    return layer_importance(model, prompts, response_tokens, seed=seed, sources=counts, **kwargs)


# ------------------------------------------------------------------ report, plot


def format_table(result: LayerImportance) -> str:
    """Per layer: normalised prefill / decode importance (% of each phase's total) and ranks."""
    (norm_p, norm_d), (rank_p, rank_d) = result.normalised(), result.ranks()
    lines = [f"{'layer':>5}  {'prefill %':>9} {'rank':>4}  {'decode %':>9} {'rank':>4}  {'prefill/decode':>14}"]
    for l in range(result.n_layers):
        ratio = result.prefill[l] / result.decode[l] if result.decode[l] > 0 else float("inf")
        lines.append(
            f"{l:>5}  {100 * norm_p[l]:>9.2f} {rank_p[l]:>4}  {100 * norm_d[l]:>9.2f} {rank_d[l]:>4}  {ratio:>14.3g}"
        )
    return "\n".join(lines)


def plot(result: LayerImportance, path: str | Path, title: str = "") -> None:
    """Both normalised curves per layer (log scale), the last third shaded."""
    import matplotlib  # optional: matplotlib (popjax[eval]), only for the plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: matplotlib (popjax[eval])

    norm_p, norm_d = result.normalised()
    layers = np.arange(result.n_layers)
    fig, ax = plt.subplots(figsize=(8, 4.2))
    ax.axvspan(result.n_layers - result.n_layers // 3 - 0.5, result.n_layers - 0.5, color="0.92", label="last third")
    ax.plot(layers, 100 * norm_p, "o-", label="prefill gates (prompt tokens)")
    ax.plot(layers, 100 * norm_d, "s-", label="decode gates (response tokens)")
    ax.set_yscale("log", nonpositive="mask")  # an exact 0 (last layer, with the boundary) is left out
    zeros = [f"{phase} {l}" for phase, v in (("prefill", norm_p), ("decode", norm_d)) for l in np.flatnonzero(v == 0)]
    if zeros:
        ax.text(0.01, 0.01, "exactly 0, not drawn: " + ", ".join(zeros), transform=ax.transAxes, fontsize=8)
    ax.set_xlabel("layer")
    ax.set_ylabel("share of the phase's importance (%)")
    ax.set_title(title or f"Virtual-gate importance E[(dL/dg)^2], {result.n_samples} samples")
    ax.legend(loc="lower left", bbox_to_anchor=(0, 0.06))
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
