"""The engines a CPU user would pick instead of popjax, timed on the default model in the same
run as popjax's own records (`popjax.bench.runner`): transformers' generate in fp32,
transformers with PyTorch's dynamic int8 quantization of its linear layers
(``torch.ao.quantization.quantize_dynamic``), and llama.cpp (``llama-cpp-python``) on the
default model's own GGUF file.

Each peer is optional: it is measured when its package is importable and skipped (None)
otherwise. Decode tokens/s are measured as popjax's are: greedy, ``max_new_tokens`` forced, the
time of one token (prefill) subtracted, medians of ``repeats``.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

log = logging.getLogger(__name__)


def _median_time(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _rates(gen: Callable[[int], Any], batch: int, max_new_tokens: int, repeats: int) -> dict[str, float]:
    """TTFT and decode tokens/s of ``gen(n)`` (generates n tokens for ``batch`` rows)."""
    gen(2)  # warm-up
    first = _median_time(lambda: gen(1), repeats)
    total = _median_time(lambda: gen(max_new_tokens), repeats)
    return {"ttft_s": first, "decode_tokens_per_s": batch * (max_new_tokens - 1) / max(total - first, 1e-9)}


def bench_transformers(gguf_path: Path, texts: list[str], batches: list[int], max_new_tokens: int, repeats: int,
                       quantize: bool = False) -> dict[str, Any] | None:
    """transformers' generate (PyTorch CPU, fp32, greedy) on ``texts``; with ``quantize`` its
    ``nn.Linear`` layers are replaced by PyTorch's dynamic int8 ones (int8 weights, activations
    quantized per call). None without torch."""
    try:
        import torch  # optional: PyTorch (popjax[test]), only for this baseline
        from transformers import AutoModelForCausalLM, AutoTokenizer  # optional: transformers' PyTorch models
    except ImportError:
        return None
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.padding_side = "left"
    hf = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32).eval()
    if quantize:
        hf = torch.ao.quantization.quantize_dynamic(hf, {torch.nn.Linear}, dtype=torch.qint8)
    out = {"engine": "transformers" + (" + torch dynamic int8" if quantize else " fp32"),
           "torch_threads": torch.get_num_threads(), "by_batch": {}}
    for batch in batches:
        enc = tok(texts[:batch], return_tensors="pt", padding=True)

        def gen(n):
            with torch.no_grad():
                hf.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)

        out["by_batch"][str(batch)] = _rates(gen, batch, max_new_tokens, repeats)
    out["decode_tokens_per_s"] = out["by_batch"][str(batches[0])]["decode_tokens_per_s"]
    return out


def bench_llama_cpp(gguf_path: Path, text: str, max_new_tokens: int, repeats: int) -> dict[str, Any] | None:
    """llama.cpp through ``llama-cpp-python`` (``pip install llama-cpp-python``: builds llama.cpp
    from source) on ``gguf_path`` at batch 1 with as many threads as cores: 64 greedy tokens
    from one prompt. None when ``llama_cpp`` is not importable."""
    try:
        from llama_cpp import Llama  # optional: llama-cpp-python, a peer measured only when installed
    except ImportError:
        return None
    threads = os.cpu_count() or 1
    llm = Llama(model_path=str(gguf_path), n_ctx=512, n_threads=threads, n_batch=512, verbose=False)
    prompt = llm.tokenize(text.encode())

    def gen(n):
        llm.reset()
        for i, _ in enumerate(llm.generate(prompt, top_k=1, temp=0.0, reset=True)):
            if i + 1 >= n:
                break

    rates = _rates(gen, 1, max_new_tokens, repeats)
    return {"engine": "llama.cpp", "gguf": gguf_path.name, "threads": threads, "by_batch": {"1": rates},
            "decode_tokens_per_s": rates["decode_tokens_per_s"]}


def bench_peers(gguf_path: Path, texts: list[str], batches: list[int], max_new_tokens: int, repeats: int) -> dict[str, Any]:
    """Every peer that is installed -> {name: result}; names: transformers, transformers_int8,
    llama_cpp (the default model's GGUF)."""
    out = {
        "transformers": bench_transformers(gguf_path, texts, batches, max_new_tokens, repeats),
        "transformers_int8": bench_transformers(gguf_path, texts, batches, max_new_tokens, repeats, quantize=True),
        "llama_cpp": bench_llama_cpp(gguf_path, texts[0], max_new_tokens, repeats),
    }
    return {name: result for name, result in out.items() if result is not None}
