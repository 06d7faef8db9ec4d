"""Scoring BIG-bench multiple-choice queries (`popjax.eval.bigbench`) with the engine.

Each choice's log-likelihood is that of its tokens after the prompt, the prompt through the
method's prefill and the choice's tokens through its decode path, as the lm-eval adapter scores
a (context, continuation) request (docs/lm_eval.md), so the two routes give the same numbers.

**One prefill per prompt.** The program is `engine.teacher_force` vmapped over a query's K
choices, prompts and weights unmapped: XLA computes the prefill, which reads only the prompts,
once for all K (XLA's FLOP estimate barely grows with K: tested), and runs each choice's tokens
from that state.

**Shapes.** Queries are sorted by prompt bucket, then by their longest choice, and scored
``batch_size`` prompts at a time (fewer when K × prompts would pass `MAX_CHOICE_ROWS`). Every batch
of a task has the task's most choices K and the batch bucket (dead rows and padded choices are
scored and dropped); its prompt bucket (``engine.PROMPT_BUCKETS``) and choice bucket
(`CHOICE_BUCKETS`) are those of its own longest prompt and choice. On a CPU the cost is the padded
tokens' FLOPs, so padding follows the lengths (PIQA: prompts of at most 33 tokens, solutions of 2 to
231, median 16). A bucket joins the next larger one in use when that adds little padding
(`MERGE_PADDING`), since a compile costs more than a few padded steps; programs are cached per
shape, so tasks and methods of equal shapes share them.

**Tokens** follow lm-eval's rule for causal models (``TemplateLM._encode_pair``): trailing
whitespace of the prompt moves to the choice; prompt + choice is encoded whole and the choice's
tokens are what follows the prompt's own encoding; a prompt longer than the model's context
keeps its last tokens.

Methods must be batch-independent (``aggregate`` per_sequence / per_token, as the sweeps build
them): a shared selection would depend on the batch and on the padding.

**The lm-eval route** (`write_lm_eval_task`, `lm_eval_scores`): a task as a local lm-eval task,
a YAML and a JSON-lines file its ``json`` builder reads offline (``popjax lm-eval --include-path
DIR --no-builtin-tasks``). Each document holds a query exactly as `build_queries` builds it
(``context``: task prefix, shots, appended choices, output prefix), its ``choices`` and the index
of the best-scored one (``label``; a list when several tie); with an empty target delimiter
lm-eval scores the same strings and reports ``acc`` and ``acc_norm``. Its ``acc`` is BIG-bench's
``multiple_choice_grade`` when one choice has the best score and no two log-likelihoods tie.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from .. import distributed, engine
from ..loaded import LoadedModel
from ..methods import Method, method_label, prepared
from ..requests import pad_batch, pad_token_id
from . import local_tasks
from .bigbench import Query, Task, build_queries, grade, norm_correct
from .paired import wilson_interval
from .lm_eval_adapter import PopjaxLM, task_manager_for

log = logging.getLogger(__name__)

CHOICE_BUCKETS = (4, 8, 16, 32, 64, 128, 256, 512)
MAX_CHOICE_ROWS = 64  # prompts per call × K at most: every choice row holds its own KV cache
# A bucket joins the next larger one in use when its batches × the extra length stay within this:
# a compile costs about the CPU time of ~48 padded decode steps (SmolLM2-135M on 2 cores: ~11 s
# per compile, ~0.25 s per decode step of 32 rows)
MERGE_PADDING = 48


@functools.partial(jax.jit, static_argnames=("graphdef", "plan"))
def _choices_program(graphdef, params, plan, tokens, mask, targets, data=None):
    """tokens, mask [B, T]; targets [K, B, N] -> nll [K, B, N]: `engine.teacher_force` of each
    of the K target rows after the same prompts (vmapped; the prefill is not batched over K)."""
    run = lambda t: engine.teacher_force(graphdef, params, plan, tokens, mask, t, data=data)[0]
    return jax.vmap(run)(targets)


def compile_counts() -> dict[str, int]:
    """The engine's executables (`engine.compile_counts`) plus this module's choice programs."""
    return {**engine.compile_counts(), "bigbench_choices": _choices_program._cache_size()}


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text)["input_ids"])


def encode_pair(tokenizer, context: str, target: str) -> tuple[list[int], list[int]]:
    """(prompt ids, choice ids) as lm-eval encodes a causal model's request."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, target = context[:-spaces], context[-spaces:] + target
    whole, prompt = _encode(tokenizer, context + target), _encode(tokenizer, context)
    return prompt, whole[len(prompt):]


