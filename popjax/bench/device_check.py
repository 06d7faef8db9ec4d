"""``popjax device-check``: in one command of at most 8 minutes on a lent GPU or TPU, what the
compiler's estimates cannot say: the machine and its versions, the decode-step time of every
kernel-served method against XLA at Llama-3.1-8B shapes, and the cost of fetching a row.

Files under ``out`` (at most 8; each written through a temp file and a rename after every
measurement, so whatever exists when the budget ends or the process is killed is on disk):

* ``device.json``: devices, versions (jax, jaxlib, plugins, flax, triton, CUDA, driver: `device_info`);
* ``decode-float.json``, ``decode-int8.json``: per method × kernel (xla, pallas) × batch, the
  median synchronised decode-step time (one ``engine.stream_step`` per call, blocked on),
  its bytes (`analysis.flops.bytes_per_step`, analytic) and the GB/s that makes, the first
  call's time (compile + run), and per method the kernel's max |Δ log-probability| against XLA
  on the same synthetic weights (log-softmax of the logits: the logits' own shift-free form)
  over ``diff_steps`` teacher-forced decode steps at ``diff_batch``;
* ``row_gather.json``: `row_gather`'s points and fitted per-row cost;
* ``check.json``: the plan, the budget, what was measured and what the budget left out.

`DEVICE_PLAN`: Llama-3.1-8B's first ``layers`` = 4 layers (bf16 and int8). Every (method,
kernel, batch) compiles its own prefill and step, ~170 programs in all, and an unrolled
program's compile time grows with its layers; 4 layers read 1.41 GB of FFN weights per bf16
step beside the LM head's 1.05 GB, so the FFN is the larger part of every step while the whole
check still fits 8 minutes. `DRY_PLAN` is the same code at tiny shapes on CPU, the kernels in
Pallas interpret mode (what the tests run).

Offline methods (TEAL, CATS, principal TEAL) run with placeholder fits (`synthetic.fitted`):
their kernel-vs-XLA difference is exact to check, but their times are those of the
placeholder's selections (noted in each record).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from .. import engine
from ..analysis.flops import bytes_per_step
from ..files import write_json_atomic
from ..methods import parse_method_spec
from ..requests import GenerationRequest, pad_batch
from ..kernels import fallback
from ..kernels.attention import cache_slots
from . import device_info, row_gather, synthetic

log = logging.getLogger(__name__)

# (name, spec without kernel, kernels): static at block 1 reads a compact copy (no kernel to compare)
METHODS = (
    ("dense", "dense", ("xla",)),
    ("pop", "pop:ratio={r}", ("xla", "pallas")),
    ("static", "static:ratio={r}", ("xla",)),
    ("block static", "static:ratio={r}:block={b}", ("xla", "pallas")),
    ("teal", "teal:ratio={r}", ("xla", "pallas")),
    ("cats", "cats:ratio={r}", ("xla", "pallas")),
    ("principal teal", "principal-teal:ratio={r}", ("xla", "pallas")),
    ("dynamic", "dynamic:ratio={r}", ("xla", "pallas")),
)
METHOD_NAMES = tuple(name for name, _, _ in METHODS)
MAX_FILES = 8


@dataclasses.dataclass(frozen=True)
class CheckPlan:
    """What the check measures: a shipped config cut to ``layers`` (``tiny``: its dimensions
    shrunk for a CPU), each weight format, batch and method at ``ratio`` (blocks of ``block``)."""

    model: str = "llama-3.1-8b"
    methods: tuple[str, ...] = METHOD_NAMES  # dense is always measured: the other records' reference
    layers: int = 4
    tiny: bool = False
    dtype: str = "bfloat16"
    weights: tuple[str, ...] = ("float", "int8")
    batches: tuple[int, ...] = (1, 8, 64)
    ratio: float = 0.4
    block: int = 128
    prompt_tokens: int = 32
    steps: int = 8  # timed decode steps per configuration (after one warm step)
    diff_batch: int = 8
    diff_steps: int = 2
    gather: row_gather.GatherGrid = row_gather.GatherGrid()
    gather_share: float = 0.25  # of the budget kept for the row-gather microbenchmark

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in METHOD_NAMES]
        if unknown or not self.methods:
            raise ValueError(f"methods={list(self.methods)}: {unknown[0] if unknown else 'none'!r} is not a method of the check; "
                             f"choose from {', '.join(METHOD_NAMES)}")
        bad = [w for w in self.weights if w not in ("float", "int8")]
        if bad or not self.weights:
            raise ValueError(f"weights={list(self.weights)}: {bad[0] if bad else 'none'!r} is not a weight format; choose from float, int8")


DEVICE_PLAN = CheckPlan()
DRY_PLAN = CheckPlan(layers=2, tiny=True, dtype="float32", batches=(2,), block=32, prompt_tokens=8, steps=2, diff_batch=2,
                     gather=row_gather.GatherGrid(row_bytes=(4096,), rows=(32, 96, 192), depths=(16,), table_bytes=2**20,
                                                  dtype="float32", repeats=1))


def plan_config(plan: CheckPlan, weights: str):
    """The plan's model config in one weight format (tiny: 256 wide, 512 channels, 512 tokens)."""
    cfg = synthetic.synthetic_config(plan.model, plan.layers, weights)
    if plan.tiny:
        cfg = dataclasses.replace(cfg, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=64, vocab_size=512)
    return cfg


