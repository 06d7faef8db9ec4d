"""The quality-per-byte frontier of FFN pruning (issue 15, part 1): ``popjax frontier``.

For every (method spec, global ratio) configuration, on the same W windows of held-out prose
(P prompt tokens prefilled, then N tokens fed one at a time through the decode path):

    nll, ppl             online teacher-forced NLL of the N tokens (as `tasks.online_nll`)
    kl                   KL(dense ‖ method) of the next-token distributions along the same
                         teacher-forced text, mean over the W·N positions
    ffn_bytes_per_token  FFN weight bytes one decode token reads: Σ over layers of
                         plan.ffn_weights_read(d) (or the plan's per-layer figures when it has
                         them) × bytes per element of the model dtype; ``ffn_bytes_fraction``
                         divides by dense's
    xla_bytes_per_step   XLA's "bytes accessed" of the compiled single decode step
                         (`engine.stream_step`, batch 1), and ``xla_delta_vs_dense`` /
                         ``plan_delta_vs_dense``: the change from dense by XLA and by the plan.
                         Attention, KV cache, embedding and LM-head bytes are the same for every
                         method, so the XLA change should track the plan's FFN change where the
                         method really reads compact weights (static: within a few %); methods
                         that mask dense matmuls (TEAL, CATS) or gather per step show the gap.
    pareto               not dominated in (ffn bytes, nll) among the configurations of its ratio;
                         ``pareto_overall`` across all; ``pareto_kl`` in (bytes, kl) per ratio

The bytes per token are a batch-1 figure, so NLL and KL use batch-1 semantics: methods that
can keep one selection per row run with ``aggregate="per_sequence"`` (or "per_token") in
batches; a method whose selection is shared by the batch (BWAP, or a spec that sets a shared
aggregate) runs its windows one at a time. The XLA step compiles the method as a batch-1
deployment (and `popjax bench`) runs it: with its default aggregate, which at batch 1 computes
the same thing. Memory: dense's log-probabilities of all windows are kept for the KL,
W·N·V·4 bytes (16·128·49152·4 = 400 MB on the default model).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from .. import engine
from ..requests import GenerationRequest
from ..loaded import LoadedModel
from ..methods import METHODS, Dense, Method, MethodError, method_label, sweep
from ..methods.base import ROW_AGGREGATES  # one selection per row: batches keep batch-1 semantics
from .tasks import NLLSettings, text_windows
from .teacher import teacher_forced

log = logging.getLogger(__name__)

GAMMAS = (0.05, 0.1, 0.2, 0.4, 0.7, 1.0)  # the default sweep of every method with a band γ


@dataclasses.dataclass(frozen=True)
class FrontierSettings:
    nll: NLLSettings = NLLSettings(windows=8)
    xla: bool = True  # compile one decode step per configuration for XLA's bytes
    max_bytes_fraction: float | None = None  # keep configurations reading at most this of dense FFN bytes


def default_specs() -> tuple[list[str], dict[str, str]]:
    """The default sweep: dense, every registered method with a band ``gamma`` at each of
    `GAMMAS`, every other method that takes a ``ratio``. Returns (specs, {skipped name: why})."""
    specs, skipped = ["dense"], {}
    for name, cls in METHODS.items():
        fields = {f.name: f for f in dataclasses.fields(cls)}
        required = [n for n, f in fields.items() if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if name == "dense":
            continue
        if cls.layer_level:
            skipped[name] = "layer-level (acts on prefill layers; compose it with an MLP method, e.g. prefill-only+pop)"
        elif required:
            skipped[name] = f"needs {required}, which have no default"
        elif not cls.takes_ratio():
            skipped[name] = "takes no global ratio"
        else:
            specs += [f"{name}:gamma={g}" for g in GAMMAS] if "gamma" in fields else [name]
    return specs, skipped


def _inner(method: Method) -> Method:
    """The FFN method of a composed (layer-level + FFN) method, else the method itself."""
    inner = method.ffn_method
    return method if method.layer_level and isinstance(inner, Dense) else inner


def configurations(specs: Sequence[str], ratios: Sequence[float]) -> list[tuple[str, Method]]:
    """(spec, method) per configuration: dense first (the reference), then each spec once if it
    takes no ratio, else at each ratio, with a per-row aggregate where the method takes one (the
    spec's own ``aggregate=`` wins); duplicates (a spec fixing its own ratio) are dropped."""
    specs, ratios = [s for s in specs if s], list(ratios)
    if not specs:
        raise MethodError(f"no method specs given (methods={list(specs)!r}); name at least one, e.g. pop:gamma=0.1,static")
    if not ratios:
        raise MethodError(f"no ratios given (ratios={ratios!r}); give global ratios in [0, 1), e.g. 0.2,0.4")
    out = []
    for spec in ["dense"] + [s for s in specs if s != "dense"]:
        try:
            out += sweep([spec], ratios, aggregate=ROW_AGGREGATES)
        except MethodError as err:
            raise MethodError(f"method spec {spec!r}: {err}") from None
    seen, unique = set(), []
    for spec, method in out:
        if repr(method) not in seen:
            seen.add(repr(method))
            unique.append((spec, method))
    return unique


def nll_batch_size(method: Method, batch_size: int) -> int:
    """Windows per teacher-forced call: 1 for a batch-shared selection, else ``batch_size``."""
    aggregate = method.reported()["aggregate"]
    return batch_size if aggregate is None or aggregate in ROW_AGGREGATES else 1


def deployed(method: Method) -> Method:
    """The method as a batch-1 deployment runs it (its default aggregate; same results at batch 1)."""
    inner = _inner(method)
    if inner is not method:
        return dataclasses.replace(method, mlp_method=deployed(inner))
    default = {f.name: f.default for f in dataclasses.fields(method)}.get("aggregate", dataclasses.MISSING)
    if default is dataclasses.MISSING or default == method.aggregate:
        return method
    return dataclasses.replace(method, aggregate=default)


def ffn_bytes_per_token(model: LoadedModel, method: Method) -> int:
    """FFN weight bytes one decode token reads at batch 1, all layers (model dtype)."""
    cfg, plan = model.config, method.bind(model.config)
    d = cfg.hidden_size
    per_layer = getattr(plan, "ffn_weights_read_per_layer", None)
    elements = sum(per_layer(d)) if per_layer is not None else cfg.num_hidden_layers * plan.ffn_weights_read(d)
    return int(elements) * jnp.dtype(model.dtype).itemsize


def xla_step_bytes(model: LoadedModel, method: Method, prompt: list[int], decode_tokens: int) -> float:
    """XLA's "bytes accessed" of one compiled decode step (`engine.stream_step`) at batch 1,
    after a prefill of ``prompt`` with room for ``decode_tokens``. Nothing runs: the carry's
    shapes come from `jax.eval_shape`."""
    req = GenerationRequest.create(model, [prompt], decode_tokens, method=method, ignore_eos=True)
    carry = jax.eval_shape(lambda: req.start(model)[0])
    compiled = engine.stream_step.lower(
        model.graphdef, model.params, req.plan, carry, req.sampling, jnp.asarray(req.stops), jnp.int32(req.pad_id),
        data=req.data,
    ).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["bytes accessed"])


