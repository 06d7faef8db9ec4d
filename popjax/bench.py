"""``popjax bench``: decode speed of every method against the memory roofline and transformers.

One process measures, for dense and for static/POP/dynamic at each ratio, at each batch size:
time to first token (warm prefill), decode tokens/s (medians of repeats, interleaved across all
configurations), compile time and count, zero-recompile across prompts of one bucket, and the
process's peak RSS. The machine's memory bandwidth comes from a large GEMV, measured between the
rounds; the roofline of a method is bandwidth / bytes read per decode step (weights + KV cache)
× batch.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import resource
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import engine
from .convert.default_model import DEFAULT_MODEL
from .flops import flops_report
from .generation import generate_ids, pad_batch, pad_token_id
from .loading import LoadedModel, load
from .methods import Method, make_method, method_fields, method_label, parse_method_spec
from .methods.base import Plan
from .models.config import ModelConfig

log = logging.getLogger(__name__)

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


def ffn_bytes_per_step(cfg: ModelConfig, plan: Plan, batch: int, itemsize: int) -> int:
    """Bytes of FFN weights one decode step reads (all layers), as the plan counts them."""
    return cfg.num_hidden_layers * plan.ffn_weights_read_per_step(cfg.hidden_size, batch) * itemsize


def bytes_per_step(cfg: ModelConfig, plan: Plan, batch: int, cache_slots: int, itemsize: int) -> int:
    """Weights (attention, FFN, LM head) plus the KV cache read by one decode step."""
    attention = cfg.num_hidden_layers * cfg.attention_params_per_layer() * itemsize
    head = cfg.vocab_size * cfg.hidden_size * itemsize
    kv = 2 * cfg.num_hidden_layers * cache_slots * cfg.kv_dim * itemsize * batch
    return attention + head + ffn_bytes_per_step(cfg, plan, batch, itemsize) + kv


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
        self.method, self.batch, self.max_new_tokens = method, len(prompts), max_new_tokens
        plan = method.bind(model.config)
        tokens, mask = (jnp.asarray(a) for a in pad_batch(prompts, pad_token_id(model)))
        self._run = lambda: generate_ids(model, prompts, max_new_tokens, method=method, ignore_eos=True)[0]
        self._prefill = lambda: engine.prefill(model.graphdef, model.params, tokens, mask, plan)[0]
        before = sum(engine.compile_counts().values())
        self.first_s = _timed(self._run)
        self.compiles = sum(engine.compile_counts().values()) - before
        self.ttft, self.total = [], []

    def repeat(self) -> None:
        self.ttft.append(_timed(self._prefill))
        self.total.append(_timed(self._run))

    def stats(self) -> dict[str, Any]:
        ttft, total = float(np.median(self.ttft)), float(np.median(self.total))
        return {
            "ttft_s": ttft,
            "decode_tokens_per_s": self.batch * (self.max_new_tokens - 1) / max(total - ttft, 1e-9),
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


def bench_transformers(gguf_path: Path, texts: list[str], batches: list[int], max_new_tokens: int, repeats: int):
    """transformers' generate (PyTorch CPU, fp32, greedy) on the same prompts, or None without torch."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        return None
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.padding_side = "left"
    hf = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32).eval()
    out = {"torch_threads": torch.get_num_threads(), "by_batch": {}}
    for batch in batches:
        enc = tok(texts[:batch], return_tensors="pt", padding=True)

        def gen(n):
            with torch.no_grad():
                hf.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)

        gen(2)
        first = float(np.median([_timed(lambda: gen(1)) for _ in range(repeats)]))
        total = float(np.median([_timed(lambda: gen(max_new_tokens)) for _ in range(repeats)]))
        out["by_batch"][str(batch)] = {
            "ttft_s": first,
            "decode_tokens_per_s": batch * (max_new_tokens - 1) / max(total - first, 1e-9),
        }
    out["decode_tokens_per_s"] = out["by_batch"][str(batches[0])]["decode_tokens_per_s"]
    return out


