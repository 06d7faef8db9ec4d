"""A validated generation request, padded to its buckets: what ``generate``, ``stream``, the
benchmark and the evaluations start the engine from (prompt ids -> padded tokens and mask, the
prepared method's plan and data, sampling, stop ids, a VLM batch's images)."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import engine, sharding
from .image_prompts import expand_placeholders, image_prompt
from .kernels import fallback
from .loaded import LoadedModel
from .methods import Method, method_label, prepared
from .sampling import SamplingParams

MAX_STOP_IDS = 8  # stop ids are padded to this static size so their number never recompiles

# (plan, graphdef, tokens shape, capacity, text only) whose kernels built (`kernels_checked`)
_CHECKED: set = set()


def with_kernel(method: Method, kernel: str) -> Method:
    """``method`` with its FFN method's ``kernel`` hyper-parameter set to ``kernel`` (a layer-level
    method's inner method's); a method without one as it is."""
    if "kernel" in method.hyper_parameters():
        return dataclasses.replace(method, kernel=kernel)
    inner = {f.name: with_kernel(v, kernel) for f in dataclasses.fields(method) if isinstance(v := getattr(method, f.name), Method)}
    return dataclasses.replace(method, **inner) if inner else method


def settled(method: Method, cfg) -> Method:
    """``method``, or its ``kernel="xla"`` twin where ``kernel="auto"`` fell back from its plan
    before (`GenerationRequest.kernels_checked`): the copies for a kernel that will not run are
    not built again."""
    if getattr(method.ffn_method, "kernel", None) == "auto" and fallback.fell_back(method.bind(cfg)) is not None:
        return with_kernel(method, "xla")
    return method


def pad_token_id(model: LoadedModel) -> int:
    """The id fed for padding: the tokenizer's pad token, else its EOS, else 0 (id-only models).
    Padded positions are masked everywhere, so the choice never changes a result."""
    tok = model.tokenizer
    for candidate in (getattr(tok, "pad_token_id", None), getattr(tok, "eos_token_id", None)):
        if candidate is not None:
            return int(candidate)
    return 0


def pad_batch(prompts: list[list[int]], pad_id: int, length: int | None = None, min_rows: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Left-pads prompts to ``length`` (default: their prompt bucket) and the batch to its bucket
    (at least ``min_rows``: a mesh's data axis) with dead rows (all padding, mask 0)
    -> tokens, mask [B_bucket, T_bucket] int32."""
    if length is None:
        length = engine.bucket_for(max(map(len, prompts)), engine.PROMPT_BUCKETS, "a prompt length")
    rows = engine.bucket_for(max(len(prompts), min_rows), engine.BATCH_BUCKETS, "a batch size")
    tokens = np.full((rows, length), pad_id, np.int32)
    mask = np.zeros((rows, length), np.int32)
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


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """A validated generation request, padded to its buckets (shared by generate, stream and
    the benchmark): ``req.start(model)`` runs prefill and samples the first token."""

    plan: Any
    data: Any  # the prepared method's calibrated data (`Method.data`), traced into the programs
    tokens: jax.Array  # [B_bucket, T_bucket]
    mask: jax.Array
    batch: int  # real rows
    capacity: int
    sampling: SamplingParams
    stops: np.ndarray  # [MAX_STOP_IDS], -1 = unused
    pad_id: int
    key: jax.Array
    images: Any = None  # a VLM batch's `engine.ImagePrompt` (None: text only)
    prompt_ids: list[list[int]] | None = None  # the prompts as run (image placeholders expanded)

    @classmethod
    def create(cls, model, prompts, max_new_tokens=64, temperature=0.0, top_k=0, top_p=1.0, seed=0, method=None,
               stop_ids=None, ignore_eos=False, capacity: int | None = None, images=None) -> "GenerationRequest":
        """Validates and pads; ``capacity`` (default: the bucket of ``max_new_tokens``) reserves
        cache slots for that many new tokens. ``images``: per prompt, its images (a VLM; each
        prompt's image placeholders are expanded to its images' patch counts first)."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens!r} is invalid; use an integer ≥ 1")
        sampling = SamplingParams.create(temperature, top_k, top_p)
        prompts = [list(p) for p in prompts]
        if not prompts:
            raise ValueError("no prompts given")
        expanded = expand_placeholders(model, prompts, images)
        prompts = expanded.rows
        check_prompt_lengths(model, prompts, max_new_tokens)
        method = settled(prepared(method, model), model.config)
        derived = model.derived_names()
        plan, data = method.bind(model.config), method.data(model)
        pad_id = pad_token_id(model)
        mesh = getattr(model, "mesh", None)
        data_rows = 1 if mesh is None else dict(mesh.shape).get("data", 1)
        tokens, mask = pad_batch(prompts, pad_id, min_rows=data_rows)  # dead rows change no result
        if mesh is not None:
            sharding.check_batch(tokens.shape[0], mesh)
        capacity = engine.bucket_for(max(max_new_tokens, capacity or 0), engine.CAPACITY_BUCKETS, "max_new_tokens")
        key = jax.random.key(seed) if isinstance(seed, int) else seed
        stops = _stop_ids(model, stop_ids, ignore_eos)
        placed = image_prompt(model, expanded.pixels, tokens, mask)
        request = cls(plan, data, jnp.asarray(tokens), jnp.asarray(mask), len(prompts), capacity, sampling, stops, pad_id, key,
                      placed, prompts)
        return request.kernels_checked(model, method, derived)

    def kernels_checked(self, model, method: Method, derived: frozenset = frozenset()) -> "GenerationRequest":
        """This request, or, where its plan reads rows through a compiled Pallas kernel
        (`fallback.TRIED`) that does not build at its shapes, the same request through XLA
        (``kernel="auto"``: one warning, `fallback.record_fallback`; the weight copies that only
        the kernel read, those built since ``derived`` named the model's, are released) or
        `fallback.KernelUnavailable` (``kernel="pallas"``). The engine's start and step are
        traced abstractly to reach the kernels (`popjax.kernels.fallback`: nothing runs or
        compiles whole), once per plan and shapes; a plan that fell back at any shape runs XLA
        from then on (`settled`)."""
        key = (self.plan, model.graphdef, tuple(self.tokens.shape), self.capacity, self.images is None)
        if fallback.plan_kernel(self.plan) not in fallback.TRIED or key in _CHECKED:
            return self
        try:
            self._trace(model)
            _CHECKED.add(key)
            return self
        except fallback.KernelUnavailable as err:
            fallback.fall_back(method_label(method), getattr(method.ffn_method, "kernel", "auto"), self.plan, err)
        xla = with_kernel(method, "xla")
        plan = xla.bind(model.config)
        model.release_derived(keep=derived)  # before the XLA data: a copy both read is rebuilt once
        return dataclasses.replace(self, plan=plan, data=xla.data(model))

    def _trace(self, model) -> None:
        """The start and one step traced abstractly (shapes only), as generate traces them."""
        with sharding.use_mesh(model):
            carry, _ = jax.eval_shape(lambda: self._start(model, False))
            jax.eval_shape(lambda c: engine.stream_step(model.graphdef, model.params, self.plan, c, self.sampling,
                                                        jnp.asarray(self.stops), jnp.int32(self.pad_id), data=self.data), carry)

    def start(self, model, with_aux: bool = False):
        with sharding.use_mesh(model):
            return self._start(model, with_aux)

    def _start(self, model, with_aux: bool):
        return engine.start(
            model.graphdef, model.params, self.plan, self.tokens, self.mask, self.key, self.sampling,
            jnp.asarray(self.stops), jnp.int32(self.pad_id), capacity=self.capacity, with_aux=with_aux, data=self.data,
            images=self.images,
        )

    def decode(self, model, carry, max_new_tokens: int, trace: bool = False):
        """The compiled decode loop from ``carry`` (consumed) -> (tokens [B, capacity], steps,
        trace records, final carry)."""
        with sharding.use_mesh(model):
            return self._decode(model, carry, max_new_tokens, trace)

    def _decode(self, model, carry, max_new_tokens: int, trace: bool):
        return engine.decode_loop(
            model.graphdef, model.params, self.plan, carry, jnp.int32(max_new_tokens), self.sampling,
            jnp.asarray(self.stops), jnp.int32(self.pad_id), capacity=self.capacity, trace=trace, data=self.data,
        )

    def step(self, model, carry):
        """One generation step alone (streaming); ``carry`` is consumed -> (carry, token [B])."""
        with sharding.use_mesh(model):
            return engine.stream_step(
                model.graphdef, model.params, self.plan, carry, self.sampling, jnp.asarray(self.stops), jnp.int32(self.pad_id),
                data=self.data,
            )

    def until_stop(self, row: list[int]) -> list[int]:
        """A row of generated ids up to (excluding) its first stop id."""
        stop_set = {int(s) for s in self.stops if s >= 0}
        for i, t in enumerate(row):
            if t in stop_set:
                return row[:i]
        return row