def pareto_flags(xs: Sequence[float], ys: Sequence[float]) -> list[bool]:
    """True where no other point is ≤ in both coordinates and < in one (both minimised)."""
    pts = list(zip(xs, ys))
    return [not any(a <= x and b <= y and (a < x or b < y) for a, b in pts) for x, y in pts]


def mark_fronts(records: list[dict[str, Any]]) -> None:
    """Sets ``pareto`` (per ratio, bytes × NLL), ``pareto_kl`` (per ratio, bytes × KL),
    ``pareto_overall`` (all configurations, bytes × NLL) and, where measured decode speeds
    exist, ``pareto_speed`` (all with a speed; max tok/s × min NLL)."""
    for key, y, groups in (("pareto", "nll", True), ("pareto_kl", "kl", True), ("pareto_overall", "nll", False)):
        for ratio in sorted({r["ratio"] for r in records}) if groups else [None]:
            group = [r for r in records if ratio is None or r["ratio"] == ratio]
            for r, flag in zip(group, pareto_flags([r["ffn_bytes_per_token"] for r in group], [r[y] for r in group])):
                r[key] = flag
    timed = [r for r in records if r.get("decode_tokens_per_s") is not None]
    for r, flag in zip(timed, pareto_flags([-r["decode_tokens_per_s"] for r in timed], [r["nll"] for r in timed])):
        r["pareto_speed"] = flag