def run_suites(args: argparse.Namespace, model: LoadedModel, prompts: list[list[int]]) -> dict[str, Any]:
    """The engine suites of ``popjax.bench_suites`` that ``--suites`` names."""
    from tqdm.auto import tqdm

    from . import bench_suites as suites
    from .eval.data import DEV_PLAY, load_play

    out: dict[str, Any] = {}
    dense = make_method("dense")
    if "lengths" in args.suites:
        methods = [dense] + [(make_method(name, ratio=r) if "ratio" in method_fields(name) else make_method(name)).prepare(model)
                             for name in args.length_methods for r in args.ratios[:1]]
        out["lengths"] = suites.lengths_suite(
            model, methods, load_play(DEV_PLAY), args.prompt_lengths, args.batches, args.length_new_tokens, args.repeats,
            progress=lambda jobs: tqdm(jobs, desc="prompt lengths", unit="run"),
        )
    if "capacity" in args.suites:
        out["capacity"] = suites.capacity_suite(model, dense, prompts[0], 64, [64, 4096], args.repeats)
    if "stream" in args.suites:
        out["stream"] = suites.stream_suite(model, dense, prompts[0], 64, args.repeats)
    if "memory" in args.suites:
        out["memory"] = suites.memory_suite(model, dense, 8192)
    return out


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm.auto import tqdm

    model = load(args.model, dtype=args.dtype, scan_layers=args.scan_layers)
    cfg, tok = model.config, model.tokenizer
    itemsize = jnp.dtype(model.dtype).itemsize
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True) for p in BENCH_PROMPTS]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    # a method is a name or a spec with hyper-parameters ("pop-shortlist:gamma=1.0:shortlist=0.75")
    takes_ratio = lambda spec: "ratio" in method_fields(spec.split(":")[0])  # noqa: E731
    label = lambda method: method_label(method, exclude=("ratio", "aggregate"))  # noqa: E731  as popjax frontier labels it
    methods = [make_method("dense")] + [
        parse_method_spec(spec, ratio=r) for spec in args.methods if takes_ratio(spec) for r in args.ratios
    ] + [parse_method_spec(spec) for spec in args.methods if spec != "dense" and not takes_ratio(spec)]
    methods = [m.prepare(model) for m in methods]  # offline methods calibrate once (cached)
    bandwidth = [measure_bandwidth()]
    if "decode" not in args.suites:
        methods = []
    runs = [
        MethodRun(model, method, [prompts[i % len(prompts)] for i in range(batch)], args.max_new_tokens)
        for method in tqdm(methods, desc="compile", unit="method")
        for batch in args.batches
    ]
    for _ in tqdm(range(args.repeats), desc="bench repeats", unit="round"):
        for run in runs:  # round-robin over configurations
            run.repeat()
        bandwidth.append(measure_bandwidth())
    records = []
    for run in runs:
        plan = run.method.bind(cfg)
        length = engine.bucket_for(max(map(len, prompts[: run.batch])), engine.PROMPT_BUCKETS, "a prompt length")
        slots = length + engine.bucket_for(args.max_new_tokens, engine.CAPACITY_BUCKETS, "max_new_tokens")
        records.append({
            "method": run.method.name,
            "label": label(run.method),
            "ratio": getattr(run.method, "ratio", 0.0),
            "batch": run.batch,
            **run.stats(),
            "bytes_per_step": bytes_per_step(cfg, plan, run.batch, slots, itemsize),
            "peak_rss_mb": _peak_rss_mb(),
            "ffn_flops_overhead_vs_static": flops_report(cfg, run.method)["overhead_vs_static_of_dense"],
        })
    for method in methods:
        count = recompiles_across_prompts(model, method, prompts[0])
        for rec in records:
            if rec["label"] == label(method) and rec["ratio"] == getattr(method, "ratio", 0.0):
                rec["recompiles_across_20_prompts"] = count
    bw = float(np.median(bandwidth))
    for rec in records:
        roofline = rec["batch"] * bw * 1e9 / rec["bytes_per_step"]
        rec["roofline_tokens_per_s"] = roofline
        rec["roofline_fraction"] = rec["decode_tokens_per_s"] / roofline
    result = {
        "model": str(args.model),
        "dtype": model.dtype,
        "scan_layers": args.scan_layers,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "devices": [str(d) for d in jax.devices()]},
        "bandwidth_gb_s": bw,
        "bandwidth_samples_gb_s": bandwidth,
        "records": records,
        "suites": run_suites(args, model, prompts),
        "transformers": None,
    }
    if "decode" in args.suites and not args.no_transformers and args.model == DEFAULT_MODEL:
        from .convert.default_model import default_gguf_path

        result["transformers"] = bench_transformers(default_gguf_path(), texts, args.batches, args.max_new_tokens, args.repeats)
    return result


