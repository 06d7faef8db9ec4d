"""The engine's programs lower for CUDA on a machine without a GPU (docs/tpu.md, "GPU"): JAX traces
them on abstract arguments and emits StableHLO for the ``cuda`` platform. Compiling that module
needs the CUDA PJRT plugin (what docs/tpu.md found: it compiles deviceless given a GPU target
config), which the test extras do not install; lowering is the part every machine can check."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import popjax
from popjax import engine
from popjax.analysis.flops import abstract_carry
from popjax.models.config import ModelConfig
from popjax.requests import MAX_STOP_IDS

# Compiles for a TPU or a GPU, or runs Pallas kernels in interpret mode: the full suite checks these, the
# quick loop between edits (-m "not slow") does not.
pytestmark = pytest.mark.slow

CONFIG = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
              bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
PROMPT, CAPACITY = 32, 64


def _ops(lowered) -> set[str]:
    return set(re.findall(r"stablehlo\.(\w+)", lowered.as_text()))


@pytest.mark.parametrize("method", [popjax.Dense(), popjax.POP(0.4)], ids=["dense", "pop"])
def test_every_program_lowers_for_cuda(method):
    cfg = ModelConfig.from_hf_dict(CONFIG)
    plan = method.bind(cfg)
    graphdef, params, carry, sampling, stops, pad = abstract_carry(cfg, plan, 2, PROMPT, CAPACITY, "bfloat16")
    tokens = jax.ShapeDtypeStruct((2, PROMPT), jnp.int32)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    assert stops.shape == (8,) and MAX_STOP_IDS >= 1
    cuda = dict(lowering_platforms=("cuda",))
    programs = {
        "start": engine.start.trace(graphdef, params, plan, tokens, tokens, key, sampling, stops, pad, capacity=CAPACITY),
        "decode_loop": engine.decode_loop.trace(graphdef, params, plan, carry, pad, sampling, stops, pad, capacity=CAPACITY),
        "stream_step": engine.stream_step.trace(graphdef, params, plan, carry, sampling, stops, pad),
    }
    for name, traced in programs.items():
        lowered = traced.lower(**cuda)
        ops = _ops(lowered)
        assert "dot_general" in ops, name  # the matmuls are there, for the GPU's compiler to take
        assert "custom_call" not in ops or "cpu" not in lowered.as_text().lower(), name  # no CPU-only kernels
    step = _ops(programs["stream_step"].lower(**cuda))
    if isinstance(method, popjax.POP):  # POP's per-step channel gathers reach the GPU program as gathers
        assert "gather" in step
    # the same step lowered for the CPU holds the same operations: nothing in it is CPU-specific
    assert _ops(programs["stream_step"].lower()) >= step - {"custom_call"}
