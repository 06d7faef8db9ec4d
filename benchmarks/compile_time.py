"""Compile time of unrolled vs scanned decoder layers (models/scan.py), and decode speed.

1. Random LLaMA-style configs with small dims (d=64, 4 heads, 2 KV heads, f=128, vocabulary
   256) at 32 and 80 layers: for the unrolled and the scanned model, dense and POP, the time to
   trace+lower and to compile ``engine.start`` (prefill + first token) and ``engine.decode_loop``
   (``jax.jit(...).lower(...)`` then ``.compile()``, wall and process CPU seconds). Small dims
   make the weights irrelevant: what is measured is XLA's work on a program of L layers.
2. The real default model (SmolLM2-135M, 30 layers, ``popjax.load()``) unrolled vs
   ``popjax.load(scan_layers=True)``: decode tokens/s of the compiled decode loop at batch 1 for
   dense and POP(0.4) (``max_new_tokens`` tokens, medians of interleaved repeats), time to first
   token, the first call's compile time, and whether both generate the same tokens.

Writes results/engine/compile_time.json. Run on a quiet machine (the JSON records the load):

    python benchmarks/compile_time.py                      # ~10 min on 2 CPU cores
    python benchmarks/compile_time.py --layers 32 --skip-real
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import popjax  # noqa: E402
from popjax import engine  # noqa: E402
from popjax.bench.runner import BENCH_PROMPTS  # noqa: E402
from popjax.generation import GenerationRequest, encode_prompts  # noqa: E402
from popjax.loading import build_model  # noqa: E402
from popjax.models.config import ModelConfig  # noqa: E402

DIMS = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
PROMPT = [5, 17, 3, 99, 42, 7, 8, 9, 10, 11]


def random_model(layers: int, scan: bool, seed: int = 0):
    """A LLaMA-style model of ``layers`` layers with random weights (``DIMS``)."""
    cfg = ModelConfig(model_type="llama", num_hidden_layers=layers, rms_norm_eps=1e-6, rope_theta=10000.0,
                      max_position_embeddings=512, tie_word_embeddings=True, **DIMS)
    rng = np.random.default_rng(seed)
    d, f = cfg.hidden_size, cfg.intermediate_size
    w = lambda *shape: (rng.normal(size=shape) * 0.1).astype(np.float32)
    layer = lambda: {"attn_norm": {"weight": np.ones(d, np.float32)}, "mlp_norm": {"weight": np.ones(d, np.float32)},
                     "attn": {"q": w(cfg.q_dim, d), "k": w(cfg.kv_dim, d), "v": w(cfg.kv_dim, d), "o": w(d, cfg.q_dim)},
                     "mlp": {"gate": w(f, d), "up": w(f, d), "down": w(d, f)}}
    tree = {"embed": w(cfg.vocab_size, d), "final_norm": {"weight": np.ones(d, np.float32)},
            "layers": {str(i): layer() for i in range(layers)}}
    return build_model(cfg, tree, None, f"random-{layers}", "float32", scan_layers=scan)


def _clock(fn):
    """-> (result, wall s, process CPU s)."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def measure_compile(layers: int, scan: bool, method) -> dict:
    """Lower and compile times of ``engine.start`` and ``engine.decode_loop`` for one model."""
    model = random_model(layers, scan)
    req = GenerationRequest.create(model, [PROMPT], 64, method=method, ignore_eos=True)
    stops, pad = jnp.asarray(req.stops), jnp.int32(req.pad_id)
    start_args = (model.graphdef, model.params, req.plan, req.tokens, req.mask, req.key, req.sampling, stops, pad)
    lowered, start_lower_wall, start_lower_cpu = _clock(lambda: engine.start.lower(*start_args, capacity=req.capacity))
    compiled, start_wall, start_cpu = _clock(lowered.compile)
    carry, _ = compiled(*start_args[1:2], *start_args[3:])
    loop_args = (model.graphdef, model.params, req.plan, carry, jnp.int32(64), req.sampling, stops, pad)
    lowered, loop_lower_wall, loop_lower_cpu = _clock(lambda: engine.decode_loop.lower(*loop_args, capacity=req.capacity))
    _, loop_wall, loop_cpu = _clock(lowered.compile)
    row = {
        "layers": layers, "model": "scanned" if scan else "unrolled", "method": req.plan.name,
        "start_lower_s": start_lower_wall, "start_compile_s": start_wall,
        "decode_loop_lower_s": loop_lower_wall, "decode_loop_compile_s": loop_wall,
        "start_lower_cpu_s": start_lower_cpu, "start_compile_cpu_s": start_cpu,
        "decode_loop_lower_cpu_s": loop_lower_cpu, "decode_loop_compile_cpu_s": loop_cpu,
    }
    row["total_s"] = start_lower_wall + start_wall + loop_lower_wall + loop_wall
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    return row


