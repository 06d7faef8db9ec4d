"""Gemma 3 parity figures: the largest |logit difference| between popjax (fp32) and transformers
(fp32) on the tiny random Gemma 3 configs of the test suite, for a left-padded prefill and 8
teacher-forced decode steps past the window (the check tests/models/test_parity.py asserts at 1e-4).

    python tools/gemma3_parity.py --json results/gemma3/parity.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.conftest: the configs the suite checks

import popjax  # noqa: E402
from popjax.files import write_json_atomic  # noqa: E402
from tests.conftest import make_tiny_checkpoint  # noqa: E402
from tests.reference.parity import DECODE_STEPS, LENGTHS, parity_errors  # noqa: E402


def parity(name: str, work: Path) -> dict:
    """tests/models/test_parity.py's protocol (`tests.reference.parity.parity_errors`) on the unrolled and the scanned model."""
    hf = make_tiny_checkpoint(name, work / name)
    out = {"config": name, "prompt_lengths": list(LENGTHS), "decode_steps": DECODE_STEPS}
    for scan in (False, True):
        model = popjax.load(work / name, cache=False, scan_layers=scan)
        prefill, decode = parity_errors(model, hf)
        out["scanned" if scan else "unrolled"] = {"prefill_max_abs_logit_diff": prefill, "decode_max_abs_logprob_diff": decode}
    out["window"] = model.config.sliding_window
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