def _prefix_id(tokenizer) -> int:
    """What lm-eval conditions an empty context on: BOS, else EOS."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return int(bos if bos is not None else tokenizer.eos_token_id)


def encode_queries(model: LoadedModel, queries: list[Query]) -> tuple[list[list[int]], list[list[list[int]]]]:
    """-> (prompt ids per query, choice ids per query and choice), truncated as lm-eval does."""
    if model.tokenizer is None:
        raise ValueError(f"model {model.source} has no tokenizer; BIG-bench tasks are text")
    context = model.config.max_position_embeddings
    prompts, choices = [], []
    for q in queries:
        pairs = [encode_pair(model.tokenizer, q.prompt, c) for c in q.texts]
        ids = pairs[0][0] or [_prefix_id(model.tokenizer)]
        longest = max(len(t) for _, t in pairs)
        if any(len(t) == 0 for _, t in pairs):
            raise ValueError(f"a choice of {q.choices} encodes to no tokens after its prompt")
        prompts.append(ids[-(context + 1 - longest):] if len(ids) + longest > context + 1 else ids)
        choices.append([t for _, t in pairs])
    return prompts, choices


def choice_logprobs(model: LoadedModel, method: Method, queries: list[Query], batch_size: int = 8,
                    progress: Callable | None = None) -> list[np.ndarray]:
    """Σ log p(choice tokens | prompt) [K_q] (float64) for every query, under ``method``."""
    if not queries:
        return []
    method = prepared(method, model)
    plan, data = method.bind(model.config), method.data(model)
    prompts, choices = encode_queries(model, queries)
    K = max(map(len, choices))
    # fewer prompts per call for many choices (dyck_languages has 84), a batch bucket so none is padded
    fits = max(1, min(batch_size, MAX_CHOICE_ROWS // K))
    batch_size = max(b for b in engine.BATCH_BUCKETS if b <= fits)
    rows = min(batch_size, len(queries))
    longest = [max(map(len, c)) for c in choices]
    prompt_bucket = [engine.bucket_for(len(p), engine.PROMPT_BUCKETS, "a prompt length") for p in prompts]
    order = sorted(range(len(queries)), key=lambda i: (prompt_bucket[i], longest[i], len(prompts[i])))
    batches = [order[s : s + batch_size] for s in range(0, len(order), batch_size)]
    out: list[np.ndarray] = [np.zeros(0)] * len(queries)
    pad = pad_token_id(model)
    shapes = batch_shapes([max(len(prompts[i]) for i in b) for b in batches], [max(longest[i] for i in b) for b in batches])
    for batch, (T, N) in zip(progress(batches) if progress else batches, shapes):
        tokens, mask = pad_batch([prompts[i] for i in batch], pad, length=T, min_rows=rows)
        targets = np.zeros((K, tokens.shape[0], N), np.int32)
        for r, i in enumerate(batch):
            for k, ids in enumerate(choices[i]):
                targets[k, r, : len(ids)] = ids
        nll = _choices_program(model.graphdef, model.params, plan, jnp.asarray(tokens), jnp.asarray(mask),
                               jnp.asarray(targets), data=data)
        nll = np.asarray(distributed.to_host(nll), np.float64)  # the same values on every process
        for r, i in enumerate(batch):
            out[i] = np.array([-nll[k, r, : len(ids)].sum() for k, ids in enumerate(choices[i])])
    return out


def merged_buckets(lengths: list[int], buckets: tuple[int, ...], what: str) -> list[int]:
    """The longest item of each batch [batches] -> its bucket [batches]: the smallest of
    ``buckets`` that holds it, raised to the next bucket in use when that pads its batches by at
    most `MERGE_PADDING` positions in all (one compile fewer for a little padding)."""
    out = [engine.bucket_for(n, buckets, what) for n in lengths]
    used = sorted(set(out))
    for small, large in zip(used, used[1:]):
        if out.count(small) * (large - small) <= MERGE_PADDING:
            out = [large if b == small else b for b in out]
    return out


def choice_buckets(longest: list[int]) -> list[int]:
    """`merged_buckets` over `CHOICE_BUCKETS`: each batch's number of decode steps."""
    return merged_buckets(longest, CHOICE_BUCKETS, "a choice length")


def batch_shapes(prompts: list[int], choices: list[int]) -> list[tuple[int, int]]:
    """Each batch's longest prompt and longest choice [batches] -> its (prompt bucket, choice
    bucket): prompt buckets merged first, then the choice buckets of each prompt bucket's batches."""
    T = merged_buckets(prompts, engine.PROMPT_BUCKETS, "a prompt length")
    N = list(choices)
    for t in set(T):
        where = [i for i, b in enumerate(T) if b == t]
        for i, n in zip(where, choice_buckets([choices[i] for i in where])):
            N[i] = n
    return list(zip(T, N))


