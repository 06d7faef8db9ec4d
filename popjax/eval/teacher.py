"""Teacher forcing through a method's *decode* path: prefill a prompt, then feed given tokens
one at a time (the online setting POP is built for) and score each next token.

The engine's own decode step does the work (``engine.teacher_force``); one compile per
(batch bucket, prompt bucket, number of targets, method plan).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .. import distributed, engine
from ..requests import pad_batch, pad_token_id
from ..loaded import LoadedModel
from ..methods import Method, prepared


def teacher_forced(
    model: LoadedModel,
    method: Method,
    prompts: list[list[int]],
    targets: np.ndarray,
    with_logprobs: bool = False,
    record: tuple[str, ...] = (),
    min_rows: int = 1,
    prompt_length: int | None = None,
):
    """NLL (nats) [B, N] of ``targets`` [B, N] fed through ``method``'s decode path after each
    prompt's prefill, and the log-probabilities [B, N, V] (or None unless ``with_logprobs``).
    With ``record`` (names of the method's decode aux, e.g. ``("density",)``) a third value
    holds them per step: name -> [N, L, ...] (per-sequence methods keep the batch bucket's
    rows). ``min_rows`` pads the batch to at least that many rows (dead rows), so a caller
    feeding batches of varying size keeps one batch bucket, hence one compile; ``prompt_length``
    (a prompt bucket ≥ the longest prompt) fixes the prompt bucket likewise."""
    targets = np.asarray(targets, np.int32)
    if targets.ndim != 2 or targets.shape[0] != len(prompts):
        raise ValueError(f"targets must be [B={len(prompts)}, N]; got {targets.shape}")
    tokens, mask = pad_batch(prompts, pad_token_id(model), length=prompt_length, min_rows=min_rows)
    padded_targets = np.zeros((tokens.shape[0], targets.shape[1]), np.int32)
    padded_targets[: len(prompts)] = targets
    method = prepared(method, model)
    plan = method.bind(model.config)
    nll, logp, records = engine.teacher_force(
        model.graphdef, model.params, plan, jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(padded_targets),
        with_logprobs, tuple(record), data=method.data(model),
    )
    B = len(prompts)
    nll, logp, records = distributed.to_host((nll, logp, dict(records)))  # the same values on every process
    out = nll[:B], (logp[:B] if with_logprobs else None)
    return (*out, records) if record else out
