"""Time to first token and decode speed of an image+text prompt on the digits VLM trained here
(popjax.eval.digits_vlm), dense vs POP vs Prefill-Only (batch 1), and the vision tower's compiles
across image sizes within one patch bucket. Run it alone on the machine (nothing else sharing the CPU):

    python benchmarks/vlm_speed.py --json results/vlm/speed_cpu.json
"""

import argparse
import json
import time

import numpy as np
from PIL import Image

import popjax
from popjax.eval.digits_vlm import digits_vlm
from popjax.generation import encode_prompts
from popjax.image_prompts import _tower, split_images
from popjax.images import preprocess


def prompt(size: int):
    rng = np.random.default_rng(size)
    image = Image.fromarray(rng.integers(0, 255, (size, size, 3), np.uint8))
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "which digit is this ?"}]}]


def timed(model, method, question, new_tokens: int, repeats: int) -> dict:
    """Median TTFT (a one-token generate: tower + prefill + first token) and decode tok/s (the
    rest of a longer generate, EOS ignored, minus the TTFT measured just before it)."""
    messages, images = split_images(question)
    ids = encode_prompts(model, [messages], None)
    run = lambda n: popjax.generate_ids(model, ids, max_new_tokens=n, method=method, images=[images], ignore_eos=True)[0]
    run(new_tokens)  # compile both programs
    ttft, decode = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run(1)
        t1 = time.perf_counter()
        out = run(new_tokens)
        t2 = time.perf_counter()
        ttft.append(t1 - t0)
        decode.append((len(out[0]) - 1) / max((t2 - t1) - (t1 - t0), 1e-9))
    return {"ttft_s": float(np.median(ttft)), "decode_tok_s": float(np.median(decode)), "new_tokens": new_tokens,
            "prompt_tokens": len(ids[0]) - 1 + int(np.prod(preprocess(images).grid_thw[0])) // 4}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True)
    parser.add_argument("--size", type=int, default=224, help="image side in pixels (224: 256 patches, 64 image tokens)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model = digits_vlm()
    question = prompt(args.size)
    methods = {"dense": None, "pop": popjax.POP(0.4), "prefill-only": popjax.PrefillOnly()}
    rows = {name: timed(model, method, question, args.new_tokens, args.repeats) for name, method in methods.items()}
    before = _tower._cache_size()
    for size in (196, 168, 224, 182):  # 196, 144, 256, 169 patches: one bucket (256 patches)
        popjax.generate(model, prompt(size), max_new_tokens=1)
    record = {"command": f"python benchmarks/vlm_speed.py --json {args.json} --size {args.size} --new-tokens {args.new_tokens} "
                         f"--repeats {args.repeats}", "image_pixels": args.size, "rows": rows,
              "tower_compiles_for_4_more_sizes_in_that_bucket": _tower._cache_size() - before}
    print(json.dumps(record, indent=1))
    with open(args.json, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
