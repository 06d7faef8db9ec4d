"""``popjax bench``: decode speed of every method against the memory roofline and transformers.

One process measures, for dense and for static/POP/dynamic at each ratio, at each batch size:
time to first token (warm prefill), decode tokens/s (medians of repeats, interleaved across all
configurations), compile time and count, zero-recompile across prompts of one bucket, and the
process's peak RSS. The machine's memory bandwidth comes from a large GEMV, measured between the
rounds; the roofline of a method is bandwidth / bytes read per decode step (weights + KV cache)
× batch.
"""

from __future__ import annotations

import dataclasses
import logging
import platform
import resource
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from .. import engine
from ..analysis.flops import bytes_per_step, flops_report
from ..convert.default_model import DEFAULT_MODEL, default_gguf_path
from ..data import DEV_PLAY, load_play
from ..generation import generate_ids
from ..requests import pad_batch, pad_token_id
from ..loaded import LoadedModel
from ..loading import default_dtype, load
from ..methods import Method, make_method, method_label, sweep
from ..kernels import fallback
from ..kernels.int8 import WEIGHT_FORMATS
from . import suites, synthetic
from .peers import bench_peers

log = logging.getLogger(__name__)

SUITES = ("decode", "lengths", "capacity", "stream", "memory")
SYNTHETIC_PROMPT_TOKENS = 32  # a synthetic run's random prompts: about the length of BENCH_PROMPTS' chat prompts


@dataclasses.dataclass
class BenchSettings:
    """What `run_bench` measures (one field per ``popjax bench`` flag, with its default).
    Constructing it validates every field, so bad values fail before a model is loaded.

    methods: names or specs with hyper-parameters ("pop-shortlist:gamma=1.0:shortlist=0.75");
    those that take a ratio run at each of ``ratios``, dense always runs. suites: any of
    `SUITES` (decode: methods × batches; lengths: TTFT by prompt length for dense and
    ``length_methods`` at the first ratio; capacity, stream, memory). transformers: also time
    transformers' generate on the default model (decode suite, needs torch)."""

    model: Any = DEFAULT_MODEL
    dtype: str | None = None
    weights: Sequence[str] = ("float",)  # weight formats (popjax.load), each a model of its own in the one run
    scan_layers: bool = False
    methods: Sequence[str] = ("static", "pop", "dynamic")
    ratios: Sequence[float] = (0.2, 0.4)
    batches: Sequence[int] = (1, 8)
    max_new_tokens: int = 64
    repeats: int = 3
    transformers: bool = True
    suites: Sequence[str] = ("decode",)
    prompt_lengths: Sequence[int] = (128, 512, 2048)
    length_methods: Sequence[str] = ("pop",)
    length_new_tokens: int = 32
    mesh: Any = None  # a popjax.sharding.make_mesh mesh (a multi-host run's global mesh), None: one device
    # random weights of a shipped config or a config.json drawn on the device instead of loading
    # ``model`` (popjax.bench.synthetic): random token ids, offline methods with placeholder fits
    synthetic: str | None = None
    layers: int | None = None  # the synthetic model's first N layers (None: all)

    def __post_init__(self) -> None:
        _check_ints("batches", self.batches, 1, example="1,8")
        _check_ints("prompt_lengths", self.prompt_lengths, 1, engine.PROMPT_BUCKETS[-1], example="128,512,2048")
        top = engine.CAPACITY_BUCKETS[-1]
        for name in ("max_new_tokens", "length_new_tokens"):  # the first token comes from prefill
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 2 <= value <= top:
                raise ValueError(f"{name}={value!r} is invalid; decode speed needs an integer in [2, {top}] (the first token comes from prefill)")
        formats = list(self.weights)
        unknown = [w for w in formats if w not in WEIGHT_FORMATS]
        if not formats or unknown:
            raise ValueError(f"weights={formats}: {_what(unknown, 'is not a weight format')}; choose from {', '.join(WEIGHT_FORMATS)}")
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"repeats={self.repeats!r} is invalid; use an integer ≥ 1")
        ratios = list(self.ratios)
        bad = [r for r in ratios if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r < 1.0]
        if not ratios or bad:
            raise ValueError(f"ratios={ratios}: {_what(bad)}; give global pruning ratios in [0, 1), e.g. 0.2,0.4")
        suites = list(self.suites)
        unknown = [x for x in suites if x not in SUITES]
        if not suites or unknown:
            raise ValueError(f"suites={suites}: {_what(unknown, 'is not a suite')}; choose from {', '.join(SUITES)}")
        for name in ("methods", "length_methods"):
            specs = list(getattr(self, name))
            if not all(isinstance(spec, str) and spec.strip() for spec in specs):
                raise ValueError(f"{name}={specs}: a method name is empty; give names or specs, e.g. static,pop,dynamic")
        bench_methods(self)  # unknown names and bad hyper-parameters: MethodError naming them
        length_methods(self)
        synthetic.check_run(self.synthetic, self.layers, self.suites, self.mesh)


