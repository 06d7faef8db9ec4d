"""The method × architecture × layout × weights matrix: every registered method on every family.

One cell per (method, architecture): the method, ready for the tiny model (calibrated on random
tokens where it needs statistics), teacher-forced through the engine's prefill and decode step
on the float model, unrolled: finite log-probabilities [B, N, V]. Architectures:

* ``llama``: the tiny LLaMA (GQA, untied), for the methods whose variant family it is (below):
  every registered method already runs on the tiny LLaMA through the engine, on one device and on
  a (2, 4) mesh, in tests/scale/eight_devices.py's 8-device worker;
* ``moe``: a Qwen2-MoE whose first layer routes 8 experts beside a shared expert and whose second
  is dense (the per-block aux of every step stacked over both: its shapes are checked);
* ``gemma3``: the tiny Gemma 3 (GeGLU, sliding layers whose rings wrap during decode);
* ``vlm``: the tiny Qwen2-VL, one row of the batch holding an image.

Every method also runs once on its **variant** architecture (``VARIANT``, a rotation over the
four, so each family sees about a quarter of the methods this way) with int8 weights and,
where the model allows it, scanned layers: its log-probabilities equal the float unrolled
run's within 1e-4. The float model of every family is the int8 model's dequantized twin
(weights q · s), so that one float run is the reference of both the int8 weights and the scan.
The mixed MoE model is not scannable (dense and expert layers differ), and a method with a
per-layer prefill schedule (Prefill-Only Pruning) is refused by the scan in one line: those
variants run int8 unrolled.

Method-specific references live elsewhere: NumPy references of the plans in tests/reference/
(checked in tests/methods/test_methods_reference.py and test_baselines_reference.py), Gemma 3's in
test_gemma3_methods.py, MoE's per-expert statistics in test_moe_statistics.py, a mesh of 8 devices
in tests/scale/eight_devices.py; the code before the seam refactor: a by-hand command (test_method_equivalence.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import popjax
from popjax import engine
from popjax.convert import convert as conv
from popjax.image_prompts import image_prompt
from popjax.loaded import with_scanned_layers
from popjax.loading import build_model
from popjax.methods import METHODS
from popjax.models.config import ModelConfig
from popjax.models.scan import check_scannable
from popjax.requests import pad_batch
from tests.reference.gemma3 import SWEEP_MODEL, sweep_data
from tests.reference.matrix import dequantized_twin, ready
from tests.reference.moe import BASE as MOE_BASE
from tests.reference.moe import CONFIGS as MOE_CONFIGS
from tests.reference.vlm import digit, expanded, hf_model

ARCHS = ("llama", "moe", "gemma3", "vlm")
NAMES = sorted(METHODS)
VARIANT = {name: ARCHS[i % len(ARCHS)] for i, name in enumerate(NAMES)}  # where each method also runs int8 (+ scanned)
VARIANT_ATOL = 1e-4  # int8 (scale after the dot) against its dequantized twin; the scan adds ~1e-6


@dataclasses.dataclass
class Arch:
    """One family's tiny models and inputs: the int8 model, its dequantized float twin, a
    left-padded prompt batch, targets [B, N] and (a VLM) the batch's placed images."""

    int8: Any
    float: Any
    tokens: jnp.ndarray
    mask: jnp.ndarray
    targets: jnp.ndarray
    images: Any = None

    def run(self, model, method, record: tuple[str, ...] = ()) -> tuple[np.ndarray, dict]:
        """Teacher-forced log-probabilities [B, N, V] of ``method`` (ready) on ``model``, and the
        decode aux named in ``record`` ([N, L, ...])."""
        _, logp, records = engine.teacher_force(model.graphdef, model.params, method.bind(model.config), self.tokens,
                                                self.mask, self.targets, with_logprobs=True, record=record,
                                                data=method.data(model), images=self.images)
        return np.asarray(logp), records


def _inputs(prompts, targets) -> dict:
    tokens, mask = pad_batch(prompts, 0)
    return {"tokens": jnp.asarray(tokens), "mask": jnp.asarray(mask), "targets": jnp.asarray(targets, jnp.int32)}


