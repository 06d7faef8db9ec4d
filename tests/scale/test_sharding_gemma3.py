"""Gemma 3 on an 8-device mesh (one subprocess with 8 fake CPU devices, its own test file so
xdist runs it beside tests/scale/eight_devices.py's worker): mixed sliding-window and full layers,
ring-buffer caches split over batch and KV heads, unrolled (every method below) and scanned (dense
and POP) on the (2, 4) mesh, which splits the batch and the heads at once, equal to one device.

Dense, POP and Prefill-Only + POP are teacher-forced through a prefill and decode steps that
run past the window (the step the greedy loop runs); the greedy
loop itself runs for POP on the unrolled (2, 4) mesh."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the worker imports tests.scale.eight_devices

from tests.scale.eight_devices import ATOL, PROMPTS, _teacher, random_tree, tiny_config  # noqa: E402

WINDOW = 4  # PROMPTS run to 12 tokens and decoding adds 10: every ring wraps
DECODE = 10


def gemma_config():
    """The sharding tests' tiny shape as a Gemma 3: 4 layers, the second and the last sliding."""
    kinds = ("full_attention", "sliding_attention", "full_attention", "sliding_attention")
    return tiny_config(model_type="gemma3_text", num_hidden_layers=4, hidden_act="gelu_pytorch_tanh", qk_norm=True,
                       sandwich_norms=True, embed_scale=True, layer_types=kinds, sliding_window=WINDOW,
                       rope_local_theta=10000.0, query_pre_attn_scalar=12.0, final_logit_softcapping=20.0,
                       tie_word_embeddings=True)


def worker(out_path: str) -> None:
    import jax

    import popjax
    from popjax import sharding
    from popjax.generation import generate_ids
    from popjax.requests import pad_batch
    from popjax.loading import build_model

    start = time.process_time()
    cfg = gemma_config()
    tree = random_tree(cfg)
    tokens, mask = pad_batch(PROMPTS, 0, min_rows=8)
    targets = np.random.default_rng(1).integers(0, cfg.vocab_size, (tokens.shape[0], DECODE)).astype(np.int32)
    # what rings can break: dense and POP's steps, and a layer-level schedule over mixed layers
    # (static's and per-shard POP's splits are the LLaMA worker's, tests/scale/eight_devices.py)
    methods = {"dense": popjax.Dense(), "pop-shared": popjax.POP(0.3),
               "prefill-only+pop": popjax.PrefillOnly(skip=(1, 3)) + popjax.POP(0.3)}
    out = {"devices": len(jax.devices()), "methods": {}, "generate": {}}
    shape = (2, 4)
    for scan in (False, True):
        single = build_model(cfg, tree, None, "tiny-gemma3", "float32", scan_layers=scan)
        placed = build_model(cfg, tree, None, "tiny-gemma3", "float32", sharding.make_mesh(shape), scan_layers=scan)
        for name, method in methods.items():
            if scan and name not in ("dense", "pop-shared"):  # the scanned cache layouts: the dense and POP steps
                continue
            plan = method.bind(cfg)
            want = _teacher(single, plan, tokens, mask, targets)[: len(PROMPTS)]
            got = _teacher(placed, plan, tokens, mask, targets)[: len(PROMPTS)]
            out["methods"][f"{name} scan={scan} {shape}"] = {
                "max_abs_logprob_diff": float(np.abs(got - want).max()),
                "greedy_same": bool((got.argmax(-1) == want.argmax(-1)).all())}
        if not scan:  # the greedy loop's programs (start, decode_loop) with POP, once
            ids, _ = generate_ids(placed, PROMPTS, DECODE, method=methods["pop-shared"], ignore_eos=True)
            want, _ = generate_ids(single, PROMPTS, DECODE, method=methods["pop-shared"], ignore_eos=True)
            out["generate"][f"pop-shared scan={scan} {shape}"] = ids == want
    out["cpu_seconds"] = time.process_time() - start
    Path(out_path).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    worker(sys.argv[1])


@pytest.fixture(scope="module")
def eight_devices_gemma3(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gemma3_mesh") / "gemma3.json"
    from tests.conftest import fake_devices_env

    env = fake_devices_env(8)
    proc = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow  # starts the 8-device worker process
def test_gemma3_on_eight_devices_matches_one_device(eight_devices_gemma3):
    results = eight_devices_gemma3
    assert results["devices"] == 8
    assert len(results["methods"]) == 3 + 2  # on (2, 4): unrolled 3 methods, scanned 2
    for name, got in results["methods"].items():
        assert got["greedy_same"], name
        assert got["max_abs_logprob_diff"] <= ATOL, (name, got)
    assert len(results["generate"]) == 1 and all(results["generate"].values()), results["generate"]
