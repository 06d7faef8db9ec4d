"""DeepStack (Qwen3-VL): vision features added to the language model's residual stream at the
image tokens after its first decoder layers.

Qwen3-VL's tower returns, besides the features that replace the image placeholders' input
embeddings, one more feature set per DeepStack block (``vision_config.deepstack_visual_indexes``,
each through its own merger; models/vision.py). transformers adds set j to the hidden states at
the image-token positions right after decoder layer j (``Qwen3VLTextModel._deepstack_process``),
for j = 0 … n_deep − 1. `add_deepstack` is that addition for one layer of either model (the
unrolled loop passes a Python index, the scan a traced one).

It acts on the residual stream after the layer's slot whatever the layer did there: a layer a
caller's `LayerControl` skips (mode "kv" or "none") passes its input on unchanged and the features
are still added to it, so the layers that do run see every DeepStack feature they see in the full
model (docs/vlm.md, "Methods on a VLM").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .layers import PlacedEmbeddings


def add_deepstack(x: jax.Array, placed: PlacedEmbeddings | None, layer: jax.Array | int) -> jax.Array:
    """x [B, T, d] after decoder layer ``layer`` -> x with DeepStack set ``layer`` added at the
    image tokens (``placed.slots`` ≥ 0, each token its feature row): ``placed.deepstack``
    [n_deep, N, d] (None, or ``layer`` ≥ n_deep: x unchanged)."""
    if placed is None or placed.deepstack is None:
        return x
    n = placed.deepstack.shape[0]
    if isinstance(layer, int):
        if layer >= n:
            return x
        table = placed.deepstack[layer]
    else:  # traced (a scan): pick the set, and add nothing past the last one
        table = placed.deepstack[jnp.minimum(layer, n - 1)]
    rows = table.astype(x.dtype)[jnp.maximum(placed.slots, 0)]  # [B, T, d]
    take = placed.slots >= 0
    if not isinstance(layer, int):
        take = take & (layer < n)
    return x + jnp.where(take[..., None], rows, jnp.zeros((), x.dtype))