def _decode_timing(model, method, prompt, max_new_tokens: int):
    """-> a function timing one generation: (TTFT s: prefill + first token, decode s of the
    compiled loop, tokens produced, the tokens)."""
    req = GenerationRequest.create(model, prompt, max_new_tokens, method=method, ignore_eos=True)

    def run():
        start = time.perf_counter()
        carry, _ = req.start(model)
        jax.block_until_ready(carry)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        tokens, steps, _, _ = req.decode(model, carry, max_new_tokens)
        jax.block_until_ready(tokens)
        return ttft, time.perf_counter() - start, int(steps), np.asarray(tokens)[0, :max_new_tokens].tolist()

    return run


def measure_real_decode(max_new_tokens: int, repeats: int) -> list[dict]:
    """Decode tokens/s of the default model, unrolled vs scanned, dense and POP(0.4), batch 1:
    the compiled decode loop alone (tokens after the first / its time), medians of ``repeats``
    interleaved runs after a first (compiling) run."""
    models = {"unrolled": popjax.load(), "scanned": popjax.load(scan_layers=True)}
    prompt = encode_prompts(models["unrolled"], [BENCH_PROMPTS[2]], None)
    methods = {"dense": popjax.Dense(), "pop-0.4": popjax.POP(ratio=0.4)}
    runs, first, times = {}, {}, {}
    for model in models:
        for name, method in methods.items():
            runs[model, name] = _decode_timing(models[model], method, prompt, max_new_tokens)
            (_, _, _, tokens), wall, _ = _clock(runs[model, name])
            first[model, name] = (wall, tokens)
            times[model, name] = []
    for _ in range(repeats):  # interleaved: drift on a shared machine hits every configuration alike
        for key, run in runs.items():
            times[key].append(run()[:3])
    rows = []
    for (model, name), samples in times.items():
        ttft, decode, steps = (float(np.median([t[i] for t in samples])) for i in range(3))
        steady = ttft + decode
        row = {"model": model, "method": name, "batch": 1, "max_new_tokens": max_new_tokens, "repeats": repeats,
               "ttft_s": ttft, "decode_s": decode, "decode_tokens_per_s": (steps - 1) / decode,
               "first_call_s": first[model, name][0], "compile_s": max(first[model, name][0] - steady, 0.0),
               "tokens_equal_unrolled": first[model, name][1] == first["unrolled", name][1]}
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[32, 80])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-real", action="store_true", help="skip the default model's decode speed")
    parser.add_argument("--skip-compile", action="store_true", help="keep the compile rows of an earlier --out")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "engine" / "compile_time.json")
    args = parser.parse_args(argv)
    load_start = os.getloadavg()
    if args.skip_compile:
        compile_rows = json.loads(args.out.read_text())["compile"]
    else:
        compile_rows = [
            measure_compile(layers, scan, method)
            for layers in args.layers
            for method in (popjax.Dense(), popjax.POP(ratio=0.2))
            for scan in (False, True)
        ]
    decode_rows = [] if args.skip_real else measure_real_decode(args.max_new_tokens, args.repeats)
    out = {
        "command": "python benchmarks/compile_time.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "jax": jax.__version__,
                    "backend": jax.default_backend(), "load_average_start": load_start, "load_average_end": os.getloadavg()},
        "random_config": DIMS,
        "compile": compile_rows,
        "decode_default_model": decode_rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
