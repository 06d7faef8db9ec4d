"""The batch study of Batch-wise Adaptive Pruning's claim (issue 10; docs/methods.md §3, §5): when a batch
must share one mask, do threshold methods (TEAL, CATS) drift off their target density and lose
accuracy, while BWAP keeps both?

For every method and batch size b, the same ``windows`` windows of held-out text run in batches
of exactly b (a shared-mask method sees b − 1 batch-mates): each window's P prompt tokens are
prefilled, then its next N tokens are fed one at a time through the method's decode path and
scored (online teacher-forced NLL, as `tasks.online_nll`). One record per (method, b):

    nll, ppl, nll_by_position [N]   the N fed tokens' NLL (mean over windows)
    density_by_step [steps]         ACTUAL fraction of the FFN weights read per decode step,
                                    mean over layers and over the batches of windows
    density_mean                    its mean over steps
    kl, kl_by_position [N]          fidelity to dense: KL(dense ‖ method) of the next-token
                                    distributions at the fed positions (nats, mean over windows)
    agreement                       fraction of fed positions where the method's top-1 token
                                    equals dense's (both teacher-forced on the same text)
    target_density                  plan.ffn_weights_read(d) / (3·d·f): what the budget promises
    density_source                  "aux": the method reports ``density`` per step and layer
                                    (TEAL, CATS, BWAP); "static": it does not, and the curve
                                    is its target (dense, static, POP, dynamic)

``density_from`` chooses where the density curve comes from:
  "teacher" (default): the aux of the very decode steps whose NLL is scored, in the same compiled
    pass (steps = N); one compile per (method, batch) and half the work of a second pass.
  "generation": greedy generation of N tokens from the same prompts (``generate_ids`` with
    ``return_trace``; steps = N − 1: the first token comes from prefill).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from tqdm.auto import tqdm

from ..generation import generate_ids
from ..loaded import LoadedModel
from ..methods import ALIASES, BWAP, CATS, METHODS, POP, TEAL, Dense, Dynamic, Method, MethodError, Static, method_label, sweep
from .tasks import NLLSettings, text_windows
from .teacher import teacher_forced

log = logging.getLogger(__name__)

STUDY_METHODS: dict[str, Callable[[float], Method]] = {
    "dense": lambda r: Dense(),
    "teal": lambda r: TEAL(r),
    "cats": lambda r: CATS(r),
    "bwap": lambda r: BWAP(r),
    "pop": lambda r: POP(r, aggregate="shared"),
    "static": lambda r: Static(r, aggregate="shared"),
    "dynamic": lambda r: Dynamic(r, aggregate="shared"),
    "bwap-no-memory": lambda r: BWAP(r, memory=False),  # ablations of docs/methods.md §3
    "bwap-mean": lambda r: BWAP(r, aggregate="mean"),
    "bwap-every-step": lambda r: BWAP(r, schedule="every_step"),
}
DRIFT_METHODS = ("teal", "cats", "bwap")  # the density-over-steps plot
DENSITY_SOURCES = ("teacher", "generation")


def study_methods(names: Sequence[str], ratio: float) -> list[tuple[str, Method]]:
    """(label, method) per name: a `STUDY_METHODS` key, or a registry spec (``name:key=value``)
    given ``ratio`` and the shared aggregation where it takes them."""
    out = []
    for name in names:
        if name in STUDY_METHODS:
            out.append((name, STUDY_METHODS[name](ratio)))
            continue
        if any(part not in METHODS and part not in ALIASES for part in name.split(":")[0].split("+")):
            raise MethodError(f"unknown study method {name!r}; use one of {list(STUDY_METHODS)} or a method spec of {sorted(METHODS)}")
        out += sweep([name], [ratio], aggregate="shared")  # the batch study is about shared masks
    return out


def check_batches(windows: int, batch_sizes: Sequence[int]) -> tuple[int, ...]:
    """The sorted distinct batch sizes; every one must divide ``windows`` so every batch is full
    (a short last batch would give its rows fewer batch-mates than the size claims)."""
    sizes = tuple(batch_sizes)
    if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes):
        raise ValueError(f"batch_sizes={list(sizes)} must be a non-empty list of integers ≥ 1")
    if isinstance(windows, bool) or not isinstance(windows, int) or windows < 1 or any(windows % b for b in sizes):
        raise ValueError(
            f"windows={windows!r} must be a positive multiple of every batch size {sorted(set(sizes))} "
            f"(e.g. {math.lcm(*sizes)}), so that every batch holds exactly that many windows"
        )
    return tuple(sorted(set(sizes)))


def _layer_mean(density: np.ndarray, batch: int) -> np.ndarray | None:
    """[steps, L] or [steps, L, B_bucket] -> [steps] (mean over layers and real rows); None if empty."""
    density = np.asarray(density, np.float64)
    if density.size == 0:
        return None
    if density.ndim == 3:  # per-sequence aux: drop the bucket's dead rows
        density = density[:, :, :batch]
    return density.reshape(density.shape[0], -1).mean(axis=1)


def _run_batch(model: LoadedModel, method: Method, prompts: list[list[int]], targets: np.ndarray, density_from: str):
    """One full batch -> (nll [B, N], log-probabilities [B, N, V], density by step or None)."""
    B = len(prompts)
    if density_from == "generation":
        nll, logp = teacher_forced(model, method, prompts, targets, with_logprobs=True)
        _, trace = generate_ids(model, prompts, targets.shape[1], method=method, return_trace=True, ignore_eos=True)
        return nll, logp, _layer_mean(trace["decode"].get("density", np.zeros((0,))), B)
    nll, logp, records = teacher_forced(model, method, prompts, targets, with_logprobs=True, record=("density",))
    return nll, logp, _layer_mean(records.get("density", np.zeros((0,))), B)


def _fidelity(dense_logp: np.ndarray, logp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[B, N, V] log-probabilities of dense and of a method -> (KL(dense ‖ method) [B, N],
    top-1 agreement [B, N] bool)."""
    kl = np.sum(np.exp(dense_logp) * (dense_logp - logp), axis=-1, dtype=np.float64)
    return np.maximum(kl, 0.0), dense_logp.argmax(-1) == logp.argmax(-1)


