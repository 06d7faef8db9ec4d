"""Model-level references and the model configurations several tests share: log-softmax in
float64 (the scores the harness adapters and the Gemma 3 reference are checked with), the default
model's config (SmolLM2-135M's shapes) and the digits VLM's short training recipe (the tests train
the small vision-language model with it in seconds, then read it from the cache like a converted
model)."""

from __future__ import annotations

import numpy as np

from popjax.eval.digits_vlm import Recipe

SMOLLM2 = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_attention_heads=9,
               num_key_value_heads=3, num_hidden_layers=30, vocab_size=49152, max_position_embeddings=8192,
               tie_word_embeddings=True, rope_theta=100000.0)
SHORT = Recipe(steps=30, batch=8, vision_depth=1, layers=2)  # the digits VLM, trained in seconds


def log_softmax(logits):
    """log softmax over the last axis, in float64: logits [..., V] -> [..., V]."""
    z = np.asarray(logits, np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))
