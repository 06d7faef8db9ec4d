"""Decode speed of a small random MoE model: dense-MoE vs POP-MoE (20%, 40%) at batch 1 and 8,
with the FFN weight bytes read per token, and the expert dispatch (dense vs gathered) compared.

    python benchmarks/bench_moe.py [--out results/moe/bench_moe.json] [--tokens 48]

The model is a random Qwen3-MoE-shaped config (no checkpoint needed): d=256, 32 experts of
width 128, top-2, 2 layers. Wall-clock numbers depend on the machine; they are printed and saved,
never asserted.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import jax
import numpy as np

import popjax
from popjax.convert import convert as conv
from popjax.generation import GenerationRequest
from popjax.loading import build_model
from popjax.models import decoder, moe
from popjax.models.config import ModelConfig

RAW = dict(
    model_type="qwen3_moe", vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
    num_experts=32, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, norm_topk_prob=True, max_position_embeddings=1024,
)
METHODS = {"dense": popjax.Dense(), "pop-0.2": popjax.POP(0.2), "pop-0.4": popjax.POP(0.4)}


def random_model(seed: int = 0):
    cfg = ModelConfig.from_hf_dict(RAW)
    rng = np.random.default_rng(seed)
    flat = {k: rng.normal(0, 0.05, size=s).astype(np.float32) for k, s in conv.checkpoint_shapes(cfg).items()}
    return build_model(cfg, conv.unflatten(flat), None, "random-moe", "float32")


def decode_tok_s(model, method, batch: int, tokens: int, repeats: int = 2) -> float:
    """Generated tokens per second of the compiled decode loop (prefill excluded), best of ``repeats``."""
    prompts = [list(np.random.default_rng(b).integers(3, 500, size=24)) for b in range(batch)]
    req = GenerationRequest.create(model, prompts, tokens, method=method, ignore_eos=True)
    best = float("inf")
    for _ in range(repeats + 1):  # the first run compiles
        carry, _ = req.start(model)
        jax.block_until_ready(carry)
        start = time.perf_counter()
        out = req.decode(model, carry, tokens)
        jax.block_until_ready(out[0])
        best = min(best, time.perf_counter() - start)
    return batch * (tokens - 1) / best


def ffn_bytes(cfg, plan, batch: int, dispatch: str) -> dict[str, float]:
    """FFN weight bytes per generated token (all layers, fp32): the activated experts alone
    (top-k; what a gathered step reads at batch 1) and what one step of ``batch`` rows reads
    with the given dispatch (dense: all E experts; gather: at most min(E, batch·k)), per row."""
    m, d = cfg.moe, cfg.hidden_size
    per_block = plan.ffn_weights_read_per_step(d, batch) * 4
    blocks_run = m.num_experts if dispatch == "dense" else min(m.num_experts, batch * m.top_k)
    L = cfg.num_hidden_layers
    return {
        "ffn_bytes_per_token_activated": L * m.top_k * plan.ffn_weights_read(d) * 4,
        "ffn_bytes_per_token_step": L * blocks_run * per_block / batch,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/moe/bench_moe.json")
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    model = random_model()
    rows = []
    auto = decoder.moe_mlp
    for dispatch in ("gather", "dense"):
        # "gather" is the library default (moe_mlp's "auto": gathered routed experts in decode
        # when fewer than E are routed); "dense" forces every expert on every token
        decoder.moe_mlp = auto if dispatch == "gather" else functools.partial(moe.moe_mlp, dispatch="dense")
        jax.clear_caches()
        for name, method in METHODS.items():
            if dispatch == "dense" and name == "pop-0.4":
                continue  # the dispatch comparison needs one pruned method only
            plan = method.bind(model.config)
            for batch in (1, 8):
                row = {"method": name, "dispatch": dispatch, "batch": batch,
                       "decode_tok_s": round(decode_tok_s(model, method, batch, args.tokens), 1),
                       **ffn_bytes(model.config, plan, batch, dispatch)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    decoder.moe_mlp = auto
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"config": RAW, "tokens": args.tokens, "device": str(jax.devices()[0]), "jax": jax.__version__}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
