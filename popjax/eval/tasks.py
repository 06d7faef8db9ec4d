"""The evaluation tasks: online teacher-forced NLL, fidelity to dense generation, HumanEval pass@1.

Every task takes a loaded model and a method and returns a dict of named metrics.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from ..generation import generate_ids
from ..loaded import LoadedModel
from ..methods import Dense, Method
from .sandbox import run_python
from .teacher import teacher_forced

HUMANEVAL_STOPS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\n```")


def _batches(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start : start + size]


# ------------------------------------------------------------------ online NLL


@dataclasses.dataclass(frozen=True)
class NLLSettings:
    prompt_tokens: int = 256  # P: prefilled context
    decode_tokens: int = 128  # N: tokens fed one at a time through the decode path
    windows: int = 16  # windows at evenly spaced offsets of the text
    batch_size: int = 8


def text_windows(model: LoadedModel, text: str, s: NLLSettings) -> tuple[list[list[int]], np.ndarray]:
    """Tokenises ``text`` and cuts ``s.windows`` windows of P + N tokens at evenly spaced offsets."""
    ids = model.tokenizer(text, add_special_tokens=False)["input_ids"]
    span = s.prompt_tokens + s.decode_tokens
    if len(ids) < span:
        raise ValueError(f"the text has {len(ids)} tokens; an NLL window needs {span}")
    starts = np.linspace(0, len(ids) - span, s.windows).astype(int)
    prompts = [ids[a : a + s.prompt_tokens] for a in starts]
    targets = np.array([ids[a + s.prompt_tokens : a + span] for a in starts], np.int32)
    return prompts, targets


def online_nll(model: LoadedModel, method: Method, text: str, s: NLLSettings) -> dict[str, Any]:
    """Mean NLL / perplexity of the N decoded tokens, and the NLL by decode position."""
    prompts, targets = text_windows(model, text, s)
    rows = []
    for idx in _batches(list(range(len(prompts))), s.batch_size):
        nll, _ = teacher_forced(model, method, [prompts[i] for i in idx], targets[idx])
        rows.append(nll)
    nll = np.concatenate(rows)
    return {
        "nll": float(nll.mean()),
        "ppl": float(np.exp(nll.mean())),
        "nll_by_position": nll.mean(axis=0).tolist(),
        "windows": len(prompts),
    }


# ------------------------------------------------------------------ code NLL


@dataclasses.dataclass(frozen=True)
class CodeNLLSettings:
    subset: int | None = 64  # first N HumanEval problems
    max_tokens: int = 128  # canonical-solution tokens scored (longer ones are cut)
    batch_size: int = 8


def code_nll(model: LoadedModel, method: Method, problems: list[dict], s: CodeNLLSettings) -> dict[str, Any]:
    """Teacher-forced NLL of HumanEval's canonical solutions given their prompts: the prompt
    through the method's prefill, the solution's tokens through its decode path (real code,
    nothing executed). Mean over all scored tokens."""
    tok = model.tokenizer
    prompts = [tok(p["prompt"], add_special_tokens=False)["input_ids"] for p in problems]
    solutions = [tok(p["canonical_solution"], add_special_tokens=False)["input_ids"][: s.max_tokens] for p in problems]
    order = np.argsort([len(x) for x in solutions])  # similar lengths share a batch
    total, count = 0.0, 0
    for idx in _batches(order.tolist(), s.batch_size):
        width = max(len(solutions[i]) for i in idx)
        targets = np.zeros((len(idx), width), np.int32)
        scored = np.zeros_like(targets, bool)
        for row, i in enumerate(idx):
            targets[row, : len(solutions[i])], scored[row, : len(solutions[i])] = solutions[i], True
        nll, _ = teacher_forced(model, method, [prompts[i] for i in idx], targets)
        total, count = total + float(nll[scored].sum()), count + int(scored.sum())
    return {"code_nll": total / count, "code_tokens": count, "problems": len(problems)}


# ------------------------------------------------------------------ fidelity to dense


@dataclasses.dataclass(frozen=True)
class FidelitySettings:
    max_new_tokens: int = 48
    batch_size: int = 8


def dense_reference(model: LoadedModel, prompts: list[list[int]], s: FidelitySettings) -> list[list[int]]:
    """Dense greedy continuations (stopping at EOS): the trajectories other methods are compared on."""
    out = []
    for batch in _batches(prompts, s.batch_size):
        out += generate_ids(model, batch, s.max_new_tokens)[0]
    return out


def fidelity(
    model: LoadedModel, method: Method, prompts: list[list[int]], reference: list[list[int]], s: FidelitySettings
) -> dict[str, Any]:
    """Agreement of greedy tokens with dense (prefix until the first divergence, and overall) and
    the KL(dense ‖ method) of next-token distributions along dense's own trajectory."""
    prefix, overall, kls = [], [], []
    for idx in _batches(list(range(len(prompts))), s.batch_size):
        batch = [prompts[i] for i in idx]
        ours = generate_ids(model, batch, s.max_new_tokens, method=method, ignore_eos=True)[0]
        targets = np.zeros((len(idx), s.max_new_tokens), np.int32)
        valid = np.zeros_like(targets, bool)
        for row, i in enumerate(idx):
            ref = reference[i]
            n = len(ref)
            if n == 0:
                continue
            same = np.array(ours[row][:n]) == np.array(ref)
            prefix.append(float(np.argmin(same) if not same.all() else n) / n)
            overall.append(float(same.mean()))
            targets[row, :n], valid[row, :n] = ref, True
        _, logp_dense = teacher_forced(model, Dense(), batch, targets, with_logprobs=True)
        _, logp_method = teacher_forced(model, method, batch, targets, with_logprobs=True)
        kl = np.sum(np.exp(logp_dense) * (logp_dense - logp_method), axis=-1)  # [B, N]
        kls.append(kl[valid])
    kl_all = np.concatenate(kls)
    return {
        "agreement_prefix": float(np.mean(prefix)),
        "agreement": float(np.mean(overall)),
        "kl": float(kl_all.mean()),
        "prompts": len(prompts),
    }