def _what(bad: list, why: str = "is invalid") -> str:
    return f"{bad[0]!r} {why}" if bad else "none is given"


def _check_ints(name: str, values: Sequence[int], low: int, high: int | None = None, *, example: str) -> None:
    """Every value an integer in [low, high]; ValueError naming the first bad one and the range."""
    values = list(values)
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < low or (high is not None and v > high)]
    if not values or bad:
        valid = f"integers ≥ {low}" if high is None else f"integers in [{low}, {high}]"
        raise ValueError(f"{name}={values}: {_what(bad)}; give {valid}, e.g. {example}")


def bench_methods(settings: BenchSettings) -> list[Method]:
    """The decode suite's methods, not prepared: dense, each ratio method at each ratio, then the
    methods without a ratio."""
    s = settings
    swept = sweep([spec for spec in s.methods if spec != "dense"], s.ratios)
    takes_ratio = lambda m: m.ffn_method.takes_ratio() or m.takes_ratio()
    return ([make_method("dense")] + [m for _, m in swept if takes_ratio(m)]
            + [m for _, m in swept if not takes_ratio(m)])


def length_methods(settings: BenchSettings) -> list[Method]:
    """The lengths suite's methods besides dense, not prepared (at the first ratio)."""
    s = settings
    return [m for _, m in sweep(s.length_methods, s.ratios[:1])]


BENCH_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that checks whether a number is prime.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for sleeping better.",
    "Translate 'good morning, my friend' into Spanish and German.",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "What are the main differences between a list and a tuple in Python?",
    "Write a short poem about autumn leaves falling in the wind.",
]


def measure_bandwidth(megabytes: int = 256, repeats: int = 10) -> float:
    """GB/s of a jitted fp32 GEMV over a matrix of ``megabytes`` (median of repeats)."""
    n = int((megabytes * 2**20 / 4) ** 0.5)
    w = jnp.ones((n, n), jnp.float32)
    x = jnp.ones((n,), jnp.float32)
    gemv = jax.jit(lambda w, x: w @ x)
    gemv(w, x).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        gemv(w, x).block_until_ready()
        times.append(time.perf_counter() - start)
    return n * n * 4 / float(np.median(times)) / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class MethodRun:
    """One (method, batch) configuration: compiled on creation, then timed one repeat at a time
    so that the repeats of all configurations interleave (drift on a shared machine then hits
    every configuration alike)."""

    def __init__(self, model: LoadedModel, method: Method, prompts: list[list[int]], max_new_tokens: int):
        self.model, self.method, self.batch, self.max_new_tokens = model, method, len(prompts), max_new_tokens
        plan = method.bind(model.config)
        tokens, mask = (jnp.asarray(a) for a in pad_batch(prompts, pad_token_id(model)))
        self._run = lambda: generate_ids(model, prompts, max_new_tokens, method=method, ignore_eos=True)[0]
        data = method.data(model)
        self._prefill = lambda: engine.prefill(model.graphdef, model.params, tokens, mask, plan, data=data)[0]
        before = sum(engine.compile_counts().values())
        self.first_s = _timed(self._run)
        self.compiles = sum(engine.compile_counts().values()) - before
        self.ttft, self.total = [], []

    def repeat(self) -> None:
        self.ttft.append(_timed(self._prefill))
        self.total.append(_timed(self._run))

    def stats(self) -> dict[str, Any]:
        ttft, total = float(np.median(self.ttft)), float(np.median(self.total))
        # each repeat's decode time is its generate minus the prefill timed just before it: a
        # difference of two separate medians could come out near zero (absurd tokens/s) when the
        # decode is short against the prefill's own noise
        decode = float(np.median(np.subtract(self.total, self.ttft)))
        return {
            "ttft_s": ttft,
            "decode_s": decode,
            # None when generate took no longer than its prefill (a decode too short for the timer's
            # noise): not a speed, and never an absurd one
            "decode_tokens_per_s": self.batch * (self.max_new_tokens - 1) / decode if decode > 0 else None,
            "generate_s": total,
            "compile_s": max(self.first_s - total, 0.0),
            "compiles": self.compiles,
        }


