"""What BWAP's schedule costs in the whole compiled decode step of the default model, batch 8,
global 40%: ms per decode step of dense, static, BWAP as the paper runs it, and two BWAP
schedules that isolate the price of its per-layer ``lax.cond`` branches — every step pruned
(t_prune huge: compare with static, which has no branch) and every step dense exploration
(t_prune 0: compare with dense, which keeps no statistics). 64-token random prompts, 128 new
tokens, best of 3. Usage:
python benchmarks/bwap_schedule_cost.py results/engine/bwap_schedule_cost.json   (~4 min)"""
import json, sys, time

import jax
import numpy as np

import popjax
from popjax.generation import GenerationRequest

BATCH, PROMPT, NEW = 8, 64, 128
METHODS = {
    "dense": popjax.Dense(),
    "static": popjax.Static(0.4),
    "bwap": popjax.BWAP(0.4),
    "bwap_every_step_pruned": popjax.BWAP(0.4, t_init=1, t_explore=1, t_prune=100_000),
    "bwap_every_step_dense": popjax.BWAP(0.4, t_prune=0),
}

model = popjax.load()
rng = np.random.default_rng(0)
prompts = [rng.integers(100, 20_000, PROMPT).tolist() for _ in range(BATCH)]
ms = {}
for name, method in METHODS.items():
    req = GenerationRequest.create(model, prompts, NEW, method=method, ignore_eos=True)
    jax.block_until_ready(req.decode(model, req.start(model)[0], NEW)[0])  # compile
    times = []
    for _ in range(3):
        carry = jax.block_until_ready(req.start(model)[0])
        t = time.perf_counter()
        jax.block_until_ready(req.decode(model, carry, NEW)[0])
        times.append(time.perf_counter() - t)
    ms[name] = min(times) / (NEW - 1) * 1e3
    print(f"{name:24s} {ms[name]:7.2f} ms/step  {ms['dense'] / ms[name]:.3f}× dense", flush=True)
result = {"batch": BATCH, "prompt_tokens": PROMPT, "new_tokens": NEW, "ms_per_step": ms,
          "speedup_vs_dense": {k: ms["dense"] / v for k, v in ms.items()}}
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as out:
        json.dump(result, out, indent=1)
