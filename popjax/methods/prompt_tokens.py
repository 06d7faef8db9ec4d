"""Which prompt tokens score a prompt-ranked partition on a vision-language model (docs/methods.md
§13): POP builds its partition from the prompt's activations, and with an image most prompt
tokens are image tokens.

    "all"       every valid prompt token (the paper's implied default; a text model's only choice)
    "text"      the text tokens only
    "image"     the image tokens only
    "balanced"  each modality's mean squared activation weighted equally:
                I_j² = ½·mean_text(H_j²) + ½·mean_image(H_j²)   (then · ‖W_d[:, j]‖₂ as always)

A choice whose tokens are absent (a text-only prompt asked for "image") falls back to every valid
token, and "balanced" with one modality absent is that modality's mean: the ranking is the same
as "all" then. The engine gives the prefill the prompt's image-token mask as the layer weights'
``w.image_tokens`` [B, T] (absent for a text-only batch); the statistics read the mask or
weights this module returns in place of ``valid``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .base import MethodError

PROMPT_TOKENS = ("all", "text", "image", "balanced")


def check_prompt_tokens(value) -> None:
    if value not in PROMPT_TOKENS:
        raise MethodError(f"prompt_tokens={value!r} is not one of {PROMPT_TOKENS}: which prompt tokens score the partition")


def scoring_tokens(valid: jax.Array, image: jax.Array | None, choice: str, per_row: bool) -> jax.Array:
    """valid [B, T] bool, image [B, T] bool (None: no image in the batch) -> the tokens that
    score the partition: a bool mask [B, T] ("all", "text", "image") or fp32 weights [B, T]
    ("balanced"). ``per_row``: the partition is per sequence (each row falls back and
    normalises alone), else over the whole batch."""
    if image is None or choice == "all":
        return valid
    axes = (1,) if per_row else (0, 1)
    image = image & valid
    text = valid & ~image
    if choice in ("text", "image"):
        chosen = text if choice == "text" else image
        return jnp.where(jnp.any(chosen, axis=axes, keepdims=True), chosen, valid)
    n_text = jnp.sum(text, axis=axes, keepdims=True).astype(jnp.float32)
    n_image = jnp.sum(image, axis=axes, keepdims=True).astype(jnp.float32)
    both = (n_text > 0) & (n_image > 0)
    share = jnp.where(both, 0.5, 1.0)
    return (text * share / jnp.maximum(n_text, 1.0) + image * share / jnp.maximum(n_image, 1.0)).astype(jnp.float32)
