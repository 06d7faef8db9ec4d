"""What the accelerator tests compile against and count with: the tiny configs of every family
sized to split over a TPU mesh (`config`), the shapes compiled, the custom call a Pallas kernel
leaves in an XLA:TPU program, a random FFN layer (`ffn_weights`) and the bytes the TPU interpreter
moves to and from HBM (`hbm_traffic`)."""

from __future__ import annotations

import collections
import contextlib

import jax.numpy as jnp
import numpy as np
from jax._src.pallas.mosaic.interpret import shared_memory  # private: the TPU simulator's memory, to count bytes

from popjax.kernels.int8 import Int8Weight, quantize
from popjax.models.config import ModelConfig
from popjax.models.interface import FFNWeights

# 2 layers, d=64; 4 heads, 4 KV heads, f and vocab divisible by 4: every axis splits over model=4
BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False)
FAMILIES = {
    "llama": dict(model_type="llama", rope_theta=10000.0),
    "qwen3": dict(model_type="qwen3", head_dim=16),
    "qwen3_moe": dict(model_type="qwen3_moe", head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True),
    "gemma3": dict(model_type="gemma3_text", head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention"]),
    "qwen2_vl": dict(model_type="qwen2_vl", vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2),
                     text_config=dict(BASE, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                             "mrope_section": [2, 3, 3]}),
                     image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253),
}
SHAPES = dict(batch=1, context=64, decode_loop=False)  # prompt bucket 32, 32 new tokens
MOSAIC_CALL = 'custom_call_target="tpu_custom_call"'  # a Pallas kernel in an XLA:TPU program


def config(family: str = "llama", **overrides) -> ModelConfig:
    return ModelConfig.from_hf_dict(dict(BASE, **FAMILIES[family], **overrides))


def ffn_weights(int8: bool, f: int = 48, d: int = 40, seed: int = 0) -> FFNWeights:
    """A random FFN layer (f channels, width d) as the plans receive it: float32, or int8 with
    per-output-channel scales (popjax's format)."""
    rng = np.random.default_rng(seed)
    gate_up, down = rng.normal(size=(2, f, d)).astype(np.float32), rng.normal(size=(d, f)).astype(np.float32)
    if int8:  # popjax's format: per-output-channel scales, weight-only dots
        gate_up, down = Int8Weight(*map(jnp.asarray, quantize(gate_up))), Int8Weight(*map(jnp.asarray, quantize(down)))
    norms = jnp.linalg.norm(down.dequantize() if int8 else down, axis=0)
    return FFNWeights(gate_up=gate_up if int8 else jnp.asarray(gate_up), down=down if int8 else jnp.asarray(down), down_norm=norms)


@contextlib.contextmanager
def hbm_traffic():
    """Counts the bytes the TPU interpreter reads from and writes to HBM buffers (a test-only
    hook on jax's private simulator: its block fetches and DMAs all go through these two)."""
    tally, cls = collections.Counter(), shared_memory.SharedMemory
    get, put = cls.get_buffer_content, cls.store_buffer_content

    def counted_get(self, key, rnge, *a, **k):
        out = get(self, key, rnge, *a, **k)
        if key[0] == "hbm" and out[0] is not None:
            tally["read"] += out[0].nbytes
        return out

    def counted_put(self, key, rnge, value, *a, **k):
        if key[0] == "hbm":
            tally["written"] += np.asarray(value).nbytes
        return put(self, key, rnge, value, *a, **k)

    cls.get_buffer_content, cls.store_buffer_content = counted_get, counted_put
    try:
        yield tally
    finally:
        cls.get_buffer_content, cls.store_buffer_content = get, put
