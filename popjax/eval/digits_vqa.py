"""Answer accuracy of the digits VLM (`digits_vlm`) under each pruning method, and how much POP's
partitions agree between its choices of scoring tokens (docs/vlm.md, "A VLM trained here").

Each of the 297 held-out digits is asked one of the five questions (round robin) through
`popjax.generate` with the image in the chat message, greedy, four new tokens; the answer is
right when its first digit word is the digit's (the model answers "it is <word>", so a decode
step, not the prompt's pass, writes the word). Every method prunes per prompt (``aggregate="per_sequence"``
where a method has it), as the papers evaluate one prompt at a time. The calibrated methods
(Wanda-sp, FLAP) calibrate on the training conversations' text (no image calibration corpus
exists for them: docs/vlm.md).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import numpy as np
from tqdm.auto import tqdm

import jax.numpy as jnp

from .. import engine, sharding
from ..corpus import Corpus
from ..generation import encode_prompts, generate
from ..image_prompts import split_images
from ..loaded import LoadedModel
from ..methods import make_method
from ..methods.base import Method
from ..methods.prompt_tokens import PROMPT_TOKENS
from ..requests import GenerationRequest
from .digits_vlm import ANSWER_PREFIX, DIGIT_WORDS, QUESTIONS, answer, digit_images, question

BATCH = 32


def methods_at(ratio: float) -> dict[str, Method]:
    """The issue's methods at ``ratio``, each named as the table shows it, pruning per prompt."""

    def per_prompt(name: str, **hyper: Any) -> Method:
        method = make_method(name, ratio=ratio, **hyper)
        if "per_sequence" in method.ffn_method.aggregates:
            method = make_method(name, ratio=ratio, aggregate="per_sequence", **hyper)
        return method

    out = {f"pop({c})": per_prompt("pop", prompt_tokens=c) for c in PROMPT_TOKENS}
    out.update({name: per_prompt(name) for name in ("static", "dynamic", "griffin", "wanda-sp", "flap", "prefill-only+pop")})
    return out


def text_corpus(model: LoadedModel) -> Corpus:
    """The training conversations' text (each question and answer, no image) as 16-token windows."""
    tok = model.tokenizer
    ids = []
    for i, word in enumerate(itertools.islice(itertools.cycle(DIGIT_WORDS), 256)):
        ids += tok(f"<|im_start|>user {QUESTIONS[i % len(QUESTIONS)]} <|im_end|><|im_start|>assistant {word} <|im_end|>")["input_ids"]
    return Corpus.from_token_ids("digits-questions", ids, window=16)


@dataclasses.dataclass
class Accuracy:
    correct: int
    total: int

    @property
    def value(self) -> float:
        return self.correct / self.total

    @property
    def stderr(self) -> float:
        """The binomial standard error √(p(1 − p)/n)."""
        p = self.value
        return math.sqrt(p * (1 - p) / self.total)


def accuracy(model: LoadedModel, method: Method | None, images, labels, trace: bool = False) -> tuple[Accuracy, list[Any]]:
    """Greedy answers to the held-out questions -> (accuracy, per-batch traces)."""
    words = model.tokenizer.convert_tokens_to_ids(list(DIGIT_WORDS))
    correct, traces = 0, []
    for start in range(0, len(images), BATCH):
        chunk = range(start, min(start + BATCH, len(images)))
        out = generate(model, [question(images[i], i) for i in chunk], max_new_tokens=4, method=method, return_trace=trace)
        said = [next((t for t in ids if t in words), None) for ids in out.token_ids]
        correct += sum(int(t == words[answer(labels[i], i)]) for t, i in zip(said, chunk))
        traces.append(out.trace)
    return Accuracy(correct, len(images)), traces


def answer_nll(model: LoadedModel, method: Method | None, images, labels) -> np.ndarray:
    """The NLL of the right digit word given the prompt and "it is", teacher-forced through the
    method's prefill and decode steps (the word is the third fed token) -> [n] nats. A finer
    measure than accuracy: it moves before an answer flips."""
    tok = model.tokenizer
    prefix = tok.convert_tokens_to_ids(list(ANSWER_PREFIX))
    out = []
    for start in range(0, len(images), BATCH):
        chunk = list(range(start, min(start + BATCH, len(images))))
        prompts, pictures = zip(*[split_images(question(images[i], i)) for i in chunk])
        ids = encode_prompts(model, list(prompts), None)
        req = GenerationRequest.create(model, ids, max_new_tokens=4, method=method, images=list(pictures))
        targets = np.zeros((req.tokens.shape[0], 3), np.int32)
        targets[: len(chunk)] = [[*prefix, tok.convert_tokens_to_ids(DIGIT_WORDS[answer(labels[i], i)])] for i in chunk]
        with sharding.use_mesh(model):
            nll, _, _ = engine.teacher_force(model.graphdef, model.params, req.plan, req.tokens, req.mask, jnp.asarray(targets),
                                             data=req.data, images=req.images)
        out.append(np.asarray(nll)[: len(chunk), 2])
    return np.concatenate(out)


