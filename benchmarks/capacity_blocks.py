"""Batch 8's decode step against the cache's capacity, block for block: caches for 256 and 4096
new tokens both read whole 256-slot blocks (`kernels.attention.KV_BLOCK`) and should cost the
same per step; the 64-token bucket's cache (96 slots) is read as one smaller block without a
loop. Per step = (decode loop of 200 tokens − of 8) / 192 (64 vs 8 tokens for the small cache),
the best of ``--repeats`` interleaved runs. Run on a quiet machine:

    python benchmarks/capacity_blocks.py --json results/engine/capacity_blocks.json
"""

from __future__ import annotations

import argparse
import time

import jax

import popjax
from popjax.files import write_json_atomic
from popjax.requests import GenerationRequest

PROMPT = "Write a long story about a dragon who learns to read."
RUNS = {256: (8, 200), 4096: (8, 200), 64: (8, 64)}  # capacity -> the two generation lengths timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model = popjax.load()
    ids = popjax.generate(model, PROMPT, max_new_tokens=1).prompt_token_ids[0]  # the chat template applied

    def seconds(capacity: int, n: int) -> float:
        req = GenerationRequest.create(model, [ids] * args.batch, max_new_tokens=n, ignore_eos=True, capacity=capacity)
        carry, _ = req.start(model)
        jax.block_until_ready(carry)
        start = time.perf_counter()
        jax.block_until_ready(req.decode(model, carry, n))
        return time.perf_counter() - start

    for capacity, lengths in RUNS.items():  # compile every program first
        for n in lengths:
            seconds(capacity, n)
    best: dict[tuple[int, int], float] = {}
    for _ in range(args.repeats):  # interleaved, so a slow spell of the machine hits every setting
        for capacity, lengths in RUNS.items():
            for n in lengths:
                best[capacity, n] = min(best.get((capacity, n), float("inf")), seconds(capacity, n))
    per_step = {capacity: 1e3 * (best[capacity, hi] - best[capacity, lo]) / (hi - lo) for capacity, (lo, hi) in RUNS.items()}
    result = {"command": f"python benchmarks/capacity_blocks.py --batch {args.batch} --repeats {args.repeats} --json {args.json}",
              "device": str(jax.devices()[0]), "batch": args.batch, "prompt_tokens": len(ids),
              "per_step_ms": {str(c): round(v, 2) for c, v in per_step.items()},
              "ratio_4096_vs_256": round(per_step[4096] / per_step[256], 3), "ratio_4096_vs_64": round(per_step[4096] / per_step[64], 3)}
    write_json_atomic(args.json, result)
    print(result)


if __name__ == "__main__":
    main()
