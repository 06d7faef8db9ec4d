"""Engine benchmark suites beside ``popjax bench``'s method × batch table:

* ``lengths``: time to first token and decode tokens/s at several prompt lengths and batches,
  per method (prefill is where long prompts spend their time);
* ``capacity``: decode tokens/s of the same generation with the cache sized for 64 vs 4096 new
  tokens (decode attention must cost what the sequence needs, not the buffer);
* ``stream``: ``popjax.stream`` tokens/s against the compiled loop's;
* ``memory``: XLA's memory analysis of a long-prompt prefill (no ``T × T`` score buffer).

Each suite returns JSON-ready records; timings are medians of ``repeats`` runs after a warm-up.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from .. import engine
from ..generation import stream_ids
from ..requests import GenerationRequest
from ..loaded import LoadedModel
from ..methods import Method, method_label
from ..kernels.attention import cache_slots


def median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """The median over ``repeats`` calls of ``fn``'s wall time, each waited on (its JAX results ready)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def text_prompts(model: LoadedModel, text: str, length: int, batch: int) -> list[list[int]]:
    """``batch`` prompts of exactly ``length`` tokens cut from real text at different offsets."""
    ids = model.tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < length + batch:
        raise ValueError(f"the text has {len(ids)} tokens; {batch} prompts of {length} need more")
    starts = np.linspace(0, len(ids) - length, batch).astype(int)
    return [ids[s : s + length] for s in starts]


def time_generation(model: LoadedModel, method: Method, prompts: list[list[int]], new_tokens: int, repeats: int, capacity: int | None = None) -> dict[str, float]:
    """TTFT (prefill + first token) and decode tokens/s of the compiled loop, medians."""
    req = GenerationRequest.create(model, prompts, new_tokens, method=method, ignore_eos=True, capacity=capacity)
    run = lambda: req.decode(model, req.start(model)[0], new_tokens)[0]
    start = lambda: req.start(model)[0].token
    run()  # compile both programs
    ttft, total = median_seconds(start, repeats), median_seconds(run, repeats)
    return {
        "ttft_s": ttft,
        "decode_tokens_per_s": len(prompts) * (new_tokens - 1) / max(total - ttft, 1e-9),
        "cache_slots": cache_slots(int(req.tokens.shape[1]), req.capacity),
    }


def lengths_suite(model, methods: list[Method], text: str, lengths: list[int], batches: list[int], new_tokens: int, repeats: int, progress=None) -> list[dict]:
    """TTFT and decode tokens/s for each (method, prompt length, batch)."""
    records = []
    jobs = [(m, n, b) for n in lengths for b in batches for m in methods]
    for method, length, batch in progress(jobs) if progress else jobs:
        stats = time_generation(model, method, text_prompts(model, text, length, batch), new_tokens, repeats)
        records.append({"method": method.name, "label": method_label(method), "prompt_tokens": length, "batch": batch, **stats})
    for rec in records:  # TTFT speed-up over dense at the same length and batch
        dense = [r for r in records if r["method"] == "dense" and r["prompt_tokens"] == rec["prompt_tokens"] and r["batch"] == rec["batch"]]
        if dense:
            rec["ttft_speedup_vs_dense"] = dense[0]["ttft_s"] / rec["ttft_s"]
            rec["decode_vs_dense"] = rec["decode_tokens_per_s"] / dense[0]["decode_tokens_per_s"]
    return records


def capacity_suite(model, method: Method, prompt: list[int], new_tokens: int, capacities: list[int], repeats: int) -> list[dict]:
    """The same generation with caches sized for each capacity: decode tokens/s should not move."""
    records = [
        {"capacity": capacity, **time_generation(model, method, [prompt], new_tokens, repeats, capacity=capacity)}
        for capacity in capacities
    ]
    for rec in records:
        rec["decode_vs_smallest"] = rec["decode_tokens_per_s"] / records[0]["decode_tokens_per_s"]
    return records


def stream_suite(model, method: Method, prompt: list[int], new_tokens: int, repeats: int) -> dict[str, float]:
    """Tokens/s of the streaming step loop (one host round trip per token) vs the compiled loop."""
    def streamed():
        return list(stream_ids(model, prompt, new_tokens, method=method, ignore_eos=True))

    streamed()
    loop = time_generation(model, method, [prompt], new_tokens, repeats)
    total = median_seconds(streamed, repeats)
    stream_tps = (new_tokens - 1) / max(total - loop["ttft_s"], 1e-9)
    before = engine.compile_counts()["stream_step"]
    streamed()
    return {
        "loop_tokens_per_s": loop["decode_tokens_per_s"],
        "stream_tokens_per_s": stream_tps,
        "stream_vs_loop": stream_tps / loop["decode_tokens_per_s"],
        "stream_recompiles": engine.compile_counts()["stream_step"] - before,
    }


def memory_suite(model: LoadedModel, method: Method, prompt_tokens: int, batch: int = 1) -> dict[str, Any]:
    """XLA's memory analysis of the prefill program at ``prompt_tokens`` (compiled on abstract
    shapes: nothing runs), against the size of the full fp32 score tensor it avoids."""
    plan = method.bind(model.config)
    tokens = jax.ShapeDtypeStruct((batch, prompt_tokens), jnp.int32)
    compiled = engine.prefill.lower(model.graphdef, model.params, tokens, tokens, plan, data=method.data(model)).compile()
    analysis = compiled.memory_analysis()
    scores = batch * model.config.num_attention_heads * prompt_tokens * prompt_tokens * 4
    return {
        "prompt_tokens": prompt_tokens,
        "batch": batch,
        "temp_bytes": int(analysis.temp_size_in_bytes),
        "argument_bytes": int(analysis.argument_size_in_bytes),
        "output_bytes": int(analysis.output_size_in_bytes),
        "full_score_tensor_bytes": scores,
        "temp_vs_score_tensor": analysis.temp_size_in_bytes / scores,
    }