def recompiles_across_prompts(model: LoadedModel, method: Method, vocab_ids: list[int], n: int = 20) -> int:
    """Generates for ``n`` prompts of different lengths within one bucket; returns new compiles."""
    rng = np.random.default_rng(0)
    lengths = np.linspace(max(2, len(vocab_ids) // 4), 32, n).astype(int)
    generate_ids(model, [vocab_ids[:2]], 4, method=method, ignore_eos=True)  # compile the bucket
    before = sum(engine.compile_counts().values())
    for length in lengths:
        ids = rng.choice(vocab_ids, size=int(length)).tolist()
        generate_ids(model, [ids], int(rng.integers(2, 6)), method=method, ignore_eos=True)
    return sum(engine.compile_counts().values()) - before


def run_suites(settings: BenchSettings, model: LoadedModel, prompts: list[list[int]]) -> dict[str, Any]:
    """The engine suites of `popjax.bench.suites` that ``settings.suites`` names."""
    s = settings
    out: dict[str, Any] = {}
    dense = make_method("dense")
    if "lengths" in s.suites:
        methods = [dense] + [m.prepare(model) for m in length_methods(s)]
        out["lengths"] = suites.lengths_suite(
            model, methods, load_play(DEV_PLAY), s.prompt_lengths, s.batches, s.length_new_tokens, s.repeats,
            progress=lambda jobs: tqdm(jobs, desc="prompt lengths", unit="run"),
        )
    if "capacity" in s.suites:
        out["capacity"] = suites.capacity_suite(model, dense, prompts[0], 64, [64, 4096], s.repeats)
    if "stream" in s.suites:
        out["stream"] = suites.stream_suite(model, dense, prompts[0], 64, s.repeats)
    if "memory" in s.suites:
        out["memory"] = suites.memory_suite(model, dense, 8192)
    return out


def run_bench(settings: BenchSettings) -> dict[str, Any]:
    """Loads ``settings.model`` and measures what ``settings`` asks -> the JSON-ready result
    (``records`` of the decode suite, ``suites``, ``transformers``)."""
    s = settings
    methods = bench_methods(s)  # before the (slow) load: a bad spec fails at once
    texts: list[str] = []
    if s.synthetic is None:
        models = {w: load(s.model, dtype=s.dtype, scan_layers=s.scan_layers, weights=w, mesh=s.mesh) for w in dict.fromkeys(s.weights)}
        tok = next(iter(models.values())).tokenizer
        texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True) for p in BENCH_PROMPTS]
        prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        prepared = {w: [m.prepare(m_) for m in methods] for w, m_ in models.items()}  # offline methods calibrate once (cached)
    else:  # random weights on the device, random ids, placeholder fits (popjax.bench.synthetic)
        dtype = s.dtype or default_dtype()
        models = {w: synthetic.synthetic_model(synthetic.synthetic_config(s.synthetic, s.layers, w), dtype, s.scan_layers,
                                               source=f"{synthetic.SYNTHETIC_PREFIX}{s.synthetic}") for w in dict.fromkeys(s.weights)}
        prompts = synthetic.random_prompts(next(iter(models.values())).config, len(BENCH_PROMPTS), SYNTHETIC_PROMPT_TOKENS)
        prepared = {w: [synthetic.fitted(m, m_.config) for m in methods] for w, m_ in models.items()}
    model = next(iter(models.values()))
    itemsize = jnp.dtype(model.dtype).itemsize
    label = lambda method: method_label(method, exclude=("ratio", "aggregate"))  # noqa: E731  as popjax frontier labels it
    bandwidth = [measure_bandwidth()]
    if "decode" not in s.suites:
        prepared = {w: [] for w in models}
    runs = [
        MethodRun(models[w], method, [prompts[i % len(prompts)] for i in range(batch)], s.max_new_tokens)
        for w, ms in prepared.items()
        for method in tqdm(ms, desc=f"compile ({w} weights)", unit="method")
        for batch in s.batches
    ]
    for _ in tqdm(range(s.repeats), desc="bench repeats", unit="round"):
        for run in runs:  # round-robin over configurations
            run.repeat()
        bandwidth.append(measure_bandwidth())
    records = []
    for run in runs:
        cfg = run.model.config
        plan = run.method.bind(cfg)
        length = engine.bucket_for(max(map(len, prompts[: run.batch])), engine.PROMPT_BUCKETS, "a prompt length")
        slots = length + engine.bucket_for(s.max_new_tokens, engine.CAPACITY_BUCKETS, "max_new_tokens")
        records.append({
            "method": run.method.name,
            "label": label(run.method),
            "ratio": run.method.reported()["ratio"],
            "batch": run.batch,
            "weights": cfg.weights,
            "kernel": fallback.ran(plan),  # what read the selected rows (kernels.RESOLVED), or "xla (fallback: ...)"
            **run.stats(),
            "bytes_per_step": bytes_per_step(cfg, plan, run.batch, slots, itemsize),
            "peak_rss_mb": _peak_rss_mb(),
            "ffn_flops_overhead_vs_static": flops_report(cfg, run.method)["overhead_vs_static_of_dense"],
            **({"fits": synthetic.fit_note(run.method, cfg)} if s.synthetic else {}),
        })
    for w, ms in prepared.items():
        for method in ms:
            count = recompiles_across_prompts(models[w], method, prompts[0])
            for rec in records:
                if rec["weights"] == w and rec["label"] == label(method) and rec["ratio"] == method.reported()["ratio"]:
                    rec["recompiles_across_20_prompts"] = count
    bw = float(np.median(bandwidth))
    for rec in records:
        roofline = rec["batch"] * bw * 1e9 / rec["bytes_per_step"]
        rec["roofline_tokens_per_s"] = roofline
        rec["roofline_fraction"] = None if rec["decode_tokens_per_s"] is None else rec["decode_tokens_per_s"] / roofline
    result = {
        "model": str(s.model),
        "dtype": model.dtype,
        "weights": list(models),
        "scan_layers": s.scan_layers,
        "max_new_tokens": s.max_new_tokens,
        "repeats": s.repeats,
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "devices": [str(d) for d in jax.devices()]},
        "bandwidth_gb_s": bw,
        "bandwidth_samples_gb_s": bandwidth,
        "records": records,
        "suites": run_suites(s, model, prompts),
        "transformers": None,
        "peers": {},
    }
    if s.synthetic is not None:
        result["model"] = f"{synthetic.SYNTHETIC_PREFIX}{s.synthetic}"
        result["synthetic"] = synthetic.describe(model.config, model.dtype, s.synthetic, seed=0)
    elif "decode" in s.suites and s.transformers and s.model == DEFAULT_MODEL:
        result["peers"] = bench_peers(default_gguf_path(), texts, list(s.batches), s.max_new_tokens, s.repeats)
        result["transformers"] = result["peers"].get("transformers")
    return result


