"""A Qwen2-VL on meshes of 8 fake CPU devices (one subprocess; its own test file so xdist runs it
beside the other workers): images through the batch-split, KV-head-split engine, dense and POP,
greedy tokens and logits equal to one device. The tower's weights stay replicated."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the worker imports tests.reference.vlm


MESHES = ((2, 1), (1, 2), (4, 2))


def worker(out_path: str) -> None:
    import jax
    import torch
    import transformers

    import popjax
    from popjax.sharding import make_mesh
    from tests.reference import vlm as t

    text = {**t.TEXT, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}
    cfg = transformers.Qwen2VLConfig(text_config=text, vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2),
                                     tie_word_embeddings=False, **t.TOKENS)
    torch.manual_seed(0)
    hf = transformers.Qwen2VLForConditionalGeneration(cfg).eval()
    t.randomise(hf)
    directory = tempfile.mkdtemp()
    hf.save_pretrained(directory)
    one = popjax.load(directory, cache=False)
    rows, images = zip(t.expanded([[5, 6], t.digit(0, (56, 56)), [7, 8]]), t.expanded([[9, 10, 11]]),
                       t.expanded([t.digit(1, (84, 56)), [12, 13]]))
    results = {"devices": len(jax.devices()), "runs": {}}
    for name, method in (("dense", None), ("pop", popjax.POP(0.2))):
        want, _ = popjax.generate_ids(one, list(rows), 6, images=list(images), ignore_eos=True, method=method)
        want_logits = t.ours_logits(one, list(rows), list(images))
        for shape in MESHES:
            model = popjax.load(directory, cache=False, mesh=make_mesh(shape))
            got, _ = popjax.generate_ids(model, list(rows), 6, images=list(images), ignore_eos=True, method=method)
            logits = t.ours_logits(model, list(rows), list(images))
            results["runs"][f"{name} {shape}"] = {"greedy_same": got == want,
                                                  "max_abs_logit_diff": float(np.abs(logits - want_logits).max())}
    Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    worker(sys.argv[1])


@pytest.mark.slow  # starts the 8-device worker process
def test_vlm_on_meshes_matches_one_device(tmp_path):
    out = tmp_path / "vlm.json"
    from tests.conftest import fake_devices_env

    env = fake_devices_env(8)
    proc = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    assert results["devices"] == 8 and len(results["runs"]) == 2 * len(MESHES)
    for name, run in results["runs"].items():
        assert run["greedy_same"] and run["max_abs_logit_diff"] <= 1e-4, (name, run)
