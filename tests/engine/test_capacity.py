"""Decode cost follows the work, not the cache's capacity: the compiled decode loop never copies a
KV cache, and its bytes (XLA's cost analysis) barely move between a cache of 96 slots and one of
4352. A regression once made every layer of every step copy its whole cache twice (reading the
cache in attention's block loop, then writing the cache the loop had read): 0.46x the speed at
4000 slots. These tests fail on that program."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import popjax
from popjax.requests import GenerationRequest
from popjax import engine
from tests.conftest import random_prompts

SMALL, LARGE = 64, 4096  # capacities: the smallest and the largest bucket


def _compiled_decode_loop(model, batch: int, capacity: int):
    """The decode loop's compiled program for ``batch`` prompts at ``capacity`` -> (HLO text,
    bytes accessed, the shapes of the carried KV cache arrays as HLO writes them)."""
    prompts = random_prompts(np.random.default_rng(0), [5 + i for i in range(batch)], model.config.vocab_size)
    req = GenerationRequest.create(model, prompts, max_new_tokens=8, ignore_eos=True, capacity=capacity)
    carry, _ = req.start(model)
    compiled = engine.decode_loop.lower(
        model.graphdef, model.params, req.plan, carry, jnp.int32(8), req.sampling, jnp.asarray(req.stops),
        jnp.int32(req.pad_id), capacity=capacity, data=req.data).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    caches = jax.tree_util.tree_leaves(carry.state.caches)
    shapes = {f"{a.dtype.name.replace('float', 'f')}[{','.join(map(str, a.shape))}]" for a in caches}
    cache_bytes = sum(a.size * a.dtype.itemsize for a in caches)
    return compiled.as_text(), float(cost["bytes accessed"]), shapes, cache_bytes


def cache_copies(hlo: str, shapes: set[str]) -> list[str]:
    """The copy instructions of ``hlo`` whose result has one of the caches' ``shapes``."""
    copies = re.findall(r"= (\w+\[[\d,]*\])\{[^}]*\} copy\(", hlo)
    return [s for s in copies if s in shapes]


@pytest.mark.optimized_xla
# the unrolled model (where the regression was) at batch 1 and 8; the scanned one, which writes
# after its layer scan, at batch 1
@pytest.mark.parametrize("scan_layers, batch", [(False, 1), (False, 8), (True, 1)], ids=["unrolled-1", "unrolled-8", "scanned-1"])
def test_decode_step_bytes_do_not_grow_with_the_capacity(tiny_checkpoints, scan_layers, batch):
    directory, _ = tiny_checkpoints("llama-gqa")
    model = popjax.load(directory, cache=False, scan_layers=scan_layers)
    small_hlo, small_bytes, small_shapes, _ = _compiled_decode_loop(model, batch, SMALL)
    large_hlo, large_bytes, large_shapes, large_cache = _compiled_decode_loop(model, batch, LARGE)
    assert cache_copies(small_hlo, small_shapes) == []
    assert cache_copies(large_hlo, large_shapes) == [], "the decode loop copies a KV cache in every step"
    # the loop's body reads the written blocks only; what grows is the [B, S] key mask and the
    # tokens' [B, capacity] buffer. One copy of the caches would be 1x their bytes, the regression 4x.
    assert large_bytes - small_bytes < 0.25 * large_cache, (small_bytes, large_bytes, large_cache)