def format_table(result: dict[str, Any]) -> str:
    """A markdown table of the records, with speedups over dense at the same batch."""
    dense = {(r.get("weights", "float"), r["batch"]): r["decode_tokens_per_s"] for r in result["records"] if r["method"] == "dense"}
    hf = (result.get("transformers") or {}).get("by_batch", {})
    lines = [
        f"memory bandwidth (large GEMV): {result['bandwidth_gb_s']:.1f} GB/s",
        "",
        "| method | weights | ratio | batch | decode tok/s | × dense (same weights) | × dense float | × transformers | roofline tok/s | roofline % | TTFT ms | compile s | recompiles (20 prompts) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    unmeasured = "n/m"  # a decode too short to time (decode_tokens_per_s is None)
    ratio = lambda a, b: unmeasured if a is None or not b else f"{a / b:.2f}"  # noqa: E731
    for r in result["records"]:
        tps = r["decode_tokens_per_s"]
        fraction = unmeasured if tps is None else f"{100 * r['roofline_fraction']:.0f}"
        tps_text = unmeasured if tps is None else f"{tps:.1f}"
        hf_tps = hf.get(str(r["batch"]), {}).get("decode_tokens_per_s")
        lines.append(
            f"| {r.get('label', r['method'])} | {r.get('weights', 'float')} | {r['ratio']:.2f} | {r['batch']} | "
            f"{tps_text} | {ratio(tps, dense[(r.get('weights', 'float'), r['batch'])])} | "
            f"{ratio(tps, dense.get(('float', r['batch'])))} | {ratio(tps, hf_tps)} | "
            f"{r['roofline_tokens_per_s']:.1f} | {fraction} | "
            f"{1000 * r['ttft_s']:.0f} | {r['compile_s']:.1f} | {r.get('recompiles_across_20_prompts', '-')} |"
        )
    if any(r["decode_tokens_per_s"] is None for r in result["records"]):
        lines.append(f"\n{unmeasured}: generate took no longer than its prefill; raise --max-new-tokens to time the decode")
    peers = result.get("peers") or ({"transformers": result["transformers"]} if result.get("transformers") else {})
    for peer in peers.values():
        for batch, row in peer["by_batch"].items():
            lines.append(f"\n{peer.get('engine', 'transformers')}, batch {batch}: {row['decode_tokens_per_s']:.1f} tok/s")
    return "\n".join(lines)


def format_suites(suites: dict[str, Any]) -> str:
    """Markdown for the engine suites present in ``suites``."""
    lines = []
    if "lengths" in suites:
        lines += ["", "| method | prompt tokens | batch | TTFT ms | TTFT × dense | decode tok/s | decode × dense |", "|---|---|---|---|---|---|---|"]
        for r in suites["lengths"]:
            lines.append(
                f"| {r['label']} | {r['prompt_tokens']} | {r['batch']} | {1000 * r['ttft_s']:.0f} | "
                f"{r.get('ttft_speedup_vs_dense', float('nan')):.2f} | {r['decode_tokens_per_s']:.1f} | {r.get('decode_vs_dense', float('nan')):.2f} |"
            )
    if "capacity" in suites:
        lines += ["", "| capacity | cache slots | decode tok/s | × smallest |", "|---|---|---|---|"]
        lines += [f"| {r['capacity']} | {r['cache_slots']} | {r['decode_tokens_per_s']:.1f} | {r['decode_vs_smallest']:.2f} |" for r in suites["capacity"]]
    if "stream" in suites:
        r = suites["stream"]
        lines.append(f"\nstreaming: {r['stream_tokens_per_s']:.1f} tok/s vs loop {r['loop_tokens_per_s']:.1f} ({100 * r['stream_vs_loop']:.0f}%), recompiles {r['stream_recompiles']}")
    if "memory" in suites:
        r = suites["memory"]
        lines.append(
            f"\nprefill at {r['prompt_tokens']} tokens: XLA temp {r['temp_bytes'] / 2**20:.0f} MiB "
            f"(a full fp32 score tensor would be {r['full_score_tensor_bytes'] / 2**20:.0f} MiB)"
        )
    return "\n".join(lines)
