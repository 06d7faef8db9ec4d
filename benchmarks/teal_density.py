"""TEAL's measured density on the frontier's held-out windows, against its target.

TEAL's frontier bytes are those of its target sparsity; its thresholds were calibrated on other
text, so on any text its actual density differs. This measures it on the windows
`popjax frontier --play coriolanus --nll-windows 8 --nll-prompt-tokens 256 --nll-decode-tokens 64`
scores (per-token masks, every decode step and layer).

    python benchmarks/teal_density.py [--play coriolanus] [--json PATH]
"""

import argparse
import json
from pathlib import Path

import numpy as np

import popjax
from popjax import data
from popjax.eval.tasks import NLLSettings, text_windows
from popjax.eval.teacher import teacher_forced
from popjax.methods import TEAL

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--play", default=data.HELD_OUT_PLAY)
parser.add_argument("--ratios", default="0.2,0.4")
parser.add_argument("--json", type=Path)
args = parser.parse_args()

model = popjax.load()
settings = NLLSettings(windows=8, prompt_tokens=256, decode_tokens=64)
prompts, targets = text_windows(model, data.load_play(args.play), settings)
out = {"play": args.play, "windows": len(prompts), "ratios": {}}
for ratio in (float(r) for r in args.ratios.split(",")):
    method = TEAL(ratio, aggregate="per_token").prepare(model)
    found = {name: [] for name in ("density", "density_x", "density_h")}
    for start in range(0, len(prompts), 4):
        _, _, records = teacher_forced(model, method, prompts[start : start + 4], targets[start : start + 4], record=tuple(found))
        for name in found:
            found[name].append(float(np.asarray(records[name]).mean()))
    out["ratios"][str(ratio)] = {"target_density": 1.0 - method.sparsity(model.config),
                                 **{name: float(np.mean(values)) for name, values in found.items()}}
print(json.dumps(out, indent=1))
if args.json:
    args.json.write_text(json.dumps(out, indent=1) + "\n")