def batch_study_ids(
    model: LoadedModel,
    methods: Sequence[Method | tuple[str, Method]],
    prompts: list[list[int]],
    targets: np.ndarray,
    batch_sizes: Sequence[int] = (1, 4, 8),
    density_from: str = "teacher",
) -> list[dict[str, Any]]:
    """The study on token ids: ``prompts`` (W lists of P ids) and ``targets`` [W, N]; methods as
    `Method` or (label, Method). Returns one record per (method, batch size); see the module doc."""
    sizes = check_batches(len(prompts), batch_sizes)
    if density_from not in DENSITY_SOURCES:
        raise ValueError(f"density_from={density_from!r} is not one of {DENSITY_SOURCES}")
    targets = np.asarray(targets, np.int32)
    if targets.ndim != 2 or targets.shape[0] != len(prompts) or targets.shape[1] < 1:
        raise ValueError(f"targets must be [W={len(prompts)}, N ≥ 1]; got {targets.shape}")
    span = max(map(len, prompts)) + targets.shape[1]
    if span > model.config.max_position_embeddings:
        raise ValueError(f"a window of {span} tokens exceeds the model's context of {model.config.max_position_embeddings}")
    steps = targets.shape[1] - (density_from == "generation")
    d = model.config.hidden_size
    labelled = [m if isinstance(m, tuple) else (method_label(m, exclude=("ratio",)), m) for m in methods]
    # dense does not depend on batch-mates: one pass at the largest batch is the fidelity reference
    dense_logp = np.concatenate([
        teacher_forced(model, Dense(), prompts[i : i + sizes[-1]], targets[i : i + sizes[-1]], with_logprobs=True)[1]
        for i in range(0, len(prompts), sizes[-1])
    ])
    records = []
    for label, method in tqdm(labelled, desc="batch study", unit="method"):
        method = method.prepare(model)  # TEAL/CATS calibrate once (cached on disk)
        plan = method.bind(model.config)
        target = plan.ffn_weights_read(d) / (3 * d * plan.f)
        for b in sizes:
            nlls, curves, kls, agree = [], [], [], []
            for start in range(0, len(prompts), b):
                nll, logp, curve = _run_batch(model, method, prompts[start : start + b], targets[start : start + b], density_from)
                kl, same = _fidelity(dense_logp[start : start + b], logp)
                nlls.append(nll)
                curves.append(curve)
                kls.append(kl)
                agree.append(same)
            nll, kl, agree = np.concatenate(nlls), np.concatenate(kls), np.concatenate(agree)
            measured = curves[0] is not None
            curve = np.mean(curves, axis=0) if measured else np.full(steps, target)
            log.info("%s batch %d: nll %.4f, kl %.4f, density %.3f (target %.3f)", label, b, nll.mean(), kl.mean(),
                     curve.mean(), target)
            records.append({
                "method": method.name,
                "label": label,
                "ratio": method.reported()["ratio"],
                "batch_size": b,
                "windows": len(prompts),
                "prompt_tokens": max(map(len, prompts)),
                "decode_tokens": int(targets.shape[1]),
                "density_from": density_from,
                "nll": float(nll.mean()),
                "ppl": float(np.exp(nll.mean())),
                "nll_by_position": nll.mean(axis=0).tolist(),
                "kl": float(kl.mean()),
                "kl_by_position": kl.mean(axis=0).tolist(),
                "agreement": float(agree.mean()),
                "density_source": "aux" if measured else "static",
                "target_density": float(target),
                "density_mean": float(curve.mean()),
                "density_by_step": curve.tolist(),
            })
    return records