class Budget:
    """Seconds left of ``budget_s`` from creation; ``over(reserve)``: fewer than ``reserve`` left."""

    def __init__(self, budget_s: float):
        self.budget_s, self.start = budget_s, time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def over(self, reserve: float = 0.0) -> bool:
        return self.elapsed() >= self.budget_s - reserve


def _time_steps(model, method, prompts: list[list[int]], steps: int) -> dict[str, Any]:
    """First-call and median synchronised time of the engine's decode step -> a record."""
    req = GenerationRequest.create(model, prompts, steps + 2, method=method, ignore_eos=True)
    carry, _ = req.start(model)
    start = time.perf_counter()
    carry, _ = req.step(model, carry)
    jax.block_until_ready(carry)
    first = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        carry, _ = req.step(model, carry)
        jax.block_until_ready(carry)
        times.append(time.perf_counter() - start)
    slots = cache_slots(int(req.tokens.shape[1]), req.capacity)
    step_bytes = bytes_per_step(model.config, req.plan, len(prompts), slots, jnp.dtype(model.dtype).itemsize)
    median = float(np.median(times))
    return {"step_s": median, "step_s_samples": times, "first_step_s": first, "bytes_per_step": step_bytes,
            "gb_s": step_bytes / median / 1e9, "kernel_resolved": fallback.ran(req.plan), "cache_slots": slots}  # what ran, or "xla (fallback: ...)"


def _logprobs(model, method, tokens, mask, targets) -> np.ndarray:
    plan = method.bind(model.config)
    out = engine.teacher_force(model.graphdef, model.params, plan, tokens, mask, targets, with_logprobs=True, data=method.data(model))
    return np.asarray(out[1], np.float32)


def _method(spec: str, kernel: str, cfg) -> Any:
    full = spec if spec == "dense" else f"{spec}:kernel={kernel}"
    return synthetic.fitted(parse_method_spec(full), cfg)


def decode_jobs(plan: CheckPlan) -> list[tuple[int, str, str, str, str]]:
    """(batch, weights, method name, spec, kernel) in the order they run: batch by batch, each
    batch in both weight formats, so a budget that ends early has cut the largest batch, not
    a whole format."""
    return [(b, w, name, spec.format(r=plan.ratio, b=plan.block), k) for b in plan.batches for w in plan.weights
            for name, spec, ks in METHODS if name == "dense" or name in plan.methods for k in ks]


