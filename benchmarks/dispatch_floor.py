"""The floor of a batch-1 decode step on XLA:CPU: how many kernels one step launches, what one
launch costs, and what the weight bytes cost at the machine's bandwidth. Run alone:

    python benchmarks/dispatch_floor.py --json results/int8/dispatch_floor.json

* **Cost of a launch**: a jitted chain of small dependent kernels ([1, 576] vectors: an abs, a
  max reduction, an add; XLA cannot fuse them into fewer), timed and divided by the number of
  kernels in its compiled HLO. Each kernel's own work is nanoseconds, so this is the thunk
  executor's per-kernel overhead.
* **Kernels per step**: the kernels the compiled decode loop actually runs per step (the
  profiler's per-kernel events of a 64-token greedy decode, over its steps).
* **Step time**: decode time per token of the same decode, without the profiler.
* **Weight bytes**: `popjax.analysis.flops.bytes_per_step` (int8 weights count a byte each),
  at the fp32 GEMV bandwidth `popjax bench` measures.

The floor of a step is ``kernels × cost`` (launches that overlap nothing at batch 1) plus the
bytes' time; the JSON holds each part and what ``fp32 step / floor`` allows as a speed-up.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import popjax
from popjax.analysis.flops import bytes_per_step
from popjax.bench.runner import measure_bandwidth
from popjax.generation import generate_ids
from popjax.requests import GenerationRequest

PROMPT = [[1, 504, 3458, 314, 2000, 17, 88, 1010]]
NEW_TOKENS = 64
# profiler events that are not kernels: the executor's own spans, thread-pool bookkeeping, Python
NOT_KERNELS = ("ThunkExecutor", "$", "SlinkyThreadPool", "ThreadpoolListener", "PjitFunction", "end:",
               "ParseArguments", "CommonPjRt", "PjRt", "TfrtCpu")


def launch_cost_us(links: int = 500, repeats: int = 20) -> tuple[float, int]:
    """µs per kernel of a chain of tiny dependent kernels -> (µs per kernel, kernels)."""

    def chain(x):
        for _ in range(links):
            x = x + jnp.max(jnp.abs(x)) * 1e-3
        return x

    fn = jax.jit(chain)
    x = jnp.ones((1, 576), jnp.float32)
    hlo = fn.lower(x).compile().as_text()
    entry = hlo[hlo.index("ENTRY"):]
    kernels = sum(" fusion(" in line for line in entry.splitlines())
    fn(x).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e6 / kernels, kernels


def step_ms(model, repeats: int = 5) -> float:
    """Decode ms per token at batch 1: (64-token generate − 4-token generate) / 60, best of repeats."""
    best = {}
    for n in (NEW_TOKENS, 4):
        generate_ids(model, PROMPT, n, ignore_eos=True)
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            generate_ids(model, PROMPT, n, ignore_eos=True)
            runs.append(time.perf_counter() - start)
        best[n] = min(runs)
    return (best[NEW_TOKENS] - best[4]) / (NEW_TOKENS - 4) * 1e3


def kernels_per_step(model) -> float:
    """Kernels the compiled decode loop runs per step (profiler events of one decode)."""
    req = GenerationRequest.create(model, PROMPT, NEW_TOKENS, ignore_eos=True)
    jax.block_until_ready(req.decode(model, req.start(model)[0], NEW_TOKENS)[0])
    carry = req.start(model)[0]
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
        out = req.decode(model, carry, NEW_TOKENS)
        jax.block_until_ready(out[0])
        jax.profiler.stop_trace()
        (path,) = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)
        events = json.load(gzip.open(path))["traceEvents"]
    names = collections.Counter(e["name"] for e in events if e.get("ph") == "X" and not e["name"].startswith(NOT_KERNELS))
    return sum(names.values()) / (NEW_TOKENS - 1)


def measure(label: str, model, cost_us: float, bandwidth: float) -> dict:
    cfg = model.config
    slots = len(PROMPT[0]) + NEW_TOKENS  # (the cache the bench counts is the bucketed one: a few KB more)
    weight_bytes = bytes_per_step(cfg, popjax.Dense().bind(cfg), 1, slots, 4)
    kernels = kernels_per_step(model)
    ms = step_ms(model)
    launches_ms = kernels * cost_us / 1e3
    bytes_ms = weight_bytes / bandwidth / 1e6
    row = {"weights": label, "step_ms": ms, "kernels_per_step": kernels, "launches_ms": launches_ms,
           "bytes_per_step": weight_bytes, "bytes_ms": bytes_ms, "floor_ms": launches_ms + bytes_ms}
    print(f"{label}: step {ms:.2f} ms, {kernels:.0f} kernels ({launches_ms:.2f} ms of launches), "
          f"{weight_bytes / 1e6:.0f} MB ({bytes_ms:.2f} ms at {bandwidth:.1f} GB/s): floor {row['floor_ms']:.2f} ms", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="where to write the results")
    args = parser.parse_args()
    cost_us, chain_kernels = launch_cost_us()
    bandwidth = measure_bandwidth()
    print(f"one kernel launch: {cost_us:.2f} µs ({chain_kernels} kernels); fp32 GEMV bandwidth {bandwidth:.1f} GB/s", flush=True)
    rows = [measure("fp32", popjax.load(), cost_us, bandwidth)]
    for activations in ("int8", "float"):
        rows.append(measure(f"int8, {activations} activations", popjax.load(weights="int8", activations=activations), cost_us, bandwidth))
    fp32 = rows[0]["step_ms"]
    for row in rows:
        row["speedup_vs_fp32"] = fp32 / row["step_ms"]
        row["speedup_at_floor_vs_fp32"] = fp32 / row["floor_ms"]
    result = {"launch_us": cost_us, "chain_kernels": chain_kernels, "bandwidth_gb_s": bandwidth,
              "prompt_tokens": len(PROMPT[0]), "new_tokens": NEW_TOKENS, "rows": rows,
              "jax": jax.__version__, "devices": str(jax.devices())}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