def attach_bench(records: list[dict[str, Any]], bench: dict[str, Any], batch: int = 1) -> int:
    """Adds ``decode_tokens_per_s`` from a `popjax bench` JSON (its records at ``batch``) to the
    configurations it measured: same method name and ratio, and the same label when the bench
    record has one; a bench record without a label ran the method's default hyper-parameters
    (aggregate aside: equal at batch 1). Returns how many configurations got a speed."""
    rows = [b for b in bench.get("records", []) if b.get("batch") == batch and b.get("decode_tokens_per_s") is not None]
    matched = 0
    for r in records:
        for b in rows:
            same = b["method"] == r["method"] and abs(float(b.get("ratio") or 0.0) - r["ratio"]) < 1e-9
            if same and b.get("label", r["method"]) == r["label"]:
                r["decode_tokens_per_s"] = float(b["decode_tokens_per_s"])
                matched += 1
                break
    return matched


def read_bench(path: str | Path) -> dict[str, Any]:
    """A `popjax bench --json` file holding decode speeds (for `attach_bench`); FileNotFoundError
    or ValueError naming the file otherwise."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"bench file {path} does not exist")
    bench = json.loads(Path(path).read_text())
    if not isinstance(bench, dict) or not any("decode_tokens_per_s" in r for r in bench.get("records", [])):
        raise ValueError(f"bench file {path} holds no records with decode_tokens_per_s (write one with popjax bench --json)")
    return bench


def _score(model, method, prompts, targets, batch: int, dense_logp: np.ndarray | None):
    """nll [W, N] and, against ``dense_logp`` [W, N, V], kl [W, N]; with None, also returns
    this method's log-probabilities [W, N, V] (the dense reference)."""
    nlls, kls, logps = [], [], []
    for start in range(0, len(prompts), batch):
        nll, logp = teacher_forced(model, method, prompts[start : start + batch], targets[start : start + batch], with_logprobs=True)
        nlls.append(nll)
        if dense_logp is None:
            logps.append(logp)
        else:
            ref = dense_logp[start : start + batch]
            kls.append(np.sum(np.exp(ref) * (ref - logp), axis=-1))
    nll = np.concatenate(nlls)
    if dense_logp is None:
        return nll, np.zeros_like(nll), np.concatenate(logps)
    return nll, np.concatenate(kls), None


