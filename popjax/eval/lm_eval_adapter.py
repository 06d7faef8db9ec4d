"""popjax as a model of lm-evaluation-harness (PyPI ``lm-eval``), as the ``popjax lm-eval`` command
(``popjax/cli/lm_eval.py``) and the ``next_line`` task of ``popjax eval`` run it.

Importing this module registers the model name ``"popjax"`` with lm-eval::

    import lm_eval
    import popjax.eval.lm_eval_adapter  # registers "popjax"
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model="popjax", model_args="method=pop,ratio=0.2,gamma=0.1",
        tasks=["my_task"], task_manager=TaskManager(include_path="my_tasks/"))

Contexts go through the method's *prefill* and scored continuation tokens through its *decode*
path one at a time, as the method meets text online (docs/lm_eval.md says what that means per
method). Requests are sorted and batched by length bucket so one compile serves many batches.
Methods whose statistics span the batch (``aggregate="shared"``) make a score depend on its
batch-mates, so ``aggregate`` defaults to a batch-independent value here (``per_sequence``, or
``per_token`` for TEAL/CATS); batch-dependent methods are batched only with continuations of equal
length, so no padding enters a shared statistic.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np

try:  # the `eval` extra; `popjax lm-eval` explains how to install it when it is missing
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model

    LM_EVAL_IMPORT_ERROR: ImportError | None = None
except ImportError as err:  # pragma: no cover - depends on the environment
    TemplateLM, LM_EVAL_IMPORT_ERROR = object, err

    def register_model(*_names):
        return lambda cls: cls


from tqdm import tqdm

from .. import engine
from ..convert.default_model import DEFAULT_MODEL
from ..generation import generate_ids
from ..requests import MAX_STOP_IDS
from ..loaded import LoadedModel
from ..loading import load
from ..methods import Method, make_method, method_class, method_fields
from ..methods.base import ROW_AGGREGATES
from .teacher import teacher_forced

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 8
LOGPROB_BUDGET_BYTES = 1 << 30  # [B, N, V] fp32 log-probabilities fetched per call for is_greedy
# lm-eval hands these to every model it builds; JAX picks the device, batches are fixed-size.
IGNORED_ARGS = ("device", "max_batch_size")
# PopjaxLM's own model_args (docs/lm_eval.md describes them); every other key is a method's
ADAPTER_ARGS = ("source", "method", "dtype", "weights", "mesh", "batch_size", "max_length", "max_gen_toks", "seed", "add_bos_token", "uniform_shapes")


def require_lm_eval() -> None:
    if LM_EVAL_IMPORT_ERROR is not None:
        raise ImportError(
            "lm-evaluation-harness is not installed; `pip install 'popjax[eval]'` (package lm-eval)"
        ) from LM_EVAL_IMPORT_ERROR


def _target_bucket(n: int) -> int:
    """Continuation lengths are padded to powers of two up to 128, then to multiples of 128,
    so the teacher-forced scan compiles once per bucket instead of once per length."""
    return 2 ** max(2, math.ceil(math.log2(n))) if n <= 128 else 128 * math.ceil(n / 128)


def _parse_batch_size(value: Any) -> int:
    if isinstance(value, str) and value.startswith("auto"):
        log.info("batch_size=%s: popjax uses fixed batches; using %d", value, DEFAULT_BATCH_SIZE)
        return DEFAULT_BATCH_SIZE
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).isdigit() or int(value) < 1:
        raise ValueError(f"batch_size={value!r} is invalid; use an integer ≥ 1 (or 'auto')")
    return int(value)


def build_method(method: str, hyper: dict[str, Any]) -> Method:
    """``make_method`` with lm-eval's model_args semantics: an unknown key is an error naming the
    valid ones; an unset ``aggregate`` becomes the first batch-independent value the method accepts
    (``per_sequence``, TEAL/CATS's ``per_token``), so a score never depends on its batch-mates."""
    fields = sorted(set().union(*(method_fields(name) for name in method.split("+"))) - {"mlp_method"})
    unknown = sorted(set(hyper) - set(fields))
    if unknown:
        raise ValueError(
            f"unknown popjax model_args {unknown}; valid: {sorted(ADAPTER_ARGS)} and, for "
            f"method={method!r}, its hyper-parameters {fields}"
        )
    if "aggregate" in fields and hyper.get("aggregate") is None:
        accepted = set().union(*(method_class(name).aggregates for name in method.split("+")))
        independent = [a for a in ROW_AGGREGATES if a in accepted]
        if independent:
            return make_method(method, **{**hyper, "aggregate": independent[0]})
        log.warning("method %r has no batch-independent aggregate: its scores depend on the batch", method)
    return make_method(method, **hyper)


@register_model("popjax")
class PopjaxLM(TemplateLM):
    """lm-eval model over a popjax model and pruning method (``--model popjax``)."""

    def __init__(
        self,
        source: Any = DEFAULT_MODEL,
        method: str = "dense",
        dtype: str | None = None,
        weights: str | None = None,
        mesh: Any = None,
        batch_size: int | str | None = DEFAULT_BATCH_SIZE,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        seed: int = 0,
        add_bos_token: bool | None = None,
        uniform_shapes: bool = False,
        **method_args: Any,
    ) -> None:
        require_lm_eval()
        super().__init__()

        for name in IGNORED_ARGS:
            if method_args.pop(name, None) is not None:
                log.info("model arg %s is ignored: JAX places the model, batches are fixed", name)
        self.method = build_method(method, method_args)  # validated before the (slow) load
        self.batch_size = _parse_batch_size(DEFAULT_BATCH_SIZE if batch_size is None else batch_size)
        self.model = source if isinstance(source, LoadedModel) else load(source, dtype=dtype, weights=weights, mesh=mesh)
        if self.model.tokenizer is None:
            raise ValueError(f"model {self.model.source} has no tokenizer; lm-eval tasks are text")
        self.method = self.method.prepare(self.model)
        self.tokenizer = self.model.tokenizer
        context = self.model.config.max_position_embeddings
        self._max_length = context if max_length is None else int(max_length)
        if not 2 <= self._max_length <= context:
            raise ValueError(f"max_length={max_length} is outside [2, {context}] (the model's context)")
        self.max_gen_toks, self.seed, self.add_bos_token = int(max_gen_toks), int(seed), add_bos_token
        self.independent = self.method.batch_independent
        # pad every log-likelihood request to the largest context and continuation buckets of the
        # call: one compile per method (for short tasks with many methods, compiles dominate)
        self.uniform_shapes = str(uniform_shapes).lower() in ("true", "1")  # model_args give strings
        log.info("popjax lm-eval model: %s, method %r", self.model.source, self.method)

    @classmethod
    def from_loaded(cls, model, method, batch_size: int = DEFAULT_BATCH_SIZE, **kwargs: Any) -> "PopjaxLM":
        """An lm-eval model over an already loaded model and a `Method` object (no reload, no
        model_args parsing): how ``popjax eval`` runs lm-eval tasks inside its sweep."""
        lm = cls(source=model, method="dense", batch_size=batch_size, **kwargs)
        lm.method = method.prepare(model)
        lm.independent = lm.method.batch_independent
        return lm

    # ------------------------------------------------------------ tokenisation (as lm-eval's HFLM)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """Context of an empty-context request and of the first rolling window: BOS, else EOS."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "popjax")).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        if add_special_tokens is None:
            add_special_tokens = self.add_bos_token
        bos = self.tokenizer.bos_token
        if add_special_tokens is None and bos and string.startswith(bos):
            add_special_tokens = False  # a chat-templated prompt already holds BOS (as HFLM)
        extra = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        return list(self.tokenizer.encode(string, **extra))

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    # ------------------------------------------------------------ scoring

    def _batches(self, order: list[int], key=lambda i: 0) -> list[list[int]]:
        """Request indices in ``order`` -> batches of ≤ batch_size sharing one compile ``key(i)``."""
        batches: list[list[int]] = []
        for i in order:
            if batches and key(batches[-1][0]) == key(i) and len(batches[-1]) < self.batch_size:
                batches[-1].append(i)
            else:
                batches.append([i])
        return batches

    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False, with_greedy: bool = True
    ) -> list[tuple[float, bool]]:
        """(cache key, context ids, continuation ids) -> (log-likelihood, is_greedy) per request:
        context through the method's prefill, continuation through its decode path."""

        contexts, targets = [], []
        for _, context, continuation in requests:
            if len(continuation) > self.max_length:
                raise ValueError(
                    f"a continuation of {len(continuation)} tokens exceeds max_length={self.max_length}"
                )
            # as HFLM: keep the last max_length + 1 tokens of context + continuation (the final
            # continuation token is only predicted, never fed to the model)
            contexts.append(list(context)[-(self.max_length + 1 - len(continuation)) :])
            targets.append(list(continuation))
        keys = [
            (
                _target_bucket(len(t)) if self.independent else len(t),
                engine.bucket_for(len(c), engine.PROMPT_BUCKETS, "a context length"),
            )
            for c, t in zip(contexts, targets)
        ]
        if self.uniform_shapes and self.independent and keys:
            keys = [max(keys)] * len(keys)
        # longest first (as HFLM): a batch too large for memory fails at once, not at the end
        order = sorted((i for i in range(len(requests)) if targets[i]), key=lambda i: keys[i], reverse=True)
        results: list[tuple[float, bool]] = [(0.0, True)] * len(requests)  # empty continuation: log 1
        vocab = self.model.config.vocab_size
        progress = tqdm(total=len(requests), disable=disable_tqdm, desc="popjax loglikelihood")
        progress.update(len(requests) - len(order))
        for batch in self._batches(order, keys.__getitem__):
            n = keys[batch[0]][0]
            # is_greedy needs [B, N, V] log-probabilities; split a batch whose array is too big
            step = max(1, LOGPROB_BUDGET_BYTES // (n * vocab * 4)) if with_greedy else len(batch)
            for start in range(0, len(batch), step):
                chunk = batch[start : start + step]
                padded = np.zeros((len(chunk), n), np.int32)
                for r, i in enumerate(chunk):
                    padded[r, : len(targets[i])] = targets[i]
                # the last, smaller batch of a bucket is padded with dead rows: no extra compile
                nll, logp = teacher_forced(
                    self.model, self.method, [contexts[i] for i in chunk], padded, with_logprobs=with_greedy,
                    min_rows=min(step, self.batch_size), prompt_length=keys[batch[0]][1],
                )
                for r, i in enumerate(chunk):
                    k = len(targets[i])
                    greedy = bool((logp[r, :k].argmax(-1) == padded[r, :k]).all()) if with_greedy else False
                    results[i] = (-float(nll[r, :k].astype(np.float64).sum()), greedy)
            progress.update(len(batch))
        progress.close()
        for (cache_key, _, _), result in zip(requests, results):
            if cache_key is not None:
                self.cache_hook.add_partial("loglikelihood", cache_key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole texts over lm-eval's disjoint rolling windows of ``max_length``
        tokens, the first conditioned on BOS/EOS, each scored as a (context, continuation) pair."""
        from lm_eval import utils as lm_utils  # optional: lm-evaluation-harness (popjax[eval])

        windows, owners = [], []
        for index, (text,) in enumerate(req.args for req in requests):
            for context, predicted in map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, context, predicted))
                owners.append(index)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm, with_greedy=False)
        totals = [0.0] * len(requests)
        for owner, (score, _) in zip(owners, scores):
            totals[owner] += score
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ------------------------------------------------------------ generation

    def _single_token_stops(self, until: list[str]) -> list[int]:
        """Ids of ``until`` strings that are one whole token: the decode loop stops on them early
        (the text cut below stays the reference, so this only saves steps)."""
        eos = (set(self.model.config.eos_token_ids) | {self.tokenizer.eos_token_id}) - {None}
        ids: list[int] = []
        for text in until:
            enc = self.tok_encode(text, add_special_tokens=False)
            if len(enc) == 1 and self.tok_decode(enc, skip_special_tokens=False) == text and enc[0] not in eos:
                ids += [] if enc[0] in ids else enc
        return ids[: max(0, MAX_STOP_IDS - len(eos))]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """``generate_ids`` with the method (greedy unless ``do_sample``), cut at ``until``."""
        # optional: lm-evaluation-harness (popjax[eval])
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        results: list[str] = [""] * len(requests)
        progress = tqdm(total=len(requests), disable=disable_tqdm, desc="popjax generate_until")
        batch_no = 0
        for members in groups.values():
            kwargs = dict(normalize_gen_kwargs(dict(requests[members[0]].args[1]), self.max_gen_toks))
            eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen = int(kwargs.pop("max_gen_toks"))
            if not 1 <= max_gen < self.max_length:
                raise ValueError(f"max_gen_toks={max_gen} must be in [1, max_length={self.max_length})")
            sampled = bool(kwargs.pop("do_sample", False))
            temperature = float(kwargs.pop("temperature", 0.0)) if sampled else 0.0
            top_k, top_p = int(kwargs.pop("top_k", 0) or 0), float(kwargs.pop("top_p", 1.0) or 1.0)
            if kwargs:
                log.warning("generation kwargs %s are not supported by popjax and are ignored", sorted(kwargs))
            contexts = {}
            for i in members:
                ids = self.tok_encode(requests[i].args[0])[-(self.max_length - max_gen) :]
                contexts[i] = ids or [self.prefix_token_id]
            order = sorted(members, key=lambda i: len(contexts[i]), reverse=True)
            for batch in self._batches(order):  # generate_ids buckets prompt lengths itself
                out, _ = generate_ids(
                    self.model, [contexts[i] for i in batch], max_new_tokens=max_gen, temperature=temperature,
                    top_k=top_k, top_p=top_p, seed=self.seed + batch_no, method=self.method,
                    stop_ids=self._single_token_stops(until),
                )
                batch_no += 1
                for i, ids in zip(batch, out):
                    text = postprocess_generated_text(self.tok_decode(ids), until, None)
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                progress.update(len(batch))
        progress.close()
        return results


# ---------------------------------------------------------------- tasks


def task_manager_for(tasks: list[str], include_path: str | None, builtin: bool = True):
    """A TaskManager that knows ``tasks``, or a ValueError naming the unknown ones.

    Indexing lm-eval's thousands of built-in YAMLs takes tens of seconds, so when every task is
    found under ``include_path`` the built-ins are not indexed (include_path wins either way);
    ``builtin=False`` never indexes them."""
    from lm_eval.tasks import TaskManager  # optional: lm-evaluation-harness (popjax[eval])

    manager = None
    if include_path is not None:
        if not Path(include_path).is_dir():
            raise FileNotFoundError(f"--include-path {include_path} is not a directory")
        local = TaskManager(include_path=include_path, include_defaults=False)
        if not builtin or all(local.match_tasks([t]) for t in tasks):
            manager = local
    elif not builtin:
        raise ValueError("--no-builtin-tasks needs --include-path DIR (the local task YAMLs)")
    if manager is None:
        manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:
        raise ValueError(
            f"unknown lm-eval task(s) {unknown}; pass --include-path DIR for local task YAMLs "
            "(`lm-eval ls tasks` lists the built-in ones)"
        )
    return manager
