"""``popjax.generate`` and ``popjax.forward``: text in, text and ids out, through the engine."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import engine
from .loading import LoadedModel
from .methods import Method, resolve_method
from .sampling import SamplingParams

MAX_STOP_IDS = 8  # stop ids are padded to this static size so their number never recompiles

Prompt = str | Sequence[dict[str, str]]  # a text or a chat conversation


@dataclasses.dataclass
class Generation:
    """Result of ``generate``: one entry per prompt.

    ``trace`` (with ``return_trace=True``) holds the prefill partition/importance per layer and,
    per decode step and layer, the method's selections (e.g. POP's chosen candidates and their
    scores): arrays shaped [steps, L, ...] (+ a batch axis in per-sequence mode)."""

    texts: list[str]
    token_ids: list[list[int]]
    prompt_token_ids: list[list[int]]
    trace: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        return self.texts[0]


def _encode(model: LoadedModel, prompts: list[Prompt], chat: bool | None) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        if not prompt or (isinstance(prompt, str) and not prompt.strip()):
            raise ValueError(f"prompt {i} is empty; give at least one non-whitespace character")
    tok = model.tokenizer
    if tok is None:
        raise ValueError(f"{model.source} has no tokenizer; pass token ids to generate_ids()")
    use_chat = chat if chat is not None else getattr(tok, "chat_template", None) is not None
    out = []
    for i, prompt in enumerate(prompts):
        if use_chat:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        elif isinstance(prompt, str):
            ids = tok(prompt)["input_ids"]
        else:
            raise ValueError(f"prompt {i} is a conversation but chat=False; pass a string")
        out.append([int(t) for t in ids])
    return out


def _left_pad(prompts: list[list[int]], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.full((len(prompts), length), pad_id, np.int32)
    mask = np.zeros((len(prompts), length), np.int32)
    for row, ids in enumerate(prompts):
        tokens[row, length - len(ids) :] = ids
        mask[row, length - len(ids) :] = 1
    return tokens, mask


def _stop_ids(model: LoadedModel, extra: Sequence[int] | None, ignore_eos: bool = False) -> np.ndarray:
    ids = set() if ignore_eos else set(model.config.eos_token_ids)
    tok = model.tokenizer
    if tok is not None and tok.eos_token_id is not None and not ignore_eos:
        ids.add(int(tok.eos_token_id))
    ids.update(int(i) for i in (extra or ()))
    if len(ids) > MAX_STOP_IDS:
        raise ValueError(f"{len(ids)} stop ids given; at most {MAX_STOP_IDS} are supported")
    return np.array(sorted(ids) + [-1] * (MAX_STOP_IDS - len(ids)), np.int32)


def check_prompt_lengths(model: LoadedModel, prompts: list[list[int]], max_new_tokens: int) -> None:
    context = model.config.max_position_embeddings
    for i, ids in enumerate(prompts):
        if not ids:
            raise ValueError(f"prompt {i} is empty (0 tokens)")
        if len(ids) + max_new_tokens > context:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} that exceeds "
                f"the model's context of {context} tokens"
            )
        bad = [t for t in ids if not 0 <= t < model.config.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} holds token ids {bad[:5]} outside [0, {model.config.vocab_size})")


def generate_ids(
    model: LoadedModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | jax.Array = 0,
    method: Method | str | None = None,
    stop_ids: Sequence[int] | None = None,
    return_trace: bool = False,
    ignore_eos: bool = False,
) -> tuple[list[list[int]], dict[str, Any] | None]:
    """Token-id prompts -> generated ids per prompt (stop token excluded), and the trace.

    ``ignore_eos`` generates exactly ``max_new_tokens`` unless a ``stop_ids`` entry appears
    (benchmarks, teacher-free evaluation)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} is invalid; use an integer ≥ 1")
    sampling = SamplingParams.create(temperature, top_k, top_p)
    prompts = [list(p) for p in prompts]
    if not prompts:
        raise ValueError("no prompts given")
    check_prompt_lengths(model, prompts, max_new_tokens)
    plan = resolve_method(method).bind(model.config)
    length = engine.bucket_for(max(map(len, prompts)), engine.PROMPT_BUCKETS, "a prompt length")
    capacity = engine.bucket_for(max_new_tokens, engine.CAPACITY_BUCKETS, "max_new_tokens")
    pad_id = 0
    tokens, mask = _left_pad(prompts, length, pad_id)
    stops = _stop_ids(model, stop_ids, ignore_eos)
    key = jax.random.key(seed) if isinstance(seed, int) else seed
    logits, caches, states, prefill_aux = engine.prefill(
        model.graphdef, model.params, jnp.asarray(tokens), jnp.asarray(mask), plan, with_aux=return_trace
    )
    out, steps, records = engine.decode_loop(
        model.graphdef, model.params, plan, logits, caches, states, jnp.asarray(mask),
        jnp.int32(max_new_tokens), sampling, jnp.asarray(stops), jnp.int32(pad_id), key,
        capacity=capacity, trace=return_trace,
    )
    out = np.asarray(out)[:, :max_new_tokens]
    stop_set = {int(s) for s in stops if s >= 0}
    results = []
    for row in out:
        ids = []
        for t in row.tolist():
            if t in stop_set:
                break
            ids.append(t)
        results.append(ids)
    trace = None
    if return_trace:
        n = int(steps) - 1
        trace = {
            "prefill": jax.tree_util.tree_map(np.asarray, prefill_aux),
            "partition": jax.tree_util.tree_map(np.asarray, engine.stack_layers(states))
            if states[0] is not None else {},
            "decode": jax.tree_util.tree_map(lambda a: np.asarray(a[:n]), records),
        }
    return results, trace


def generate(
    model: LoadedModel,
    prompt_or_prompts: Prompt | Sequence[Prompt],
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | jax.Array = 0,
    method: Method | str | None = None,
    chat: bool | None = None,
    stop_ids: Sequence[int] | None = None,
    return_trace: bool = False,
) -> Generation:
    """Generates continuations of one prompt or a batch of prompts.

    Args:
      model: from ``popjax.load``.
      prompt_or_prompts: a string, a chat conversation (list of {"role", "content"}), or a list
        of either. Batches of different lengths are left-padded to a length bucket.
      max_new_tokens: tokens to generate at most (≥ 1). Traced: a new value within the same
        capacity bucket (64, 128, ...) does not recompile.
      temperature, top_k, top_p: 0 = greedy; top_k 0 and top_p 1 disable the filters.
      seed: an int or a ``jax.random.key`` for sampling.
      method: a pruning method (``popjax.POP(ratio=0.2, gamma=0.1)``, ...) or its name; dense
        when None.
      chat: apply the tokenizer's chat template (default: when the tokenizer has one).
      stop_ids: extra stop token ids besides the model's EOS.
      return_trace: also return per-layer partitions and per-step selections (``Generation.trace``).
    """
    single = isinstance(prompt_or_prompts, str) or (
        isinstance(prompt_or_prompts, (list, tuple))
        and prompt_or_prompts
        and isinstance(prompt_or_prompts[0], dict)
    )
    prompts = [prompt_or_prompts] if single else list(prompt_or_prompts)
    prompt_ids = _encode(model, prompts, chat)
    ids, trace = generate_ids(
        model, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, method, stop_ids, return_trace
    )
    texts = [model.tokenizer.decode(row, skip_special_tokens=True) for row in ids]
    return Generation(texts, ids, prompt_ids, trace)


def forward(
    model: LoadedModel,
    input_ids: Any,
    attention_mask: Any = None,
    method: Method | str | None = None,
) -> jax.Array:
    """Logits [B, T, V] (fp32) of ``input_ids`` [B, T] (or [T]) under a method's prefill.

    The batch is left-padded internally to a length bucket so one compile serves many lengths;
    ``attention_mask`` (1 = token, 0 = padding) may be left- or right-padded."""
    ids = np.asarray(input_ids, dtype=np.int64)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [B, T] with T ≥ 1; got shape {ids.shape}")
    mask = np.ones_like(ids) if attention_mask is None else np.asarray(attention_mask).reshape(ids.shape)
    T = ids.shape[1]
    if T > model.config.max_position_embeddings:
        raise ValueError(f"input of {T} tokens exceeds the model's context of {model.config.max_position_embeddings}")
    if ids.min() < 0 or ids.max() >= model.config.vocab_size:
        raise ValueError(f"input_ids hold values outside [0, {model.config.vocab_size})")
    length = engine.bucket_for(T, engine.PROMPT_BUCKETS, "an input length")
    pad = length - T
    tokens = np.pad(ids, ((0, 0), (pad, 0))).astype(np.int32)
    full_mask = np.pad(mask, ((0, 0), (pad, 0))).astype(np.int32)
    plan = resolve_method(method).bind(model.config)
    logits, _, _, _ = engine.prefill(
        model.graphdef, model.params, jnp.asarray(tokens), jnp.asarray(full_mask), plan, all_logits=True
    )
    return logits[:, pad:]
