"""Decode cost against the cache's capacity, on the real default model: the same greedy tokens,
stopped by a stop id, with ``max_new_tokens`` (the capacity the cache is sized for) from 56 to
4000; and the per-step cost split from the fixed one (8 vs 64 tokens) at batch 1 and 8.

The engine promises that decode attention reads the cache only up to the current length, so
capacity costs memory, not time (tests/engine/test_capacity.py checks the compiled program; this
measures it). Run on a quiet machine:

    python benchmarks/capacity_decode.py --json results/engine/capacity_decode.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np

import popjax
from popjax.files import write_json_atomic
from popjax.requests import GenerationRequest

PROMPT = "Write a long story about a dragon who learns to read."
CAPACITIES = (56, 256, 1024, 2048, 4000)
SPLIT_CAPACITIES = (64, 4096)


def stop_after(model, ids: list[int], n: int) -> int:
    """A token id that greedy decoding first produces as its ``n``-th new token or later (the
    first new token from position n on not seen before it), so a stop id ends it there."""
    tokens, _ = popjax.generate_ids(model, [ids], max_new_tokens=n + 32, ignore_eos=True)
    row = tokens[0]
    for i in range(n - 1, len(row)):
        if row[i] not in row[:i]:
            return row[i]
    raise RuntimeError(f"no fresh token after position {n} in {row}")


def generate_ms(model, ids, max_new_tokens: int, stop_id: int, repeats: int) -> tuple[float, int]:
    """Median wall time of ``popjax.generate_ids`` (compiled first) -> (ms, tokens produced)."""
    run = lambda: popjax.generate_ids(model, [ids], max_new_tokens=max_new_tokens, stop_ids=[stop_id])[0]
    produced = len(run()[0])
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times), produced


def step_split(model, ids, batch: int, capacity: int, repeats: int) -> dict[str, float]:
    """The decode loop alone for 8 and 64 tokens at ``capacity`` -> fixed ms and ms per step
    (best of ``repeats``: the floor is what the program costs, the rest is the machine)."""
    best = {}
    for n in (8, 64):
        req = GenerationRequest.create(model, [ids] * batch, max_new_tokens=n, ignore_eos=True, capacity=capacity)
        times = []
        for _ in range(repeats + 1):  # the first compiles
            carry, _ = req.start(model)
            jax.block_until_ready(carry)
            start = time.perf_counter()
            jax.block_until_ready(req.decode(model, carry, n))
            times.append(time.perf_counter() - start)
        best[n] = min(times[1:])
    per_step = (best[64] - best[8]) / 56
    return {"fixed_ms": 1e3 * (best[8] - 8 * per_step), "per_step_ms": 1e3 * per_step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="where to write the results")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model = popjax.load()
    ids = popjax.generate(model, PROMPT, max_new_tokens=1).prompt_token_ids[0]  # the chat template applied
    stop_id = stop_after(model, ids, 55)
    table = []
    for capacity in CAPACITIES:
        ms, produced = generate_ms(model, ids, capacity, stop_id, args.repeats)
        table.append({"max_new_tokens": capacity, "generate_ms": round(ms, 1), "tokens": produced})
        print(table[-1], flush=True)
    split = []
    for batch in (1, 8):
        for capacity in SPLIT_CAPACITIES:
            split.append({"batch": batch, "capacity": capacity, **{k: round(v, 2) for k, v in step_split(model, ids, batch, capacity, args.repeats).items()}})
            print(split[-1], flush=True)
    base = table[0]["generate_ms"]
    for row in table:
        row["speed_vs_56"] = round(base / row["generate_ms"], 3)
    per_step = {(r["batch"], r["capacity"]): r["per_step_ms"] for r in split}
    result = {
        "command": f"python benchmarks/capacity_decode.py --repeats {args.repeats} --json {args.json}",
        "device": str(jax.devices()[0]), "jax": jax.__version__, "model": "smollm2-135m-instruct", "dtype": "float32",
        "prompt": PROMPT, "stop_id": int(stop_id), "generate": table, "step_split": split,
        "per_step_ratio_4096_vs_64": {b: round(per_step[(b, 4096)] / per_step[(b, 64)], 3) for b in (1, 8)},
    }
    write_json_atomic(args.json, result)
    print(json.dumps(result["per_step_ratio_4096_vs_64"]))


if __name__ == "__main__":
    np.set_printoptions(linewidth=200)
    main()
