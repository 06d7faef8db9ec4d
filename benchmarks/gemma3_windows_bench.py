"""Sliding windows on Gemma 3, measured: decode speed against the context, and Prefill-Only's TTFT
when skipped sliding layers project K/V for the last window of the prompt only.

    python benchmarks/gemma3_windows_bench.py --json results/gemma3/windows_cpu.json

1. **Decode vs context.** A random Gemma 3 whose layers all slide (window 512) decodes after a
   512-token and after a 4096-token prompt: the ring buffers hold 512 slots either way, so decode
   tokens/s should not move (within 10%). The same model with every layer full (no windows)
   reads 8x the cache at 4096: the contrast.
2. **Prefill-Only TTFT.** A random Gemma 3 in the 270M's layout (18 layers, every 6th full,
   window 512; a smaller vocabulary) with `PrefillOnly()` (the last third skipped in prefill):
   TTFT with the skipped sliding layers projecting K/V for the last `window` prompt tokens (what
   popjax does) against projecting them for the whole prompt (the model's `_bypass_cache` with
   the window ignored, patched for this measurement only), and dense, at 4096 prompt tokens.

Random weights: speed depends on shapes only. Timings are medians (popjax.bench.suites); run it
alone on the machine. Writes JSON (atomically) and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

import popjax
from popjax.bench.suites import time_generation
from popjax.files import write_json_atomic
from popjax.generation import GenerationRequest
from popjax.models import decoder


def random_gemma(directory: Path, layer_types: list[str], window: int, vocab: int = 8192, hidden: int = 512,
                 ffn: int = 2048, heads: int = 8, kv_heads: int = 4, head_dim: int = 64) -> popjax.LoadedModel:
    """A random transformers Gemma 3 saved to ``directory`` and loaded (fp32, unrolled)."""
    import torch  # heavy: torch and transformers only to make the random checkpoint
    import transformers  # heavy: see above

    config = transformers.Gemma3TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=len(layer_types),
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, query_pre_attn_scalar=head_dim,
        sliding_window=window, layer_types=layer_types, max_position_embeddings=16384,
    )
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(config).save_pretrained(directory)
    return popjax.load(directory, cache=False)


def prompts(vocab: int, length: int, batch: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(length)
    return rng.integers(3, vocab, (batch, length)).tolist()


@contextlib.contextmanager
def full_prompt_kv():
    """Skipped sliding layers project K/V for every prompt token (the window ignored): the
    baseline the windowed projection is measured against. Compiled programs are dropped on
    entry and exit so neither variant reuses the other's."""
    original = decoder._bypass_cache
    jax.clear_caches()
    decoder._bypass_cache = lambda layer, x, cos, sin, mode, override=None, window=None: original(
        layer, x, cos, sin, mode, override, None)
    try:
        yield
    finally:
        decoder._bypass_cache = original
        jax.clear_caches()


def decode_seconds(model, req: GenerationRequest, new_tokens: int) -> float:
    """One run of the compiled decode loop, timed from a finished prefill: at a long context,
    total − TTFT (what `time_generation` reports) is the difference of two large numbers, and
    the prefill's noise swamps the decode."""
    carry = jax.block_until_ready(req.start(model)[0])
    start = time.perf_counter()
    jax.block_until_ready(req.decode(model, carry, new_tokens)[0])
    return time.perf_counter() - start


def decode_vs_context(work: Path, contexts: list[int], new_tokens: int, repeats: int) -> list[dict]:
    """Decode tokens/s after a prompt of each context length, the contexts' runs interleaved
    (A B A B ...) so that drift of the machine's speed falls on all of them alike."""
    records = []
    for kind in ("sliding_attention", "full_attention"):
        model = random_gemma(work / kind, [kind] * 4, window=512)
        reqs = {c: GenerationRequest.create(model, prompts(model.config.vocab_size, c), new_tokens, ignore_eos=True)
                for c in contexts}
        for c in contexts:  # compile
            decode_seconds(model, reqs[c], new_tokens)
        times = {c: [] for c in contexts}
        for _ in range(repeats):
            for c in contexts:
                times[c].append(decode_seconds(model, reqs[c], new_tokens))
        for c in contexts:
            records.append({"layers": f"4 x {kind}", "window": 512, "context": c, "new_tokens": new_tokens,
                            "decode_tokens_per_s": (new_tokens - 1) / float(np.median(times[c])),
                            "runs_tokens_per_s": [(new_tokens - 1) / t for t in times[c]]})
        base = records[-len(contexts)]["decode_tokens_per_s"]
        for rec in records[-len(contexts):]:
            rec["decode_vs_shortest_context"] = rec["decode_tokens_per_s"] / base
    return records


def prefill_only_ttft(work: Path, prompt_tokens: int, repeats: int) -> list[dict]:
    kinds = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)]
    model = random_gemma(work / "gemma-270m-layout", kinds, window=512, hidden=640, ffn=2048, heads=4, kv_heads=1,
                         head_dim=256)
    batch = prompts(model.config.vocab_size, prompt_tokens)
    po = popjax.PrefillOnly()
    ttft = lambda method: time_generation(model, method, batch, 8, repeats)["ttft_s"]
    runs = {"dense": [], "window": [], "whole": []}
    for _ in range(2):  # alternate the variants (each switch recompiles), so drift falls on both alike
        runs["dense"].append(ttft(popjax.Dense()))
        runs["window"].append(ttft(po))
        with full_prompt_kv():
            runs["whole"].append(ttft(po))
    labels = {"dense": "dense", "window": "prefill-only (skipped sliding layers: K/V of the last window)",
              "whole": "prefill-only (skipped sliding layers: K/V of the whole prompt)"}
    records = [{"method": labels[k], "ttft_s": float(np.median(v)), "runs_ttft_s": v} for k, v in runs.items()]
    for rec in records:
        rec["ttft_speedup_vs_dense"] = records[0]["ttft_s"] / rec["ttft_s"]
    records[1]["ttft_gain_vs_full_kv"] = records[2]["ttft_s"] / records[1]["ttft_s"]
    skipped = po.bind(model.config).skipped
    return [{**r, "prompt_tokens": prompt_tokens, "skipped_layers": list(skipped),
             "skipped_sliding": [l for l in skipped if model.config.window(l)]} for r in records]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default="results/gemma3/windows_cpu.json")
    parser.add_argument("--contexts", default="512,4096")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=4096, help="prompt tokens of the Prefill-Only TTFT measurement")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        decode = decode_vs_context(work, [int(c) for c in args.contexts.split(",")], args.new_tokens, args.repeats)
        ttft = prefill_only_ttft(work, args.prompt, args.repeats)
    result = {"machine": platform.processor() or platform.machine(), "jax": jax.__version__,
              "command": "python benchmarks/gemma3_windows_bench.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
              "decode_vs_context": decode, "prefill_only_ttft": ttft}
    write_json_atomic(Path(args.json), result)
    for rec in decode:
        print(f"{rec['layers']:>22}  context {rec['context']:5d}: {rec['decode_tokens_per_s']:7.1f} tok/s "
              f"({rec['decode_vs_shortest_context']:.2f}x of the shortest context)")
    for rec in ttft:
        print(f"{rec['method']:>62}: TTFT {rec['ttft_s'] * 1e3:8.1f} ms ({rec['ttft_speedup_vs_dense']:.2f}x dense)")
    print(json.dumps({"written": args.json}))


if __name__ == "__main__":
    main()
