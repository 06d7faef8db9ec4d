"""Where an int8 decode step's time goes (batch 1, the default model): one jitted decode step
(the streaming step) and, jitted alone with the model's own weights, its 30 FFNs, its 30 attention
projections (q/k/v and o) and its LM head. Run alone on the machine, once per format:

    python benchmarks/int8_step_parts.py fp32|float|int8      # float / int8: weights="int8" with that activations mode
"""
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import popjax
from popjax.methods.base import dense_mlp
from popjax.models.layers import linear
from popjax.kernels.int8 import dot
from popjax.requests import GenerationRequest


def timed(fn, *args, repeats=20):
    fn = jax.jit(fn)
    fn(*args).block_until_ready()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(*args).block_until_ready()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1000


def main(mode: str) -> None:
    m = popjax.load(weights="int8", activations=mode) if mode != "fp32" else popjax.load()
    req = GenerationRequest.create(m, [[1, 504, 3458, 314]], 64, ignore_eos=True)
    carry, _ = req.start(m)
    for _ in range(3):
        carry, tok = req.step(m, carry)
    ts = []
    for _ in range(30):
        t = time.perf_counter()
        carry, tok = req.step(m, carry)
        tok.block_until_ready()
        ts.append(time.perf_counter() - t)
    model = nnx.merge(m.graphdef, m.params)
    d = m.config.hidden_size
    ws = [layer.mlp.ffn_weights(i) for i, layer in enumerate(model.layers)]  # FFNWeights: a pytree, act static
    qkv = [layer.attn.weight("qkv") for layer in model.layers]
    o = [layer.attn.weight("o") for layer in model.layers]
    x = jnp.ones((1, 1, d), jnp.float32)

    def ffns(x, ws):
        for w in ws:
            x = dense_mlp(w, x) * 1e-3 + x
        return x

    def projections(x, qkv, o):
        for w, wo in zip(qkv, o):
            y = linear(x, w.reshape(-1, d))
            x = linear(y[..., :d], wo) * 1e-3 + x
        return x

    parts = {"ffn": timed(ffns, x, ws), "attention projections": timed(projections, x, qkv, o),
             "lm head": timed(lambda x, h: dot("btd,vd->btv", x, h, preferred_element_type=jnp.float32), x, model.lm_head_weight())}
    step = float(np.median(ts)) * 1000
    print(f"{mode}: step {step:.2f} ms; " + ", ".join(f"{k} {v:.2f} ms" for k, v in parts.items())
          + f"; the rest {step - sum(parts.values()):.2f} ms")


if __name__ == "__main__":
    main(sys.argv[1])