def digits_task(model: LoadedModel, method: Method, limit: int | None = None) -> dict[str, float]:
    """``popjax eval``'s "digits_vqa" task: accuracy and answer NLL over the held-out digits
    (the first ``limit``) of the digits VLM (`digits_vlm`; ``popjax eval --model digits-vlm``)."""
    vocab = model.tokenizer.get_vocab() if model.tokenizer is not None else {}
    if not model.config.is_vision_language or any(w not in vocab for w in DIGIT_WORDS):
        raise ValueError(f"the digits_vqa task asks the digits VLM trained here (--model digits-vlm); {model.source} is not it")
    images, labels = digit_images("test")
    images, labels = images[:limit], labels[:limit]
    if method.needs_calibration:
        method = method.calibrate(model, text_corpus(model), cache=False)
    acc, _ = accuracy(model, method, images, labels)
    nll = answer_nll(model, method, images, labels)
    return {"digits_accuracy": acc.value, "digits_accuracy_stderr": acc.stderr, "digits_answer_nll": float(nll.mean()),
            "digits_images": acc.total}


def retained_overlap(traces_a: list[Any], traces_b: list[Any]) -> float:
    """Mean over prompts and layers of |R_a ∩ R_b| / |R| of two POP runs' per-prompt partitions."""
    shares = []
    for ta, tb in zip(traces_a, traces_b):
        ra, rb = np.asarray(ta["partition"]["retained_idx"]), np.asarray(tb["partition"]["retained_idx"])
        flat_a, flat_b = ra.reshape(-1, ra.shape[-1]), rb.reshape(-1, rb.shape[-1])
        shares += [len(set(a) & set(b)) / len(a) for a, b in zip(flat_a.tolist(), flat_b.tolist())]
    return float(np.mean(shares))


def digits_vqa(model: LoadedModel, ratios=(0.2, 0.4), limit: int | None = None,
               methods: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The accuracy table (dense and every method at each ratio, with standard errors) and the
    partition overlaps between POP's token choices -> a JSON-ready dict. ``methods``: the
    table's names (`methods_at`'s keys) to run, default all of them."""
    known = tuple(methods_at(ratios[0]) if ratios else ())
    if methods is not None and (unknown := [m for m in methods if m not in known]):
        raise ValueError(f"digits_vqa: methods {unknown} are not in the table; valid: {list(known)}")
    images, labels = digit_images("test")
    if limit is not None:
        images, labels = images[:limit], labels[:limit]
    rows = []

    def row(name: str, ratio: float, method: Method | None, trace: bool = False):
        if method is not None and method.needs_calibration:
            method = method.calibrate(model, text_corpus(model), cache=False)
        acc, traces = accuracy(model, method, images, labels, trace)
        nll = answer_nll(model, method, images, labels)
        rows.append({"method": name, "ratio": ratio, "accuracy": acc.value, "stderr": acc.stderr, "n": acc.total,
                     "answer_nll": float(nll.mean()), "answer_nll_stderr": float(nll.std(ddof=1) / np.sqrt(len(nll)))})
        return traces

    row("dense", 0.0, None)
    overlaps = {}
    jobs = [(r, name, m) for r in ratios for name, m in methods_at(r).items() if methods is None or name in methods]
    for ratio, name, method in tqdm(jobs, desc="digits VQA", unit="method"):
        traces = row(name, ratio, method, trace=name.startswith("pop("))
        if name.startswith("pop("):
            overlaps.setdefault(ratio, {})[name[4:-1]] = traces
    pairs = {f"{ratio}": {f"{a}/{b}": retained_overlap(t[a], t[b])
                          for a, b in itertools.combinations([c for c in PROMPT_TOKENS if c in t], 2)}
             for ratio, t in overlaps.items()}
    return {"rows": rows, "retained_overlap": pairs, "test_images": len(images), "chance": 0.1}


def markdown(result: dict[str, Any]) -> str:
    """The accuracy table (± one standard error) and the overlap table, in Markdown."""
    lines = ["| method | ratio | accuracy | ± s.e. | answer NLL | ± s.e. |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['method']} | {r['ratio']:.2f} | {r['accuracy']:.3f} | {r['stderr']:.3f} | {r['answer_nll']:.4f} | "
                     f"{r['answer_nll_stderr']:.4f} |")
    lines += ["", "| ratio | token choices | retained-set overlap |", "|---|---|---|"]
    for ratio, pairs in result["retained_overlap"].items():
        lines += [f"| {ratio} | {pair} | {share:.3f} |" for pair, share in pairs.items()]
    return "\n".join(lines)


def plot_accuracy(result: dict[str, Any], path) -> None:
    """Answer accuracy (± one standard error) against the pruning ratio, one line per method,
    chance and dense marked."""
    import matplotlib  # heavy: matplotlib only for the plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: see above

    rows = result["rows"]
    dense = next(r for r in rows if r["method"] == "dense")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["method"] for r in rows if r["method"] != "dense"):
        mine = sorted((r for r in rows if r["method"] == name), key=lambda r: r["ratio"])
        ratios = [0.0] + [r["ratio"] for r in mine]
        acc = [dense["accuracy"]] + [r["accuracy"] for r in mine]
        err = [dense["stderr"]] + [r["stderr"] for r in mine]
        ax.errorbar(ratios, acc, yerr=err, marker="o", capsize=3, label=name, linestyle="--" if name.startswith("pop(") else "-")
    ax.axhline(result["chance"], color="grey", linestyle=":", label="chance")
    ax.set_xlabel("global pruning ratio")
    ax.set_ylabel(f"answer accuracy ({result['test_images']} held-out digits)")
    ax.set_title("Digits VLM trained here: accuracy under pruning")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
