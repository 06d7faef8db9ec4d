"""Gemma 3 parity figures: the largest |logit difference| between popjax (fp32) and transformers
(fp32) on the tiny random Gemma 3 configs of the test suite, for a left-padded prefill and 8
teacher-forced decode steps past the window (the check tests/test_parity.py asserts at 1e-4).

    python tools/gemma3_parity.py --json results/gemma3/parity.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.conftest: the configs the suite checks

import popjax  # noqa: E402
from popjax import engine  # noqa: E402
from popjax.eval.teacher import teacher_forced  # noqa: E402
from popjax.files import write_json_atomic  # noqa: E402
from popjax.generation import pad_batch  # noqa: E402
from tests.conftest import make_tiny_checkpoint, random_prompts  # noqa: E402


def parity(name: str, work: Path, lengths=(5, 9, 13), steps: int = 8) -> dict:
    hf = make_tiny_checkpoint(name, work / name)
    out = {"config": name}
    for scan in (False, True):
        model = popjax.load(work / name, cache=False, scan_layers=scan)
        rng = np.random.default_rng(0)
        prompts = random_prompts(rng, lengths, model.config.vocab_size)
        cont = random_prompts(rng, [steps] * len(prompts), model.config.vocab_size)
        with torch.no_grad():
            want = [hf(torch.tensor([p + c])).logits[0].numpy() for p, c in zip(prompts, cont)]
        tokens, mask = pad_batch(prompts, pad_id=0)
        logits = np.asarray(engine.prefill(model.graphdef, model.params, jnp.asarray(tokens), jnp.asarray(mask),
                                           popjax.Dense().bind(model.config), all_logits=True)[0])
        T = tokens.shape[1]
        prefill = max(np.abs(logits[r, T - len(p):] - want[r][: len(p)]).max() for r, p in enumerate(prompts))
        _, logp = teacher_forced(model, popjax.Dense(), prompts, np.asarray(cont), with_logprobs=True)
        decode = max(np.abs(logp[r] - torch.log_softmax(torch.tensor(want[r][len(p) - 1: len(p) - 1 + steps]), -1).numpy()).max()
                     for r, p in enumerate(prompts))
        key = "scanned" if scan else "unrolled"
        out[key] = {"prefill_max_abs_logit_diff": float(prefill), "decode_max_abs_logprob_diff": float(decode)}
    out["window"], out["prompt_lengths"], out["decode_steps"] = model.config.sliding_window, list(lengths), steps
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default="results/gemma3/parity.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = [parity(name, Path(tmp)) for name in ("gemma3-window", "gemma3-last-sliding")]
    write_json_atomic(Path(args.json), {"command": "python tools/gemma3_parity.py", "results": results})
    for r in results:
        print(r["config"], {k: r[k] for k in ("unrolled", "scanned")})


if __name__ == "__main__":
    main()