def format_table(result: dict[str, Any]) -> str:
    """A markdown table of the records, with speedups over dense at the same batch."""
    dense = {r["batch"]: r["decode_tokens_per_s"] for r in result["records"] if r["method"] == "dense"}
    hf = (result.get("transformers") or {}).get("by_batch", {})
    lines = [
        f"memory bandwidth (large GEMV): {result['bandwidth_gb_s']:.1f} GB/s",
        "",
        "| method | ratio | batch | decode tok/s | × dense | × transformers | roofline tok/s | roofline % | TTFT ms | compile s | recompiles (20 prompts) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["records"]:
        hf_tps = hf.get(str(r["batch"]), {}).get("decode_tokens_per_s")
        lines.append(
            f"| {r.get('label', r['method'])} | {r['ratio']:.2f} | {r['batch']} | {r['decode_tokens_per_s']:.1f} | "
            f"{r['decode_tokens_per_s'] / dense[r['batch']]:.2f} | {r['decode_tokens_per_s'] / hf_tps if hf_tps else float('nan'):.2f} | "
            f"{r['roofline_tokens_per_s']:.1f} | {100 * r['roofline_fraction']:.0f} | {1000 * r['ttft_s']:.0f} | "
            f"{r['compile_s']:.1f} | {r.get('recompiles_across_20_prompts', '-')} |"
        )
    for batch, row in hf.items():
        lines.append(f"\ntransformers generate, batch {batch}: {row['decode_tokens_per_s']:.1f} tok/s")
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


def _cmd_bench(args: argparse.Namespace) -> None:
    result = run_bench(args)
    if result["records"]:
        print(format_table(result))
    print(format_suites(result["suites"]))
    if args.json:
        write_json_atomic(Path(args.json), result)


def write_json_atomic(path: Path, payload: Any) -> None:
    """Writes JSON through a temp file and a rename, so a crash never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(path)


def register_cli(sub) -> None:
    p = sub.add_parser("bench", help="decode speed of the methods vs the roofline and transformers")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: bfloat16 on GPU/TPU, float32 on CPU)")
    p.add_argument("--scan-layers", action="store_true", help="run the layers under lax.scan (docs/performance.md)")
    p.add_argument("--methods", type=lambda s: s.split(","), default=["static", "pop", "dynamic"])
    p.add_argument("--ratios", type=lambda s: [float(x) for x in s.split(",")], default=[0.2, 0.4])
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    p.add_argument("--suites", type=lambda s: s.split(","), default=["decode"],
                   help="any of decode (methods × batches), lengths (TTFT by prompt length), capacity, stream, memory")
    p.add_argument("--prompt-lengths", type=lambda s: [int(x) for x in s.split(",")], default=[128, 512, 2048])
    p.add_argument("--length-methods", type=lambda s: s.split(","), default=["pop"],
                   help="methods of the lengths suite besides dense (first --ratios value)")
    p.add_argument("--length-new-tokens", type=int, default=32)
    p.add_argument("--json", default=None, help="write the results here")
    p.set_defaults(run=_cmd_bench)
