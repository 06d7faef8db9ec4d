"""Quality of int8 weights against fp32, per method, on the held-out play (Coriolanus windows of
the eval: 16 windows of 256 prefilled + 128 decoded tokens, the frontier's defaults).

For dense, static and POP at 20% and 40%: the held-out NLL of the fp32 and of the int8 model
(with int8 activations, the CPU default, and weight-only) under the same method and their difference, the KL of int8's next-token distribution from
fp32's (same method), and the greedy agreement (how often int8's argmax equals fp32's at the
teacher-forced positions). Writes JSON and a markdown table.

    python benchmarks/int8_quality.py --json results/int8/quality.json

``--group-size 32`` also measures the group-wise variant (a scale per 32 input channels, as
GGUF's Q8_0), by running the fp32 model on weights quantized and dequantized that way.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
from flax import nnx

import popjax
from popjax.data import HELD_OUT_PLAY, load_play
from popjax.eval.tasks import NLLSettings, text_windows
from popjax.eval.teacher import teacher_forced
from popjax.methods import make_method

CONFIGS = [("dense", None), ("static", 0.2), ("static", 0.4), ("pop", 0.2), ("pop", 0.4)]


def group_quantized(model, group: int):
    """The fp32 model with every linear weight replaced by its group-wise int8 round trip."""
    from popjax.loading import place_model

    def roundtrip(w: np.ndarray) -> np.ndarray:
        shape = w.shape
        blocks = w.reshape(*shape[:-1], shape[-1] // group, group).astype(np.float32)
        scale = np.abs(blocks).max(-1, keepdims=True) / 127
        scale[scale == 0] = 1
        return (np.clip(np.rint(blocks / scale), -127, 127) * scale).reshape(shape)

    names = ("qkv", "o", "gate_up", "down", "embed", "lm_head")

    def walk(node):
        return {k: walk(v) if isinstance(v, dict) else (roundtrip(np.asarray(v)) if k in names else np.asarray(v))
                for k, v in node.items()}

    tree = walk(nnx.to_pure_dict(model.params))
    tree["layers"] = {str(k): v for k, v in tree["layers"].items()}
    return place_model(model.config, tree, model.tokenizer, f"group{group}", "float32")


def score(model, method, prompts, targets, batch):
    nlls, logps = [], []
    for start in range(0, len(prompts), batch):
        nll, logp = teacher_forced(model, method, prompts[start : start + batch], targets[start : start + batch], with_logprobs=True)
        nlls.append(nll)
        logps.append(logp)
    return np.concatenate(nlls), np.concatenate(logps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="results/int8/quality.json")
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=None)
    args = parser.parse_args()
    fp32 = popjax.load()
    variants = {"int8 (int8 activations)": popjax.load(weights="int8", activations="int8"),
                "int8 (weight-only)": popjax.load(weights="int8", activations="float")}
    if args.group_size:
        variants[f"int8 group {args.group_size} (weight-only)"] = group_quantized(fp32, args.group_size)
    s = dataclasses.replace(NLLSettings(), windows=args.windows)
    prompts, targets = text_windows(fp32, load_play(HELD_OUT_PLAY), s)
    rows = []
    for name, ratio in CONFIGS:
        method = make_method(name, **({} if ratio is None else {"ratio": ratio}))
        ref_nll, ref_logp = score(fp32, method, prompts, targets, s.batch_size)
        for variant, model in variants.items():
            nll, logp = score(model, method, prompts, targets, s.batch_size)
            rows.append({
                "method": name, "ratio": ratio or 0.0, "weights": variant,
                "nll_fp32": float(ref_nll.mean()), "nll": float(nll.mean()), "delta_nll": float(nll.mean() - ref_nll.mean()),
                "kl_from_fp32": float(np.sum(np.exp(ref_logp) * (ref_logp - logp), axis=-1).mean()),
                "greedy_agreement": float((logp.argmax(-1) == ref_logp.argmax(-1)).mean()),
            })
            print(rows[-1], flush=True)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"text": HELD_OUT_PLAY, "windows": s.windows, "prompt_tokens": s.prompt_tokens, "decode_tokens": s.decode_tokens,
            "devices": str(jax.devices()), "command": "python benchmarks/int8_quality.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None)}
    out.write_text(json.dumps({**meta, "rows": rows}, indent=1))
    lines = ["| method | ratio | weights | NLL fp32 | NLL | Δ NLL | KL from fp32 | greedy agreement |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['ratio']:.1f} | {r['weights']} | {r['nll_fp32']:.4f} | {r['nll']:.4f} | {r['delta_nll']:+.4f} | "
              f"{r['kl_from_fp32']:.4f} | {r['greedy_agreement']:.3f} |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