def _build(name: str, tiny_checkpoints, tmp_path_factory) -> Arch:
    rng = np.random.default_rng(3)
    if name == "moe":
        cfg = ModelConfig.from_hf_dict({"model_type": "qwen2_moe", **MOE_BASE, **MOE_CONFIGS["qwen2_moe"], "weights": "int8"})
        tree = conv.unflatten({k: rng.normal(0, 0.3, s).astype(np.float32) for k, s in conv.checkpoint_shapes(cfg).items()})
        q = build_model(cfg, tree, None, "moe", "float32")
        return Arch(q, dequantized_twin(q), **_inputs([[5, 6, 7, 8, 9], [10, 11, 12]], [[13, 14, 15], [16, 17, 18]]))
    if name == "vlm":
        directory = tmp_path_factory.mktemp("matrix_vlm")
        hf_model("qwen2_vl").save_pretrained(directory)
        q = popjax.load(str(directory), cache=False, weights="int8", activations="float")
        pieces, images = expanded([[5, 6], digit(2, (56, 56)), [7, 8]])
        arch = Arch(q, dequantized_twin(q), **_inputs([pieces, [9, 10, 11]], [[13, 14, 15], [16, 17, 18]]))
        pixels = popjax.images.preprocess(images)
        arch.images = image_prompt(q, pixels, np.asarray(arch.tokens), np.asarray(arch.mask))
        return arch
    directory, _ = tiny_checkpoints("llama-gqa" if name == "llama" else SWEEP_MODEL)
    q = popjax.load(directory, cache=False, weights="int8", activations="float")
    if name == "llama":
        return Arch(q, dequantized_twin(q), **_inputs([[5, 17, 3, 99, 42, 7], [8, 9, 10]], [[13, 14, 15], [16, 17, 18]]))
    prompts, targets = sweep_data(q.config.vocab_size)  # longer than the window; the rings wrap in decode
    return Arch(q, dequantized_twin(q), **_inputs(prompts, targets))


@pytest.fixture(scope="module")
def arch(tiny_checkpoints, tmp_path_factory):
    built: dict[str, Arch] = {}

    def get(name: str) -> Arch:
        if name not in built:
            built[name] = _build(name, tiny_checkpoints, tmp_path_factory)
        return built[name]

    return get


def _scannable(model, method) -> bool:
    try:
        check_scannable(model.config)
    except ValueError:
        return False
    return method.bind(model.config).layer_control(model.config.num_hidden_layers) is None


# every method on every family but LLaMA, and on LLaMA where it is the method's variant family
CELLS = [(name, arch) for name in NAMES for arch in ARCHS if arch != "llama" or VARIANT[name] == "llama"]


@pytest.mark.slow  # 69 cells and 21 variants: about 80 CPU-seconds
@pytest.mark.parametrize("name, arch_name", CELLS)
def test_method_on_architecture(name, arch_name, arch):
    """Finite log-probabilities through prefill and decode on the float model, unrolled; on the
    method's variant family, int8 weights (scanned where allowed) give the same within 1e-4."""
    a = arch(arch_name)
    method = ready(name, arch_name, a.float)
    logp, rec = a.run(a.float, method, record=("experts", "shared", "router_topk") if arch_name == "moe" else ())
    B, N = a.targets.shape
    assert logp.shape == (B, N, a.float.config.vocab_size) and np.all(np.isfinite(logp)), name
    if arch_name == "moe":  # the per-block aux of every step, stacked over the MoE layer and the dense one
        assert rec["router_topk"].shape == (N, 2, B, 1, 2) and not np.any(rec["router_topk"][:, 1])  # dense: zeros
        for kind, blocks in (("experts", 8), ("shared", 3)):  # 8 experts; the shared expert and the dense FFN in blocks of 16
            for leaf in jax.tree_util.tree_leaves(rec.get(kind, {})):
                assert leaf.shape[:3] == (N, 2, blocks), (kind, leaf.shape)
    if VARIANT[name] != arch_name:
        return
    variant = a.int8
    if _scannable(a.int8, method):
        variant = with_scanned_layers(a.int8)
    elif arch_name != "moe":  # the scan refuses a per-layer schedule in one line, before any compile
        scanned = with_scanned_layers(a.int8)
        with pytest.raises(ValueError, match=r"a layer control that treats layers differently.*unrolled model"):
            a.run(scanned, method)
    np.testing.assert_allclose(a.run(variant, method)[0], logp, atol=VARIANT_ATOL, rtol=0, err_msg=f"{name} int8 on {arch_name}")