def score_queries(queries: list[Query], logprobs: list[np.ndarray]) -> dict[str, Any]:
    """accuracy (``multiple_choice_grade``), lm-eval's ``acc_norm``, their 95% Wilson intervals,
    and the per-query grades."""
    grades = [grade(q, lp) for q, lp in zip(queries, logprobs)]
    norms = [norm_correct(q, lp) for q, lp in zip(queries, logprobs)]
    n = len(queries)
    acc, acc_norm = float(np.mean(grades)), float(np.mean(norms))
    return {"acc": acc, "acc_ci": list(wilson_interval(acc, n)), "acc_norm": acc_norm,
            "acc_norm_ci": list(wilson_interval(acc_norm, n)), "examples": n, "grades": grades}


def evaluate_task(model: LoadedModel, method: Method, task: Any, shots: int = 0, limit: int | None = None,
                  seed: int = 42, batch_size: int = 8) -> dict[str, Any]:
    """One record for ``task`` (a BIG-bench or BBH `Task`, or `popjax.eval.piqa.PiqaTask`: anything
    with ``label``, ``chance``, ``preferred_score`` and ``queries(shots, limit, seed)``) under
    ``method``: the metrics of `score_queries`, the task's chance level, examples/s (wall,
    compiles included) and the compiles it caused."""
    queries = task.queries(shots, limit, seed)
    before, start = compile_counts(), time.perf_counter()
    logprobs = choice_logprobs(model, method, queries, batch_size)
    seconds = time.perf_counter() - start
    after = compile_counts()
    metrics = score_queries(queries, logprobs)
    log.info("%s %s: acc %.3f (%d examples, %.1f s)", task.label, method.name, metrics["acc"], len(queries), seconds)
    return {
        "method": method.name,
        "label": method_label(method, exclude=("ratio", "aggregate")),
        **method.reported(),
        "task": task.label,
        "shots": shots,
        "seed": seed,
        "preferred_score": task.preferred_score,
        "chance": task.chance,
        **metrics,
        "seconds": seconds,
        "examples_per_s": len(queries) / max(seconds, 1e-9),
        "compiles": {k: after[k] - before[k] for k in after if after[k] != before[k]},
    }


# ---------------------------------------------------------------- the lm-eval route


def lm_eval_name(task: Task) -> str:
    """The lm-eval task name of a BIG-bench (BBH) task: ``bigbench_<name>`` (``bbh_<name>``), "/" -> "__"."""
    return f"{task.family}_" + task.name.replace("/", "__")


def documents(queries: list[Query]) -> list[dict[str, Any]]:
    """{"context", "choices", "label"} per query (label: an index, or the indices that tie)."""
    docs = []
    for q in queries:
        best = [i for i, s in enumerate(q.scores) if s == max(q.scores)]
        docs.append({"context": q.prompt, "choices": list(q.choices), "label": best[0] if len(best) == 1 else best})
    return docs


def task_yaml(name: str, data_file: Path) -> str:
    """A multiple-choice task over ``data_file``: the context ends with BIG-bench's output prefix
    and a choice follows it directly, in few-shot examples too."""
    return local_tasks.task_yaml(name, data_file, ('target_delimiter: ""', 'fewshot_delimiter: ""'))


def write_lm_eval_task(task: Task, directory: str | Path, shots: int = 0, limit: int | None = None, seed: int = 42) -> str:
    """Writes ``<name>.yaml`` and ``<name>.jsonl`` for ``task`` into ``directory`` -> the lm-eval
    task name. The documents are popjax eval's queries, in the same order."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    name = lm_eval_name(task)
    data = directory / f"{name}.jsonl"
    tmp = data.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(d) + "\n" for d in documents(build_queries(task, shots, limit, seed))), encoding="utf-8")
    tmp.replace(data)
    (directory / f"{name}.yaml").write_text(task_yaml(name, data), encoding="utf-8")
    return name


def lm_eval_scores(model: LoadedModel, method: Method, task: Task, directory: str | Path, shots: int = 0, limit: int | None = None,
                   seed: int = 42, batch_size: int = 8) -> dict[str, Any]:
    """Runs ``task`` through lm-eval's ``simple_evaluate`` on a loaded model and method ->
    {"acc", "acc_norm", "logprobs": [per document, per choice]} (documents in file order)."""
    import lm_eval  # optional: lm-evaluation-harness (popjax[eval])

    name = write_lm_eval_task(task, directory, shots, limit, seed)
    lm = PopjaxLM.from_loaded(model, method, batch_size=batch_size, uniform_shapes=True)
    manager = task_manager_for([name], str(directory), builtin=False)
    results = lm_eval.simple_evaluate(model=lm, tasks=[name], task_manager=manager, bootstrap_iters=0,
                                      log_samples=True, random_seed=seed)
    samples = sorted(results["samples"][name], key=lambda s: s["doc_id"])
    logprobs = [np.array([float(r[0]) for r in s["filtered_resps"]]) for s in samples]
    scores = results["results"][name]
    return {"acc": float(scores["acc,none"]), "acc_norm": float(scores["acc_norm,none"]), "logprobs": logprobs}