def measure_decode(plan: CheckPlan, budget: Budget, reserve: float, record: Callable[[str, dict], None]) -> dict[str, dict]:
    """Every `decode_jobs` entry until the budget's ``reserve`` is reached -> per weight format
    its result; ``record(weights, result so far)`` after each measurement. A format's weights
    are drawn at its first measurement (never, when the budget ends before it)."""
    results: dict[str, dict[str, Any]] = {}
    for w in plan.weights:
        cfg = plan_config(plan, w)
        results[w] = {"weights": w, "dtype": plan.dtype, "layers": cfg.num_hidden_layers, "records": [], "diffs": [], "skipped": [],
                      "complete": False, "model": synthetic.describe(cfg, plan.dtype, plan.model, 0)}
    models: dict[str, Any] = {}
    for batch, weights, name, spec, kernel in decode_jobs(plan):
        result = results[weights]
        if budget.over(reserve):
            result["skipped"].append({"batch": batch, "method": name, "kernel": kernel})
            continue
        if weights not in models:
            models[weights] = synthetic.synthetic_model(plan_config(plan, weights), plan.dtype,
                                                        source=f"{synthetic.SYNTHETIC_PREFIX}{plan.model}")
        model = models[weights]
        cfg = model.config
        method = _method(spec, kernel, cfg)
        entry = {"method": name, "spec": spec, "kernel": kernel, "batch": batch, "fits": synthetic.fit_note(method, cfg)}
        try:
            entry.update(_time_steps(model, method, synthetic.random_prompts(cfg, batch, plan.prompt_tokens, seed=batch), plan.steps))
        except Exception as err:  # noqa: BLE001  one configuration's failure is a result; the check goes on
            log.exception("device-check: %s kernel=%s batch %d failed", name, kernel, batch)
            entry["error"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        result["records"].append(entry)
        if kernel == "pallas" and batch == plan.diff_batch and not budget.over(reserve):
            result["diffs"].append(_diff(model, spec, cfg, plan))
        record(weights, result)
    for weights, result in results.items():
        result["complete"] = not result["skipped"]
        record(weights, result)
    return results


def _diff(model, spec: str, cfg, plan: CheckPlan) -> dict[str, Any]:
    """max |Δ log-prob| of the Pallas kernel against XLA over teacher-forced decode steps."""
    prompts = synthetic.random_prompts(cfg, plan.diff_batch, plan.prompt_tokens, seed=99)
    tokens, mask = (jnp.asarray(a) for a in pad_batch(prompts, 0))
    targets = jnp.asarray(np.random.default_rng(7).integers(0, cfg.vocab_size, (tokens.shape[0], plan.diff_steps)), jnp.int32)
    out = {"spec": spec, "batch": plan.diff_batch, "decode_steps": plan.diff_steps}
    try:
        ref = _logprobs(model, _method(spec, "xla", cfg), tokens, mask, targets)
        got = _logprobs(model, _method(spec, "pallas", cfg), tokens, mask, targets)
        rows = slice(0, plan.diff_batch)  # the batch's real rows (pad_batch pads it to its bucket)
        out["max_abs_logprob_diff"] = float(np.max(np.abs(got[rows] - ref[rows])))
        out["finite"] = bool(np.isfinite(ref[rows]).all() and np.isfinite(got[rows]).all())
    except Exception as err:  # noqa: BLE001
        log.exception("device-check: diff of %s failed", spec)
        out["error"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
    return out


def run_device_check(out: Path, budget_s: float, plan: CheckPlan = DEVICE_PLAN) -> dict[str, Any]:
    """Runs ``plan`` within ``budget_s`` seconds (checked between measurements), writing the
    files under ``out`` as it goes -> check.json's content."""
    out = Path(out)
    budget = Budget(budget_s)
    summary: dict[str, Any] = {"plan": dataclasses.asdict(plan), "budget_s": budget_s, "files": [], "events": []}

    def write(name: str, payload: Any) -> None:
        if name not in summary["files"]:
            summary["files"].append(name)
        if len(summary["files"]) >= MAX_FILES:  # check.json is the last; a device run returns at most 8 files
            raise RuntimeError(f"device-check would write {summary['files'] + ['check.json']}: more than {MAX_FILES} files")
        write_json_atomic(out / name, payload)

    def event(what: str) -> None:
        summary["events"].append({"at_s": round(budget.elapsed(), 3), "what": what})
        write_json_atomic(out / "check.json", summary)

    write("device.json", device_info.device_report())
    event("device.json written")
    measure_decode(plan, budget, plan.gather_share * budget_s, lambda weights, r: write(f"decode-{weights}.json", r))
    event("decode files written")
    gather = row_gather.run_row_gather(plan.gather, budget.over, lambda r: write("row_gather.json", row_gather.add_fits(r)))
    event(f"row_gather.json written ({'complete' if gather['complete'] else 'stopped by the budget'})")
    summary["elapsed_s"] = budget.elapsed()
    summary["stopped_by_budget"] = budget.over()
    write_json_atomic(out / "check.json", summary)
    return summary