def frontier(
    model: LoadedModel, specs: Sequence[str], ratios: Sequence[float], text: str, settings: FrontierSettings = FrontierSettings()
) -> list[dict[str, Any]]:
    """Every configuration of ``specs`` × ``ratios`` on ``text`` -> one record each (see the
    module doc), dense first, fronts marked. Raises MethodError/ValueError on bad input before
    any model run."""
    cap = settings.max_bytes_fraction
    if cap is not None and not (isinstance(cap, (int, float)) and 0.0 < cap <= 1.0):
        raise ValueError(f"max_bytes_fraction={cap!r} must be in (0, 1]: a fraction of dense FFN bytes per token")
    configs = [(spec, m.prepare(model)) for spec, m in configurations(specs, ratios)]  # calibrations are cached
    dense_bytes = ffn_bytes_per_token(model, Dense())
    sized = [(spec, m, ffn_bytes_per_token(model, m)) for spec, m in configs]
    if cap is not None:
        smallest = min(sized[1:], key=lambda c: c[2], default=None)
        sized = sized[:1] + [c for c in sized[1:] if c[2] <= cap * dense_bytes]  # dense stays: the reference
        if len(sized) == 1:
            best = ""
            if smallest is not None:
                spec, method, size = smallest
                best = f"; the smallest is {size / dense_bytes:.4f} ({spec} at ratio {method.reported()['ratio']})"
            raise ValueError(f"no configuration reads at most max_bytes_fraction={cap} of dense FFN bytes per token{best}")
    s = settings.nll
    prompts, targets = text_windows(model, text, s)
    records, dense_logp, dense_xla = [], None, None
    for spec, method, ffn_bytes in tqdm(sized, desc="frontier", unit="config"):
        batch = nll_batch_size(method, s.batch_size)
        nll, kl, logp = _score(model, method, prompts, targets, batch, dense_logp)
        dense_logp = logp if dense_logp is None else dense_logp
        xla = xla_step_bytes(model, deployed(method), prompts[0], s.decode_tokens) if settings.xla else None
        dense_xla = xla if dense_xla is None else dense_xla
        record = {
            "spec": spec,
            "method": method.name,
            "label": method_label(method, exclude=("ratio", "aggregate")),
            "ratio": float(method.reported()["ratio"]),
            "gamma": method.reported()["gamma"],
            "aggregate": method.reported()["aggregate"],
            "nll_batch_size": batch,
            "windows": len(prompts),
            "prompt_tokens": s.prompt_tokens,
            "decode_tokens": s.decode_tokens,
            "dtype": str(model.dtype),
            "nll": float(nll.mean()),
            "ppl": float(np.exp(nll.mean())),
            "kl": float(kl.mean()),
            "nll_by_position": nll.mean(axis=0).tolist(),
            "nll_by_window": nll.mean(axis=1).tolist(),  # for paired comparisons between configurations
            "ffn_bytes_per_token": ffn_bytes,
            "ffn_bytes_fraction": ffn_bytes / dense_bytes,
            "plan_delta_vs_dense": ffn_bytes - dense_bytes,
            "xla_bytes_per_step": xla,
            "xla_delta_vs_dense": None if xla is None else xla - dense_xla,
        }
        log.info("%s ratio %.2f: nll %.4f, kl %.4f, ffn %.3f of dense", record["label"], record["ratio"], record["nll"], record["kl"],
                 record["ffn_bytes_fraction"])
        records.append(record)
    dense_nll = records[0]["nll"]
    for r in records:
        r["delta_nll_vs_dense"] = r["nll"] - dense_nll
    mark_fronts(records)
    return records


def markdown_table(records: list[dict[str, Any]]) -> str:
    """One row per configuration, by ratio then FFN bytes; MB = 10⁶ bytes."""
    speed = any(r.get("decode_tokens_per_s") is not None for r in records)
    head = ["method", "ratio", "FFN MB/token", "× dense FFN", "NLL", "ΔNLL vs dense", "KL", "XLA MB/step", "XLA Δ MB",
            "plan Δ MB", "XLA Δ / plan Δ"] + (["decode tok/s"] if speed else []) + ["front (ratio / all)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    mb = lambda v: "" if v is None else f"{v / 1e6:.{2 if abs(v) >= 1e7 else 4}f}"  # noqa: E731  (tiny models: 4 decimals)
    for r in sorted(records, key=lambda r: (r["ratio"], r["ffn_bytes_per_token"], r["label"])):
        plan, xla = r["plan_delta_vs_dense"], r["xla_delta_vs_dense"]
        cells = [r["label"], f"{r['ratio']:.2f}", mb(r["ffn_bytes_per_token"]), f"{r['ffn_bytes_fraction']:.3f}", f"{r['nll']:.4f}",
                 f"{r['delta_nll_vs_dense']:+.4f}", f"{r['kl']:.4f}", mb(r["xla_bytes_per_step"]), mb(xla), mb(plan),
                 f"{xla / plan:.2f}" if xla is not None and plan else ""]
        if speed:
            cells.append("" if r.get("decode_tokens_per_s") is None else f"{r['decode_tokens_per_s']:.1f}")
        cells.append(f"{'yes' if r['pareto'] else '-'} / {'yes' if r['pareto_overall'] else '-'}")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "FFN MB/token: Σ over layers of the plan's FFN weights read per decode token × bytes per element. "
              "XLA: \"bytes accessed\" of the compiled single decode step at batch 1 (all weights, KV cache, logits), "
              "its change from dense beside the plan's FFN change. front: not dominated in (FFN bytes, NLL) among "
              "the configurations of its ratio / of all."]
    return "\n".join(lines)
