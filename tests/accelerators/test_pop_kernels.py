"""POP's ``kernel`` hyper-parameter (docs/kernels.md, "POP's wiring"): the Pallas decode path
(interpret mode on this CPU) equals XLA's in greedy tokens and log-probabilities, the platform
choice in `popjax.kernels.choose`, the byte accounting of the kernel, and the bad inputs.

The kernel path copies C's down rows at prefill as `ffn_layout.InputRows` and adds the m
selected ones per step through `popjax.kernels.decode_ffn.gather_matvec`; everything else of
the step is XLA's in both paths, so the two differ only by the f32 accumulation order of that
term.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

import popjax
from popjax import kernels
from popjax.kernels.ffn_layout import InputRows, channel_lines
from popjax.methods import MethodError
from popjax.methods.pop import POPPlan
from popjax.methods.pop.blocks import BlockBand
from popjax.methods.pop.plan import GLOBAL_BAND, ExactScorer
from popjax.loaded import with_scanned_layers
from tests.accelerators.kernel_paths import assert_kernel_path_equals_xla
from tests.accelerators.targets import ffn_weights
from tests.conftest import random_prompts

# Compiles for a TPU or a GPU, or runs Pallas kernels in interpret mode: the full suite checks these, the
# quick loop between edits (-m "not slow") does not.
pytestmark = pytest.mark.slow


def _prompts(model, batch: int, seed: int = 0) -> list[list[int]]:
    return random_prompts(np.random.default_rng(seed), (9, 6)[:batch], model.config.vocab_size)


# (family, batch, aggregate, block, layout): both families, batch sizes and aggregates (the
# kernel under vmap: per-sequence at batch 2), channel POP and block POP (the block kernel), and
# the scanned model, whose kernels read C's rows held in the stacked state (`kernels.held_rows`:
# a batch of one, a vmap over rows, block POP's block kernel)
CASES = [("llama", 1, "per_sequence", 1, "unrolled"), ("llama", 2, "shared", 1, "unrolled"),
         ("gemma3", 2, "per_sequence", 1, "unrolled"), ("llama", 2, "shared", 8, "unrolled"),
         ("llama", 1, "per_sequence", 1, "scanned"), ("llama", 2, "per_sequence", 1, "scanned"),
         ("llama", 1, "shared", 8, "scanned"), ("llama_int8", 1, "per_sequence", 1, "scanned"),
         ("gemma3", 1, "per_sequence", 8, "scanned")]


@pytest.fixture(scope="module")
def llama_int8(tiny_checkpoints):
    """The tiny LLaMA with int8 weights and float activations (the kernels' int8 form)."""
    directory, _ = tiny_checkpoints("llama-gqa")
    return popjax.load(directory, cache=False, weights="int8", activations="float")


@pytest.mark.parametrize("family, batch, aggregate, block, layout", CASES)
def test_pallas_equals_xla(request, tiny_model, family, batch, aggregate, block, layout):
    """`kernel_paths.assert_kernel_path_equals_xla`: the same greedy tokens and log-probs."""
    model = tiny_model if family == "llama" else request.getfixturevalue(family)
    model = with_scanned_layers(model) if layout == "scanned" else model
    prompts = _prompts(model, batch)
    xla = popjax.POP(ratio=0.4, gamma=0.2, aggregate=aggregate, block=block, kernel="xla")
    pallas = dataclasses.replace(xla, kernel="pallas")
    assert pallas.bind(model.config).kernel == "pallas-interpret"
    assert_kernel_path_equals_xla(model, xla, pallas, prompts)


@pytest.mark.parametrize("int8, aggregate, block", [(False, "per_sequence", 1), (True, "shared", 1), (False, "shared", 4), (True, "per_sequence", 4)])
def test_plan_step_through_the_kernel(int8, aggregate, block):
    """One layer's plan, float and int8 weights: the kernel path keeps C's down rows as
    `InputRows` [n_C, L, 128] and its decode step equals XLA's (outputs and selections); block
    POP's (``block`` > 1) reads its m/b blocks through `decode_ffn.block_matvec`."""
    w = ffn_weights(int8)
    rng = np.random.default_rng(1)
    x, x_t = jnp.asarray(rng.normal(size=(2, 5, 40)), jnp.float32), jnp.asarray(rng.normal(size=(2, 1, 40)), jnp.float32)
    valid, valid_t = jnp.ones((2, 5), bool), jnp.ones((2, 1), bool)
    m = 6 if block == 1 else 8  # whole blocks
    xla = POPPlan(f=48, n_keep=30, aggregate=aggregate, m=m, scorer=ExactScorer(block=block), band=BlockBand(block) if block > 1 else GLOBAL_BAND)
    pallas = dataclasses.replace(xla, kernel="pallas-interpret")
    outs = []
    for plan in (xla, pallas):
        y, state, _ = plan.prefill(w, x, valid)
        y_t, _, aux = plan.decode(w, state, x_t, jnp.int32(0), valid_t)
        outs.append((y, state, y_t, aux))
    rows = outs[1][1]["down_candidates"]
    assert isinstance(rows, InputRows) and rows.values.shape[-3:] == (2 * m, channel_lines(40), 128)
    assert (rows.scale is not None) == int8
    np.testing.assert_array_equal(outs[1][0], outs[0][0])  # prefill does not use the kernel
    np.testing.assert_allclose(outs[1][2], outs[0][2], atol=1e-4, rtol=1e-5)
    np.testing.assert_array_equal(outs[1][3]["selected"], outs[0][3]["selected"])


def test_auto_is_xla_on_cpu(tiny_model):
    assert kernels.choose("auto") == "xla"
    assert popjax.POP(ratio=0.4).kernel == "auto"
    assert popjax.POP(ratio=0.4).bind(tiny_model.config).kernel == "xla"
    assert popjax.POP(ratio=0.4, kernel="xla").bind(tiny_model.config).kernel == "xla"


@pytest.mark.parametrize(
    "kernel, backend, resolved",
    [("auto", "tpu", "pallas-tpu"), ("auto", "gpu", "pallas-gpu"), ("auto", "cpu", "xla"),
     ("pallas", "cpu", "pallas-interpret"), ("pallas", "tpu", "pallas-tpu"), ("xla", "gpu", "xla")],
)
def test_choose(kernel, backend, resolved):
    assert kernels.choose(kernel, backend) == resolved


def test_compiling_for_another_platform_binds_its_kernels(tiny_model):
    """`kernels.compiling_for` (popjax compile: a TPU's programs from this CPU) resolves for the
    target; outside the block, this host's backend again."""
    with kernels.compiling_for("tpu"):
        assert popjax.POP(ratio=0.4).bind(tiny_model.config).kernel == "pallas-tpu"
        assert kernels.choose("pallas") == "pallas-tpu" and kernels.choose("auto", "cpu") == "xla"
    assert kernels.choose("auto") == "xla" and kernels.choose("pallas") == "pallas-interpret"


def test_auto_is_xla_where_no_kernel_is_wired():
    """weights="gather" and partition="per_shard" have no kernel wiring: "auto" is XLA there."""
    assert popjax.POP(ratio=0.4, weights="gather").resolved_kernel() == "xla"
    assert popjax.POP(ratio=0.4, partition="per_shard", shards=2).resolved_kernel() == "xla"


def test_a_sharded_model_keeps_the_kernel():
    """POP.prepare leaves ``kernel`` alone on a mesh: every device runs the kernel on its
    replicated candidate rows (tests/scale/eight_devices.py runs it on 8 devices)."""
    sharded = SimpleNamespace(mesh=object())  # what POP.prepare reads of a sharded model
    assert popjax.POP(ratio=0.4).prepare(sharded).kernel == "auto"
    assert popjax.POP(ratio=0.4, kernel="pallas").prepare(sharded).kernel == "pallas"


def test_bytes_say_what_the_kernel_reads(tiny_model):
    """The interpret/TPU kernel reads a selected down row whole (L·128 ≥ d); XLA reads d."""
    cfg, d = tiny_model.config, tiny_model.config.hidden_size
    xla = popjax.POP(ratio=0.4, gamma=0.2, kernel="xla").bind(cfg)
    pallas = popjax.POP(ratio=0.4, gamma=0.2, kernel="pallas").bind(cfg)
    assert xla.m > 0
    extra = (channel_lines(d) * 128 - d) * xla.m
    assert pallas.ffn_weights_read(d) - xla.ffn_weights_read(d) == extra
    gpu = dataclasses.replace(pallas, kernel="pallas-gpu")
    assert gpu.ffn_weights_read(d) == xla.ffn_weights_read(d)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kernel="cuda"), "kernel='cuda' is not one of ('auto', 'xla', 'pallas')"),
        (dict(kernel="pallas", weights="gather"), "kernel='pallas' is wired for weights='compact', partition='global' only"),
        (dict(kernel="pallas", partition="per_shard", shards=2), "kernel='pallas' is wired for weights='compact', partition='global' only"),
    ],
)
def test_bad_kernel_is_one_line(kwargs, message):
    with pytest.raises(MethodError) as err:
        popjax.POP(ratio=0.4, **kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_plan_refuses_a_kernel_for_a_scorer_without_one(tiny_model):
    """A scorer without a kernel path (exact scores from gathered weights) refuses one in its
    plan; its preset refuses "pallas" and binds "auto" to XLA."""
    plan = popjax.POP(ratio=0.4, weights="gather").bind(tiny_model.config)
    with pytest.raises(MethodError, match="wired for the exact scorer with compact weights, the gate, the shortlist"):
        dataclasses.replace(plan, kernel="pallas-interpret")
    with kernels.compiling_for("tpu"):
        assert popjax.POP(ratio=0.4, weights="gather").resolved_kernel() == "xla"
    with pytest.raises(MethodError, match="kernel='triton' is not one of"):
        dataclasses.replace(popjax.POP(ratio=0.4).bind(tiny_model.config), kernel="triton")
    with pytest.raises(ValueError, match="kernel='cuda' is not one of"):
        kernels.choose("cuda")