# ------------------------------------------------------------------ HumanEval


@dataclasses.dataclass(frozen=True)
class HumanEvalSettings:
    subset: int | None = None  # first N problems; None = all 164
    max_new_tokens: int = 192
    batch_size: int = 8
    timeout_s: float = 10.0
    workers: int = 2


def truncate_completion(text: str) -> str:
    """Cuts a completion at the first HumanEval stop sequence (the function body ends there)."""
    cut = min((text.find(s) for s in HUMANEVAL_STOPS if s in text), default=len(text))
    return text[:cut]


def check_program(problem: dict, completion: str) -> str:
    return f"{problem['prompt']}{completion}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def run_problems(problems: list[dict], completions: list[str], s: HumanEvalSettings) -> list[bool]:
    """Executes each problem's tests against its completion in sandboxed subprocesses."""
    programs = [check_program(p, c) for p, c in zip(problems, completions)]
    with ThreadPoolExecutor(max_workers=s.workers) as pool:
        results = list(pool.map(lambda code: run_python(code, timeout_s=s.timeout_s), programs))
    return [r.passed for r in results]


def humaneval(model: LoadedModel, method: Method, problems: list[dict], s: HumanEvalSettings) -> dict[str, Any]:
    """Greedy pass@1: the raw HumanEval prompt is completed (no chat template), cut at the stop
    sequences, and run against the problem's tests."""
    tok = model.tokenizer
    encoded = [tok(p["prompt"], add_special_tokens=False)["input_ids"] for p in problems]
    order = np.argsort([len(e) for e in encoded])  # similar lengths share a bucket and a batch
    completions = [""] * len(problems)
    for idx in tqdm(list(_batches(order.tolist(), s.batch_size)), desc=f"humaneval {method.name}", leave=False):
        outs = generate_ids(model, [encoded[i] for i in idx], s.max_new_tokens, method=method)[0]
        for i, out in zip(idx, outs):
            completions[i] = truncate_completion(tok.decode(out, skip_special_tokens=True))
    passed = run_problems(problems, completions, s)
    return {
        "pass_at_1": float(np.mean(passed)),
        "problems": len(problems),
        "passed_tasks": [p["task_id"] for p, ok in zip(problems, passed) if ok],
    }