def batch_study(
    model: LoadedModel,
    methods: Sequence[Method | tuple[str, Method]],
    text: str,
    batch_sizes: Sequence[int] = (1, 4, 8),
    windows: int = 8,
    prompt_tokens: int = 128,
    decode_tokens: int = 256,
    density_from: str = "teacher",
) -> list[dict[str, Any]]:
    """The study on ``text``: ``windows`` windows of ``prompt_tokens`` + ``decode_tokens`` tokens
    at evenly spaced offsets (as `tasks.text_windows`), then `batch_study_ids`."""
    check_batches(windows, batch_sizes)  # before tokenising a whole play
    prompts, targets = text_windows(model, text, NLLSettings(prompt_tokens, decode_tokens, windows))
    return batch_study_ids(model, methods, prompts, targets, batch_sizes, density_from)


def markdown_table(records: list[dict[str, Any]]) -> str:
    """Rows: methods in study order. Columns: NLL per batch size, NLL(largest) − NLL(1 or the
    smallest), the target density and the actual mean density per batch size."""
    sizes = sorted({r["batch_size"] for r in records})
    by = {(r["label"], r["batch_size"]): r for r in records}
    head = [f"NLL b={b}" for b in sizes] + [f"ΔNLL b={sizes[-1]}−{sizes[0]}"] + [f"KL b={b}" for b in sizes]
    head += ["target density"]
    head += [f"density b={b}" for b in sizes]
    lines = ["| method | ratio | " + " | ".join(head) + " |", "|---|---|" + "---|" * len(head)]
    for label in dict.fromkeys(r["label"] for r in records):
        rows = [by.get((label, b)) for b in sizes]
        first = next(r for r in rows if r)
        cells = [f"{r['nll']:.4f}" if r else "" for r in rows]
        cells.append(f"{rows[-1]['nll'] - rows[0]['nll']:+.4f}" if rows[0] and rows[-1] else "")
        cells += [f"{r['kl']:.4f}" if r else "" for r in rows]
        cells.append(f"{first['target_density']:.3f}")
        cells += [f"{r['density_mean']:.3f}{'' if r['density_source'] == 'aux' else '*'}" if r else "" for r in rows]
        lines.append(f"| {label} | {first['ratio']:.2f} | " + " | ".join(cells) + " |")
    lines += ["", "Density: fraction of the FFN weights a decode step reads, mean over steps and layers; "
              "* = the method reports none, its target is shown. "
              "KL: KL(dense ‖ method) of the next-token distributions at the fed positions (nats)."]
    return "\n".join(lines)


def plot_study(records: list[dict[str, Any]], out_dir: Path, drift_methods: Sequence[str] = DRIFT_METHODS) -> list[Path]:
    """``density_over_steps.png`` (the drift: actual density per decode step of ``drift_methods``,
    or of every method that reports density, at the smallest vs the largest batch, with each
    target dotted) and ``nll_vs_batch.png``. Returns the PNG paths."""
    import matplotlib  # optional: matplotlib (popjax[eval]), only for the plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: matplotlib (popjax[eval])

    out_dir.mkdir(parents=True, exist_ok=True)
    sizes = sorted({r["batch_size"] for r in records})
    labels = list(dict.fromkeys(r["label"] for r in records))
    measured = [label for label in labels if any(r["label"] == label and r["density_source"] == "aux" for r in records)]
    drift = [label for label in labels if label in drift_methods] or measured
    paths = []
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, label in enumerate(drift):
        color = f"C{i % 10}"
        for b, style in ((sizes[0], "-"), (sizes[-1], "--")) if len(sizes) > 1 else ((sizes[0], "-"),):
            r = next((r for r in records if r["label"] == label and r["batch_size"] == b), None)
            if r is not None:
                ax.plot(np.arange(len(r["density_by_step"])), r["density_by_step"], ls=style, color=color, lw=1,
                        label=f"{label} b={b}")
        target = next(r["target_density"] for r in records if r["label"] == label)
        ax.axhline(target, color=color, ls=":", lw=1)
    ax.set(xlabel="decode step", ylabel="FFN density (fraction of weights read)", ylim=(0, 1.05),
           title="Actual density per decode step (dotted: target)")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    paths.append(out_dir / "density_over_steps.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for label in labels:
        pts = sorted((r["batch_size"], r["nll"]) for r in records if r["label"] == label)
        ax.plot(*zip(*pts), marker="o", label=label, ls="-" if label != "dense" else ":", color="gray" if label == "dense" else None)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set(xlabel="batch size (windows sharing a batch)", ylabel="online NLL (nats)", title="NLL vs batch size")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    paths.append(out_dir / "nll_vs_batch.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths
