"""``popjax.generate`` and ``popjax.forward``: text in, text and ids out, through the engine."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import distributed, engine, sharding
from .convert.sources import no_images_message
from .image_prompts import expand_placeholders, image_prompt, split_images
from .images import ImageError
from .loaded import LoadedModel
from .methods import Method, prepared
from .requests import GenerationRequest


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


def encode_prompts(model: LoadedModel, prompts: list[Prompt], chat: bool | None) -> list[list[int]]:
    """Prompts (text, chat messages or token ids) -> token ids; a clear error for an empty one."""
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


def refuse_images(model: LoadedModel, images: Sequence[Sequence[Any]]) -> None:
    """One line when prompts hold images (per prompt, its list) and ``model`` has no vision
    tower: raised before the chat template sees them (a text model's template fails on a list
    content with a jinja TypeError)."""
    if any(len(row) for row in images) and not model.config.is_vision_language:
        raise ImageError(no_images_message(model.source))


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
    images: Sequence[Sequence[Any]] | None = None,
) -> tuple[list[list[int]], dict[str, Any] | None]:
    """Token-id prompts -> generated ids per prompt (stop token excluded), and the trace.

    ``ignore_eos`` generates exactly ``max_new_tokens`` unless a ``stop_ids`` entry appears
    (benchmarks, teacher-free evaluation). Batches pad to ``engine.BATCH_BUCKETS`` with dead
    rows that no method statistic sees; traces keep those rows' entries (per-sequence mode).
    ``images``: a VLM's images per prompt, one per image placeholder of its ids."""
    req = GenerationRequest.create(model, prompts, max_new_tokens, temperature, top_k, top_p, seed, method, stop_ids, ignore_eos,
                                   images=images)
    carry, prefill_aux = req.start(model, with_aux=return_trace)
    partition = None
    if return_trace:  # read before the decode loop consumes (donates) the carry
        partition = distributed.to_host(engine.stacked_method_states(carry.state))
    out, steps, records, _ = req.decode(model, carry, max_new_tokens, trace=return_trace)
    # to_host: on a mesh over several processes, every process reads the same global tokens
    out = distributed.to_host(out)[: req.batch, :max_new_tokens]
    results = [req.until_stop(row) for row in out.tolist()]
    trace = None
    if return_trace:
        n = int(distributed.to_host(steps)) - 1
        trace = {
            "prefill": distributed.to_host(prefill_aux),
            "partition": partition,
            "decode": jax.tree_util.tree_map(lambda a: a[:n], distributed.to_host(records)),
        }
    return results, trace


@dataclasses.dataclass(frozen=True)
class StreamPiece:
    """One streamed token: its id and the text it completes (empty while a multi-byte
    character is still incomplete; the text arrives with the token that completes it)."""

    token_id: int
    text: str


def stream_ids(
    model: LoadedModel,
    prompt: Sequence[int],
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | jax.Array = 0,
    method: Method | str | None = None,
    stop_ids: Sequence[int] | None = None,
    ignore_eos: bool = False,
    images: Sequence[Any] | None = None,
) -> Iterator[int]:
    """Yields the generated ids of one token-id prompt (with ``images``, a VLM's, one per image
    placeholder) as they are produced (stop id excluded): the decode loop's own step jitted
    alone, so the tokens equal ``generate_ids``'."""
    req = GenerationRequest.create(model, [prompt], max_new_tokens, temperature, top_k, top_p, seed, method, stop_ids, ignore_eos,
                                   images=None if images is None else [list(images)])
    carry, _ = req.start(model)
    pending = distributed.to_host(carry.token)  # read before the first step consumes the carry
    for produced in range(1, max_new_tokens + 1):
        if produced < max_new_tokens:  # queue the next step before reading this token, so
            carry, upcoming = req.step(model, carry)  # the device never waits for the host
        token = int(distributed.to_host(pending)[0])  # the same token on every process
        if not req.until_stop([token]):
            return
        yield token
        pending = upcoming


def stream(
    model: LoadedModel,
    prompt: Prompt,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | jax.Array = 0,
    method: Method | str | None = None,
    chat: bool | None = None,
    stop_ids: Sequence[int] | None = None,
) -> Iterator[StreamPiece]:
    """Streams one prompt's continuation token by token (same arguments and tokens as
    ``generate``): ``for piece in popjax.stream(model, "Hi"): print(piece.text, end="")``."""
    if not isinstance(prompt, str) and not (isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict)):
        raise ValueError(f"stream() takes one prompt (a string or a chat conversation); got {type(prompt).__name__}")
    prompt, images = split_images(prompt)
    refuse_images(model, [images])
    prompt_ids = encode_prompts(model, [prompt], chat)[0]
    ids: list[int] = []
    shown = ""
    for token in stream_ids(model, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, method, stop_ids, images=images):
        ids.append(token)
        text = model.tokenizer.decode(ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            yield StreamPiece(token, "")
            continue
        yield StreamPiece(token, text[len(shown) :])
        shown = text


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
        of either. Batches of different lengths are left-padded to a length bucket. On a
        vision-language model a message's content may be a list of items, as transformers'
        processors take them: {"type": "image", "image": PIL image | path | array} and
        {"type": "text", "text": ...}; a batch may mix image and text-only prompts.
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
    prompts, images = zip(*[split_images(p) for p in prompts])
    refuse_images(model, images)
    prompt_ids = encode_prompts(model, list(prompts), chat)
    ids, trace = generate_ids(
        model, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, method, stop_ids, return_trace,
        images=images if any(images) else None,
    )
    texts = [model.tokenizer.decode(row, skip_special_tokens=True) for row in ids]
    return Generation(texts, ids, prompt_ids, trace)


def forward(
    model: LoadedModel,
    input_ids: Any,
    attention_mask: Any = None,
    method: Method | str | None = None,
    images: Sequence[Sequence[Any]] | None = None,
) -> jax.Array:
    """Logits [B, T, V] (fp32) of ``input_ids`` [B, T] (or [T]) under a method's prefill.

    The batch is left-padded internally to a length bucket so one compile serves many lengths;
    ``attention_mask`` (1 = token, 0 = padding) may be left- or right-padded. ``images`` (a
    VLM): per row, its images; ``input_ids`` hold each image's placeholders expanded (one per
    merged patch, as transformers' processor writes them)."""
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
    mesh = getattr(model, "mesh", None)
    rows = engine.bucket_for(max(ids.shape[0], 1 if mesh is None else dict(mesh.shape).get("data", 1)),
                             engine.BATCH_BUCKETS, "a batch size")
    if mesh is not None:
        sharding.check_batch(rows, mesh)
    tokens = np.pad(ids, ((0, rows - ids.shape[0]), (pad, 0))).astype(np.int32)
    full_mask = np.pad(mask, ((0, rows - ids.shape[0]), (pad, 0))).astype(np.int32)
    placed = None
    if images is not None:
        valid_rows = [row[m.astype(bool)].tolist() for row, m in zip(ids, mask)]
        expanded = expand_placeholders(model, valid_rows, images)
        for i, (given, needed) in enumerate(zip(valid_rows, expanded.rows)):
            if len(given) != len(needed):
                raise ValueError(f"row {i} of input_ids holds {len(given)} tokens, {len(needed)} with its images' placeholders "
                                 "expanded: forward() takes expanded placeholders (one per merged patch)")
        placed = image_prompt(model, expanded.pixels, tokens, full_mask)
    method = prepared(method, model)
    plan = method.bind(model.config)
    with sharding.use_mesh(model):
        logits, _, _, _ = engine.prefill(
            model.graphdef, model.params, jnp.asarray(tokens), jnp.asarray(full_mask), plan, all_logits=True, data=method.data(model),
            images=placed,
        )
    # on a mesh over several processes, replicated: np.asarray reads the same logits on every process
    return distributed.replicated(logits[: ids.shape[0], pad:])
